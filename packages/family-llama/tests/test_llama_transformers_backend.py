"""The same values on vLLM's transformers backend (model_impl="transformers"), equal to transformers'
and to vLLM's own Llama implementation of the same weights.

Run in a pytest process of their own (marker ``transformers_backend``): vLLM's backend wraps
transformers' model classes process-wide, after which neither transformers nor another
engine can be built in that process.
"""

from __future__ import annotations

import pytest
import torch

import vlenvoys
import vlenvoys_testing as testing
from vlenvoys_testing import oracle
from vlenvoys_testing.conformance import TOLERANCE, close, logits_of, read_all, record, served

NAME = "LlamaForCausalLM-on-transformers"
pytestmark = pytest.mark.transformers_backend


VECTOR = torch.linspace(-3, 3, 128)


def _add_vector(output):
    output = output.clone()
    output[:, -2] += VECTOR
    return output


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    """A tiny Llama on the transformers backend, transformers' values for the same weights, and its prompts.

    transformers' values are computed before the engine starts: vLLM's backend
    wraps transformers' own model classes in this process too.
    """
    import os

    from transformers import AutoTokenizer
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike():
        # transformers' values are computed here first, with the CPU's thread pool: an engine
        # forked after that hung at start on an H200 (no output for minutes); spawn it afresh.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    path = testing.tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("backend"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer(text)["input_ids"] for text in testing.PROMPTS]
    reference = oracle.load_reference(path)
    expected = {index: oracle.reference(reference, prompts[index]) for index in (1, 3)}
    expected["edited"] = oracle.edited_logits(reference, prompts[2], [(1, "self_attn", "output", _add_vector)])
    del reference
    with oracle.engine(str(path)) as native:  # vLLM's own Llama, before the backend wraps anything
        expected["native"] = read_all(native, [prompts[0], prompts[1]])
    with oracle.engine(str(path), model_impl="transformers") as model:
        yield model, expected, prompts


class _Named:
    name = NAME
    tolerance = TOLERANCE


def test_it_runs_on_the_backend(backend):
    model, _, _ = backend
    assert vlenvoys.on_transformers_backend(model)
    assert model.architecture.layer.BATCHED


def test_every_value_equals_transformers(backend):
    model, references, prompts = backend
    values = served(model)
    assert len(values) >= 14
    saved = read_all(model, [prompts[1], prompts[3]])
    for number, index in enumerate((1, 3)):
        expected = references[index]
        for _, name in values:
            for layer in range(model.num_layers):
                got, want = saved[number][(name, layer)], expected["values"][name][layer]
                assert got.shape == want.shape, (name, layer, got.shape, want.shape)
                if name == "attention_scores":
                    finite = ~torch.isinf(want)
                    got, want = got[finite], want[finite]
                assert close(_Named, name + " (backend)", got, want), (name, layer)
        assert close(_Named, "logits (backend)", saved[number]["logits"].reshape(-1), expected["logits"])


def test_stream_identities_and_edits_match_transformers(backend):
    model, references, prompts = backend
    prompt = prompts[2]
    with model.trace(prompt, temperature=0.0):
        parts = list().save()
        for layer in model.layers:
            parts.append((layer.layer_input, layer.self_attn.attention_output, layer.layer_mid, layer.mlp.mlp_output, layer.layer_output))
    for entering, attention, mid, mlp, leaving in parts:
        assert (entering + attention - mid).abs().max() <= 1e-5
        assert (mid + mlp - leaving).abs().max() <= 1e-5

    def edit(model):
        mid = model.layers[1].layer_mid
        mid[:, -2] += VECTOR.to(mid.device)

    got = logits_of(model, prompt, edit)
    want = references["edited"]
    difference = (got - want).abs().max().item()
    record(NAME, "edit: layer_mid += v (backend)", difference)
    assert difference <= 1e-4 * max(1.0, want.abs().max().item())
    assert not torch.equal(got, logits_of(model, prompt))


def test_unedited_reads_change_nothing_and_bad_writes_are_refused(backend):
    model, _, prompts = backend
    prompt = prompts[1]
    baseline = logits_of(model, prompt)
    values = served(model)

    def read_everything(model):
        for layer in model.layers:
            for owner, name in values:
                getattr(layer if owner == "layer" else getattr(layer, owner), name).save()

    assert torch.equal(logits_of(model, prompt, read_everything), baseline)
    with pytest.raises(vlenvoys.InvalidWrite, match=r"layer_output: expected shape \[1, "):
        logits_of(model, prompt, lambda m: setattr(m.layers[1], "layer_output", torch.zeros(1, 2, 3)))
    assert torch.equal(logits_of(model, prompt), baseline)


def test_equals_vllms_own_implementation(backend):
    model, references, prompts = backend
    on_backend = read_all(model, [prompts[0], prompts[1]])
    for ours, native in zip(on_backend, references["native"]):
        for key, value in ours.items():
            difference = (value - native[key]).abs()
            if key[0] == "attention_scores" if isinstance(key, tuple) else False:
                difference = difference[~torch.isinf(native[key])]
            record(NAME, "backend vs vLLM's own Llama", difference.max().item())
            assert difference.max() <= 1e-4 * max(1.0, native[key][~torch.isinf(native[key])].abs().max().item()), key
