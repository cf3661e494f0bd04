"""Attention patterns: every head of one block, read in one trace and drawn as a grid of query x key maps.

``attention_probabilities`` is the softmax of a block's attention scores,
``[1, heads, query, key]`` in float32, recomputed from the queries and keys
vLLM's attention kernel receives (the kernel itself keeps no pattern).

    python examples/attention_pattern.py                       # the built-in SmolLM2-135M-Instruct, block 3
    python examples/attention_pattern.py --layer 10 --prompt "When Mary and John went to the store, John gave a drink to"
    python examples/attention_pattern.py --tiny                # a tiny random Llama (needs vlenvoys-testing), as CI runs it

Writes ``attention_pattern.png`` and ``attention_pattern.json`` (the key each head's last query attends to most) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import vlenvoys
from matplotlib.figure import Figure


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", default="When Mary and John went to the store, John gave a drink to")
    parser.add_argument("--layer", type=int, help="the block, negative from the end (default: 3; with --tiny, 1)")
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for the plot and the results")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of the built-in model (for CI)")
    return parser.parse_args(argv)


def load(tiny: bool, out: Path) -> vlenvoys.StandardizedVLLM:
    """The built-in SmolLM2-135M-Instruct, or with ``tiny`` a tiny random Llama built into ``out``."""
    if not tiny:
        return vlenvoys.load()
    import vlenvoys_testing  # test support: tiny random checkpoints with a tokenizer

    return vlenvoys.load(str(vlenvoys_testing.tiny_model("LlamaForCausalLM", out / "tiny-llama")))


def patterns(model: vlenvoys.StandardizedVLLM, prompt: str, layer: int) -> tuple[list[int], torch.Tensor]:
    """The prompt's token ids and block ``layer``'s pattern, ``[heads, query, key]``."""
    ids = model.tokenizer(prompt)["input_ids"]
    with model.trace(ids, temperature=0.0, max_tokens=1):
        pattern = model.layers[layer].self_attn.attention_probabilities.save()
    return ids, pattern[0].cpu()


def plot(pattern: torch.Tensor, tokens: list[str], layer: int, path: Path) -> Path:
    """One query x key map per head, on a shared 0-1 colour scale."""
    heads = pattern.shape[0]
    columns = min(heads, 4)
    rows = math.ceil(heads / columns)
    size = max(3.0, 0.25 * len(tokens))
    figure = Figure(figsize=(columns * size + 1, rows * size), layout="constrained")
    grid = figure.subplots(rows, columns, squeeze=False)
    labels = [repr(token)[1:-1] for token in tokens]
    for head, axes in enumerate(grid.flat):
        if head >= heads:
            axes.set_axis_off()
            continue
        image = axes.imshow(pattern[head].numpy(), cmap="Blues", vmin=0, vmax=1)
        axes.set_title(f"head {head}", fontsize=9)
        axes.set_xticks(range(len(tokens)), labels, rotation=90, fontsize=6)
        axes.set_yticks(range(len(tokens)), labels, fontsize=6)
    figure.colorbar(image, ax=grid, label="attention probability (query row, key column)")
    figure.suptitle(f"block {layer}: attention patterns")
    figure.savefig(path, dpi=120)
    return path


def main(argv: list[str] | None = None) -> dict:
    options = arguments(argv)
    options.out.mkdir(parents=True, exist_ok=True)
    model = load(options.tiny, options.out)
    try:
        layer = options.layer if options.layer is not None else (1 if options.tiny else 3)
        ids, pattern = patterns(model, options.prompt, layer)  # a block that does not exist: vlenvoys.NoSuchBlock
        layer %= model.num_layers
    finally:
        vlenvoys.shutdown(model)
    tokens = [model.tokenizer.decode([token]) for token in ids]
    plot(pattern, tokens, layer, options.out / "attention_pattern.png")
    strongest = pattern[:, -1].max(-1)
    results = {
        "prompt": options.prompt,
        "layer": layer,
        "shape": list(pattern.shape),
        "last_query": [
            {"head": head, "key": int(key), "token": tokens[int(key)], "probability": round(float(p), 4)}
            for head, (p, key) in enumerate(zip(strongest.values, strongest.indices, strict=True))
        ],
    }
    (options.out / "attention_pattern.json").write_text(json.dumps(results, indent=1))
    for head in results["last_query"]:
        print(f"head {head['head']}: the last token attends most to {head['token']!r} (position {head['key']}, {head['probability']:.2f})")
    print(f"wrote {options.out / 'attention_pattern.png'}")
    return results


if __name__ == "__main__":  # vLLM starts its engine in processes that import this file again
    main()
