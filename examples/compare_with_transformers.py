"""Check vlenvoys against transformers yourself: every block's values, same weights, float32, several prompts.

Reads each block's residual stream in (``layer_input``), attention and MLP outputs
(``attention_output``, ``mlp_output``) and stream out (``layer_output``) in one
vlenvoys trace per prompt, then the same four from transformers' own modules
(forward hooks on the decoder layers, their ``self_attn`` and ``mlp``), and
reports the largest relative difference per value and block:
``max |vlenvoys - transformers| / max |transformers|``. Float32 rounding gives
about 1e-6; vlenvoys' own tests hold every family under 1e-4.

For Llama-like checkpoints (``model.layers[i].self_attn`` / ``.mlp`` in transformers);
other families name their modules differently (see the docs' families pages).

    python examples/compare_with_transformers.py                 # the built-in SmolLM2-135M-Instruct
    python examples/compare_with_transformers.py --model PATH --prompt "One" --prompt "Two"
    python examples/compare_with_transformers.py --tiny          # a tiny random Llama (needs vlenvoys-testing)

Writes ``compare_with_transformers.png`` (blocks x values, log10 of the relative
difference) and ``compare_with_transformers.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import vlenvoys
from matplotlib.figure import Figure

VALUES = ("layer_input", "attention_output", "mlp_output", "layer_output")
PROMPTS = ("The Eiffel Tower is located in the city of", "def fibonacci(n):\n    return")


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a checkpoint folder or hub name (default: the built-in SmolLM2-135M-Instruct)")
    parser.add_argument("--prompt", action="append", help="a prompt (repeat for more; default: two built-in ones)")
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for the plot and the results")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of the built-in model (for CI)")
    return parser.parse_args(argv)


def read_vlenvoys(model: vlenvoys.StandardizedVLLM, ids: list[int]) -> dict[str, list[torch.Tensor]]:
    """Each value of each block, ``[tokens, hidden]`` in float32 on the CPU, from one trace of the prompt."""
    accessors = {  # nnterp's names for the four values (``model.layers[i].self_attn.attention_output`` and so on)
        "layer_input": model.layers_input, "attention_output": model.attentions_output,
        "mlp_output": model.mlps_output, "layer_output": model.layers_output,
    }
    with model.trace(ids, temperature=0.0, max_tokens=1):
        read = dict().save()  # only what is saved comes back from the trace
        for name in VALUES:
            read[name] = []
        for block in range(model.num_layers):  # in the order the model computes them, block by block
            for name in VALUES:
                read[name].append(accessors[name][block])
    return {name: [value[0].float().cpu() for value in values] for name, values in read.items()}


def read_transformers(reference: torch.nn.Module, ids: list[int]) -> dict[str, list[torch.Tensor]]:
    """The same values from transformers' modules, by forward hooks, ``[tokens, hidden]`` each."""
    read: dict[str, dict[int, torch.Tensor]] = {name: {} for name in VALUES}

    def first(output):  # a decoder layer or an attention returns a tuple in some transformers versions
        return output[0] if isinstance(output, tuple) else output

    hooks = []
    for index, layer in enumerate(reference.model.layers):
        def entering(module, args, kwargs, index=index):
            read["layer_input"][index] = (args[0] if args else kwargs["hidden_states"])[0].detach()

        def keep(name, index=index):
            return lambda module, args, output: read[name].__setitem__(index, first(output)[0].detach())

        hooks += [
            layer.register_forward_pre_hook(entering, with_kwargs=True),
            layer.self_attn.register_forward_hook(keep("attention_output")),
            layer.mlp.register_forward_hook(keep("mlp_output")),
            layer.register_forward_hook(keep("layer_output")),
        ]
    try:
        with torch.no_grad():
            reference(torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    return {name: [by_block[i].float() for i in range(len(by_block))] for name, by_block in read.items()}


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        raise ValueError(f"shapes differ: vlenvoys {list(got.shape)}, transformers {list(want.shape)}")
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def plot(differences: torch.Tensor, path: Path) -> Path:
    """Blocks x values, coloured by log10 of the largest relative difference over the prompts."""
    figure = Figure(figsize=(6.5, max(3.5, 0.3 * differences.shape[0] + 1.5)), layout="constrained")
    axes = figure.subplots()
    logs = differences.clamp_min(1e-12).log10()
    image = axes.imshow(logs.numpy(), aspect="auto", cmap="magma", vmin=-9, vmax=-3, origin="lower")
    for block in range(differences.shape[0]):
        for column in range(differences.shape[1]):
            axes.text(column, block, f"{differences[block, column].item():.0e}", ha="center", va="center", fontsize=7,
                      color="white" if logs[block, column] < -6 else "black")
    axes.set_xticks(range(len(VALUES)), VALUES, rotation=20, ha="right")
    axes.set_yticks(range(differences.shape[0]))
    axes.set_ylabel("block")
    axes.set_title("vlenvoys against transformers: largest relative difference")
    figure.colorbar(image, ax=axes, label="log10 relative difference")
    figure.savefig(path, dpi=120)
    return path


def main(argv: list[str] | None = None) -> dict:
    options = arguments(argv)
    options.out.mkdir(parents=True, exist_ok=True)
    path = options.model
    if options.tiny:
        import vlenvoys_testing  # test support: tiny random checkpoints with a tokenizer

        path = str(vlenvoys_testing.tiny_model("LlamaForCausalLM", options.out / "tiny-llama"))
    model = vlenvoys.load(path, dtype="float32")  # None: the built-in model
    try:
        prompts = options.prompt or list(PROMPTS)
        token_ids = [model.tokenizer(prompt)["input_ids"] for prompt in prompts]
        ours = [read_vlenvoys(model, ids) for ids in token_ids]
        checkpoint = model.vllm_entrypoint.llm_engine.model_config.model  # the checkpoint vLLM loaded
    finally:
        vlenvoys.shutdown(model)

    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    theirs = [read_transformers(reference, ids) for ids in token_ids]
    blocks = len(ours[0]["layer_output"])
    differences = torch.tensor([
        [max(relative(got[name][block], want[name][block]) for got, want in zip(ours, theirs, strict=True))
         for name in VALUES]
        for block in range(blocks)
    ])
    plot(differences, options.out / "compare_with_transformers.png")
    largest = differences.max().item()
    where = divmod(int(differences.argmax()), len(VALUES))
    results = {
        "model": str(checkpoint),
        "prompts": prompts,
        "values": list(VALUES),
        "relative_differences": differences.tolist(),  # [block][value], the largest over the prompts
        "largest": largest,
        "largest_at": {"block": where[0], "value": VALUES[where[1]]},
    }
    (options.out / "compare_with_transformers.json").write_text(json.dumps(results, indent=1))
    print(f"{len(prompts)} prompts, {blocks} blocks: largest relative difference {largest:.2e} "
          f"(block {where[0]}, {VALUES[where[1]]}); float32 rounding gives about 1e-6")
    print(f"wrote {options.out / 'compare_with_transformers.png'}")
    return results


if __name__ == "__main__":  # vLLM starts its engine in processes that import this file again
    main()
