"""The vlenvoys side: the script of ``nnterp_side.py`` on vLLM, compared with what nnterp 1.3 got.

Reads the folder ``nnterp_side.py`` wrote, named by ``$VLENVOYS_NNTERP_RESULTS``
(``nox -s nnterp`` runs both sides and sets it), loads the same checkpoint on
vLLM and runs the same four functions. A missing folder fails the tests: this
file is only collected by that session (pytest's testpaths are packages/).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from vlenvoys_testing import oracle

#: As the oracle suite: logits to 1e-4 of their scale, probabilities to 1e-5.
TOLERANCE, PROBABILITY_TOLERANCE = 1e-4, 1e-5

#: The largest |vlenvoys - nnterp| per result, printed at the end of the session (see conftest.py).
DIFFERENCES: dict[str, float] = {}


# The script, as in nnterp_side.py. Where the engines differ: vlenvoys'
# model.logits is already the last token's, [1, vocab]; a trace takes
# vLLM's sampling parameters (temperature=0.0 as every test here); and each
# invoke is its own vLLM request, so patching reads in one trace and writes in
# the next where nnterp passes the value between two invokes of one trace.


def logit_lens(model, prompt):
    with model.trace(prompt, temperature=0.0):
        lens = list().save()
        for i in range(model.num_layers):
            lens.append(model.project_on_vocab(model.layers_output[i][:, -1]).softmax(-1))
        logits = model.logits.save()
    return torch.cat(lens), logits[0]


def head_pattern(model, prompt, layer, head):
    with model.trace(prompt, temperature=0.0):
        pattern = model.attention_probabilities[layer][:, head].save()
    return pattern[0]


def steered_logits(model, prompt, layer, vector, factor):
    with model.trace(prompt, temperature=0.0):
        model.steer(layer, vector, factor=factor)
        logits = model.logits.save()
    return logits[0]


def patched_logits(model, source, target, layer):
    with model.trace(source, temperature=0.0):
        stream = model.layers_output[layer][:, -1].save()
    with model.trace(target, temperature=0.0):
        model.layers_output[layer][:, -1] = stream
        logits = model.logits.save()
    return logits[0]


def clean_logits(model, prompt):
    with model.trace(prompt, temperature=0.0):
        logits = model.logits.save()
    return logits[0]


@pytest.fixture(scope="module")
def nnterp() -> dict:
    """nnterp's results, the script's parameters and the checkpoint's path."""
    folder = os.environ.get("VLENVOYS_NNTERP_RESULTS")
    results = Path(folder or "<unset>") / "nnterp.safetensors"
    if not results.is_file():
        pytest.fail(
            f"no nnterp results at {results} ($VLENVOYS_NNTERP_RESULTS={folder!r}): "
            "run `nox -s nnterp`, which writes them with compat/nnterp_side.py first"
        )
    with safe_open(str(results), "pt") as file:
        tensors = {name: file.get_tensor(name) for name in file.keys()}
        metadata = file.metadata()
    return {**tensors, **json.loads(metadata["script"]), "model": results.parent / "model"}


@pytest.fixture(scope="module")
def model(nnterp):
    with oracle.engine(str(nnterp["model"]), dtype="float32") as loaded:
        yield loaded


def compare(label: str, got: torch.Tensor, want: torch.Tensor, tolerance: float, relative: bool = True) -> None:
    """Record the largest difference and check it against tolerance (times the value's scale when relative)."""
    assert got.shape == want.shape, (label, got.shape, want.shape)
    difference = (got.float() - want).abs().max().item()
    DIFFERENCES[label] = difference
    scale = max(1.0, want.abs().max().item()) if relative else 1.0
    assert difference <= tolerance * scale, f"{label}: |vlenvoys - nnterp| = {difference:.3g}"


def test_same_tokens(model, nnterp):
    tokenizer = model.tokenizer
    assert tokenizer(nnterp["prompt"])["input_ids"] == nnterp["input_ids.prompt"].tolist()
    assert tokenizer(nnterp["target"])["input_ids"] == nnterp["input_ids.target"].tolist()


def test_logit_lens(model, nnterp):
    lens, logits = logit_lens(model, nnterp["prompt"])
    compare("lens probabilities", lens, nnterp["lens"], PROBABILITY_TOLERANCE, relative=False)
    compare("logits", logits, nnterp["logits"], TOLERANCE)
    # The top tokens agree wherever nnterp's are apart by more than the tolerance.
    want = nnterp["lens"].topk(3, dim=-1)
    got = lens.topk(3, dim=-1).indices
    for layer, (ids, probs) in enumerate(zip(want.indices, want.values, strict=True)):
        for rank in range(3):
            if rank == 2 or probs[rank] - probs[rank + 1] > 2 * PROBABILITY_TOLERANCE:
                assert got[layer, rank] == ids[rank], (layer, rank)
            else:
                break


def test_head_pattern(model, nnterp):
    pattern = head_pattern(model, nnterp["prompt"], nnterp["layer"], nnterp["head"])
    assert pattern.shape == (len(nnterp["input_ids.prompt"]),) * 2
    compare("attention pattern", pattern, nnterp["pattern"], PROBABILITY_TOLERANCE, relative=False)


def test_steering(model, nnterp):
    steered = steered_logits(model, nnterp["prompt"], nnterp["layer"], nnterp["steering_vector"], nnterp["factor"])
    compare("steered logits", steered, nnterp["steered"], TOLERANCE)
    assert (steered - nnterp["logits"]).abs().max() > 0.1, "steering changed nothing: the comparison proves nothing"


def test_patching(model, nnterp):
    compare("target logits", clean_logits(model, nnterp["target"]), nnterp["target_logits"], TOLERANCE)
    patched = patched_logits(model, nnterp["prompt"], nnterp["target"], nnterp["layer"])
    compare("patched logits", patched, nnterp["patched"], TOLERANCE)
    assert (patched - nnterp["target_logits"]).abs().max() > 0.1, "patching changed nothing"
