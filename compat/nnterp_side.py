"""The nnterp side of the side-by-side check: nnterp 1.3's StandardizedTransformer on transformers.

Runs a short interpretability script (logit lens, steering, one head's
attention pattern, activation patching between two prompts) on a tiny random
Llama and saves what it got; ``test_vlenvoys_side.py`` runs the same script
with vlenvoys on vLLM, on the same checkpoint, and compares.

nnterp 1.3 needs nnsight 0.7 (it imports ``nnsight.intervention.tracing``,
gone in 0.8) and vlenvoys pins nnsight 0.8.1, so the two sides run in two
environments (``nox -s nnterp_side`` then ``nox -s nnterp``) and meet through
the folder this script writes:

    OUT/model/                 the tiny Llama (float32 safetensors) and its tokenizer
    OUT/nnterp.safetensors     the results, the steering vector, the prompts' token ids;
                               its metadata holds the script's parameters and versions

Usage: ``python compat/nnterp_side.py OUT``. Imports nothing of vlenvoys.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]

#: The script's parameters, written into the results for the vLLM side to reuse.
PROMPT = "The capital of France is"  # the lens, pattern and steering prompt; the patching source
TARGET = "The capital of Italy is"  # the patching target: as many tokens as PROMPT, so no padding
LAYER, HEAD, FACTOR = 1, 2, 4.0  # the tiny model has 3 layers of 4 heads
SEED = 0  # of the steering vector


def tiny_llama(folder: Path) -> Path:
    """The repository's tiny Llama (`vlenvoys_testing.tiny_model`), built here without importing vlenvoys.

    models.py needs only torch, transformers, tokenizers and filelock, so it is
    loaded as a file: the model is the one every Llama test of the repo uses.
    """
    spec = importlib.util.spec_from_file_location("tiny_models", ROOT / "packages/testing/src/vlenvoys_testing/models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.tiny_model("LlamaForCausalLM", folder)


# The script. test_vlenvoys_side.py has the same four functions for vLLM; the
# differences are the engines': see the comments there.


def logit_lens(model, prompt):
    """Next-token probabilities of every layer's output stream at the last position, [layers, vocab]."""
    with model.trace(prompt):
        lens = list().save()
        for i in range(model.num_layers):
            lens.append(model.project_on_vocab(model.layers_output[i][:, -1]).softmax(-1))
        logits = model.logits[:, -1].save()
    return torch.cat(lens), logits[0]


def head_pattern(model, prompt, layer, head):
    """One head's attention pattern, [query, key]."""
    with model.trace(prompt):
        pattern = model.attention_probabilities[layer][:, head].save()
    return pattern[0]


def steered_logits(model, prompt, layer, vector, factor):
    """Last-token logits with factor * vector added to a layer's output stream at every position, [vocab]."""
    with model.trace(prompt):
        model.steer(layer, vector, factor=factor)
        logits = model.logits[:, -1].save()
    return logits[0]


def patched_logits(model, source, target, layer):
    """target's last-token logits with the layer's output at the last position taken from source, [vocab]."""
    with model.trace() as tracer:
        # Both invokes read the same module: nnsight 0.7 passes a value from one
        # invoke to the next only through a barrier.
        barrier = tracer.barrier(2)
        with tracer.invoke(source):
            stream = model.layers_output[layer][:, -1]
            barrier()
        with tracer.invoke(target):
            barrier()
            model.layers_output[layer][:, -1] = stream
            # model.logits is the whole batch's here (nnsight does not split the
            # model's output by invoke); the LM head's output is this invoke's.
            logits = model.lm_head.output[:, -1].save()
    return logits[0]


def clean_logits(model, prompt):
    with model.trace(prompt):
        logits = model.logits[:, -1].save()
    return logits[0]


def main(out: Path) -> None:
    from nnterp import StandardizedTransformer
    from nnterp.interventions import logit_lens as nnterp_logit_lens

    shutil.rmtree(out, ignore_errors=True)  # never leave an earlier run's results to compare against
    path = tiny_llama(out / "model")
    model = StandardizedTransformer(str(path), enable_attention_probs=True, dtype=torch.float32, device_map="cpu")
    vector = torch.randn(model.hidden_size, generator=torch.Generator().manual_seed(SEED))

    with torch.no_grad():
        lens, logits = logit_lens(model, PROMPT)
        results = {
            "lens": lens,
            "logits": logits,
            "pattern": head_pattern(model, PROMPT, LAYER, HEAD),
            "steered": steered_logits(model, PROMPT, LAYER, vector, FACTOR),
            "target_logits": clean_logits(model, TARGET),
            "patched": patched_logits(model, PROMPT, TARGET, LAYER),
        }
        # nnterp's own logit lens must agree with the one written out above.
        own = nnterp_logit_lens(model, PROMPT)[0]
    if not torch.allclose(own, lens, atol=1e-6):
        raise AssertionError(f"nnterp.interventions.logit_lens differs by {(own - lens).abs().max():.3g}")

    ids = {name: model.tokenizer(text)["input_ids"] for name, text in (("prompt", PROMPT), ("target", TARGET))}
    if len(ids["prompt"]) != len(ids["target"]):
        raise AssertionError(f"patching prompts of different lengths would be padded: {ids}")
    tensors = {name: value.detach().float().contiguous() for name, value in results.items()}
    tensors["steering_vector"] = vector
    tensors |= {f"input_ids.{name}": torch.tensor(value) for name, value in ids.items()}
    metadata = {
        "script": json.dumps({"prompt": PROMPT, "target": TARGET, "layer": LAYER, "head": HEAD, "factor": FACTOR}),
        "versions": json.dumps({name: version(name) for name in ("nnterp", "nnsight", "transformers", "torch")}),
    }
    save_file(tensors, str(out / "nnterp.safetensors"), metadata=metadata)

    top = lens.topk(3, dim=-1)
    print(f"nnterp {version('nnterp')} / nnsight {version('nnsight')}: results in {out}")
    for layer, (ids_, probs) in enumerate(zip(top.indices, top.values, strict=True)):
        tokens = model.tokenizer.convert_ids_to_tokens(ids_)
        shown = ", ".join(f"{token!r} {p:.3f}" for token, p in zip(tokens, probs.tolist(), strict=True))
        print(f"  lens layer {layer}: {shown}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python compat/nnterp_side.py OUT")
    main(Path(sys.argv[1]).absolute())
