"""Logit lens: what each block's residual stream would predict next, read in one trace.

Each block's output stream (``layer_output``) at every position goes through
the model's final norm and unembedding (``project_on_vocab``); the plot shows,
per block and position, the top next-token prediction and its probability.

    python examples/logit_lens.py                      # the built-in SmolLM2-135M-Instruct
    python examples/logit_lens.py --prompt "The capital of Japan is" --out results/
    python examples/logit_lens.py --tiny               # a tiny random Llama (needs vlenvoys-testing), as CI runs it

Writes ``logit_lens.png`` and ``logit_lens.json`` (the top predictions at the last position, per block) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import vlenvoys
from matplotlib.figure import Figure


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", default="The Eiffel Tower is located in the city of")
    parser.add_argument("--top", type=int, default=3, help="predictions listed per block at the last position")
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for the plot and the results")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of the built-in model (for CI)")
    return parser.parse_args(argv)


def load(tiny: bool, out: Path) -> vlenvoys.StandardizedVLLM:
    """The built-in SmolLM2-135M-Instruct, or with ``tiny`` a tiny random Llama built into ``out``."""
    if not tiny:
        return vlenvoys.load()
    import vlenvoys_testing  # test support: tiny random checkpoints with a tokenizer

    return vlenvoys.load(str(vlenvoys_testing.tiny_model("LlamaForCausalLM", out / "tiny-llama")))


def logit_lens(model: vlenvoys.StandardizedVLLM, prompt: str) -> tuple[list[int], torch.Tensor]:
    """The prompt's token ids and ``[blocks, positions, vocab]``: each block's next-token probabilities."""
    ids = model.tokenizer(prompt)["input_ids"]
    with model.trace(ids, temperature=0.0, max_tokens=1):
        per_block = list().save()
        for block in model.layers:
            per_block.append(model.project_on_vocab(block.layer_output[0]).softmax(-1))
    return ids, torch.stack(per_block).float().cpu()


def plot(probabilities: torch.Tensor, tokens: list[str], decode, path: Path) -> Path:
    """Blocks x positions, coloured by the top prediction's probability and labelled with its token."""
    best, ids = probabilities.max(-1)
    blocks, positions = best.shape
    figure = Figure(figsize=(max(6.0, 0.9 * positions + 2), max(4.0, 0.3 * blocks + 1.5)), layout="constrained")
    axes = figure.subplots()
    image = axes.imshow(best.numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=1, origin="lower")
    for block in range(blocks):
        for position in range(positions):
            label = repr(decode(int(ids[block, position])))[1:-1]  # escapes keep "\n" and " " visible
            axes.text(position, block, label, ha="center", va="center", fontsize=7,
                      color="black" if best[block, position] > 0.6 else "white")
    axes.set_xticks(range(positions), [repr(token)[1:-1] for token in tokens], rotation=45, ha="right")
    axes.set_yticks(range(blocks))
    axes.set_xlabel("input token (the prediction is for the next one)")
    axes.set_ylabel("block")
    axes.set_title("logit lens: each block's top next-token prediction")
    figure.colorbar(image, ax=axes, label="probability")
    figure.savefig(path, dpi=120)
    return path


def main(argv: list[str] | None = None) -> dict:
    options = arguments(argv)
    options.out.mkdir(parents=True, exist_ok=True)
    model = load(options.tiny, options.out)
    try:
        ids, probabilities = logit_lens(model, options.prompt)
    finally:
        vlenvoys.shutdown(model)
    tokenizer = model.tokenizer
    decode = lambda token: tokenizer.decode([token])  # noqa: E731
    plot(probabilities, [decode(token) for token in ids], decode, options.out / "logit_lens.png")
    top = probabilities[:, -1].topk(options.top, dim=-1)
    results = {
        "prompt": options.prompt,
        "blocks": [
            [{"token": decode(token), "probability": round(p, 4)} for token, p in zip(row.tolist(), values.tolist(), strict=True)]
            for row, values in zip(top.indices, top.values, strict=True)
        ],
    }
    (options.out / "logit_lens.json").write_text(json.dumps(results, indent=1))
    for block, predictions in enumerate(results["blocks"]):
        print(f"block {block:2d}: " + "  ".join(f"{p['token']!r} {p['probability']:.2f}" for p in predictions))
    print(f"wrote {options.out / 'logit_lens.png'}")
    return results


if __name__ == "__main__":  # vLLM starts its engine in processes that import this file again
    main()
