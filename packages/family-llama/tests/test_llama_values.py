"""Every residual-stream value, every layer, several prompts: equal to transformers' (float32)."""

from __future__ import annotations

import pytest
import torch
from conftest import record

import vlenvoys
from vlenvoys.oracle import VALUES

#: The oracle's bound: |vLLM - transformers| <= 1e-4, relative to each token's own
#: stream magnitude where that exceeds 1. On the tiny models (magnitudes of a few
#: units) that is 1e-4 absolute. SmolLM2's first-token stream reaches ~22,500
#: (float32's spacing there is 0.002) and rounding grows through 30 layers to
#: ~1.6e-5 of a token's magnitude; an absolute 1e-4 is below float32 there.
TOLERANCE = 1e-4


def close(subject, label: str, got: torch.Tensor, want: torch.Tensor) -> bool:
    """Record the largest difference and say whether it is within the oracle's tolerance."""
    difference = (got - want).abs()
    scale = want.abs().amax(-1, keepdim=True).clamp(min=1.0)
    record(subject.name, label, difference.max().item())
    return bool((difference / scale).max() <= TOLERANCE)


PATTERN_TOLERANCE = 1e-5


def served(model) -> list[tuple[str, str]]:
    """The (owner, value) pairs this model serves, in forward order."""
    support = vlenvoys.support(model)
    kinds = {"layer": "layer", "self_attn": "attention", "mlp": "mlp"}
    return [(owner, name) for owner, name in VALUES if support[kinds[owner], name].available]


def read_all(model, prompts: list[list[int]]) -> list[dict]:
    """Every value of every block for each prompt, one invoke per prompt, in one trace."""
    values = served(model)
    with model.trace(temperature=0.0, max_tokens=1) as tracer:
        results = dict().save()
        for number, prompt in enumerate(prompts):
            with tracer.invoke(prompt):
                saved = {"token_embeddings": model.token_embeddings.save()}
                for index, layer in enumerate(model.layers):
                    for owner, name in values:
                        envoy = layer if owner == "layer" else getattr(layer, owner)
                        saved[(name, index)] = getattr(envoy, name).save()
                saved["logits"] = model.logits.save()
                results[number] = saved
    return [results[number] for number in range(len(prompts))]


def compare(subject, saved: dict, index: int) -> None:
    expected = subject.expected(index)
    layers = len(expected["values"]["layer_input"])
    tokens = len(subject.prompts[index])
    embeddings = saved["token_embeddings"]
    assert embeddings.shape == (1, tokens, expected["values"]["layer_input"][0].shape[-1])
    assert close(subject, "token_embeddings", embeddings, expected["values"]["layer_input"][0])
    for _, name in served(subject.model):
        for layer in range(layers):
            got, want = saved[(name, layer)], expected["values"][name][layer]
            assert got.shape == want.shape, (name, layer, got.shape, want.shape)
            if name == "attention_probabilities":
                difference = (got - want).abs().max().item()
                record(subject.name, name, difference)
                assert difference <= PATTERN_TOLERANCE, (name, layer)
            elif name == "attention_scores":
                masked = torch.isinf(want)
                assert torch.equal(torch.isinf(got), masked), (name, layer)
                assert close(subject, name, got[~masked], want[~masked]), (name, layer)
            else:
                assert close(subject, name, got, want), (name, layer)
    assert close(subject, "logits", saved["logits"].reshape(-1), expected["logits"])


def test_each_prompt_alone(subject):
    for index, prompt in enumerate(subject.prompts):
        (saved,) = read_all(subject.model, [prompt])
        compare(subject, saved, index)


def test_two_prompts_in_one_trace(subject):
    """Two requests of different lengths in one step: each reads only its own rows."""
    first, second = 0, len(subject.prompts) - 1
    saved = read_all(subject.model, [subject.prompts[first], subject.prompts[second]])
    compare(subject, saved[0], first)
    compare(subject, saved[1], second)


def test_stream_identities(subject):
    """layer_input + attention_output == layer_mid and layer_mid + mlp_output == layer_output."""
    model = subject.model
    with model.trace(subject.prompts[-1], temperature=0.0):
        parts = list().save()
        for layer in model.layers:
            parts.append(
                (
                    layer.layer_input.save(),
                    layer.self_attn.attention_output.save(),
                    layer.layer_mid.save(),
                    layer.mlp.mlp_output.save(),
                    layer.layer_output.save(),
                )
            )
    for entering, attention, mid, mlp, leaving in parts:
        assert (entering + attention - mid).abs().max() <= 1e-5 * max(1.0, mid.abs().max().item())
        assert (mid + mlp - leaving).abs().max() <= 1e-5 * max(1.0, leaving.abs().max().item())


def test_saved_values_are_private_copies(subject):
    """A saved block-0 stream is not overwritten by later kernels (vLLM reuses its buffers)."""
    model = subject.model
    with model.trace(subject.prompts[1], temperature=0.0):
        early = model.layers[0].layer_output.save()
        again = model.layers[0].layer_output.clone().save()
    expected = subject.expected(1)["values"]["layer_output"][0]
    assert torch.equal(early, again)
    assert close(subject, "layer_output", early, expected)


def test_decode_steps_have_one_row(subject):
    """Generating three tokens: the prefill serves every prompt token, each decode step one row."""
    model = subject.model
    prompt = subject.prompts[1]
    with model.trace(prompt, temperature=0.0, max_tokens=3) as tracer:
        shapes = list().save()
        for _ in tracer.iter[0:3]:
            shapes.append(tuple(model.layers[1].mlp.mlp_output.shape))
            shapes.append(tuple(model.layers[1].layer_output.shape))
    hidden = subject.reference.config.hidden_size
    assert shapes == [(1, len(prompt), hidden)] * 2 + [(1, 1, hidden)] * 4


def test_unknown_value_name_is_an_attribute_error(subject):
    with pytest.raises(RuntimeError, match="AttributeError.*no_such_value"):
        with subject.model.trace(subject.prompts[0], temperature=0.0):
            subject.model.layers[0].no_such_value.save()


def test_families_lists_llama():
    (llama,) = [installed for installed in vlenvoys.families() if installed.name == "llama"]
    import vlenvoys_llama

    assert llama.distribution == "vlenvoys-llama"
    assert llama.version == vlenvoys_llama.__version__
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"} <= set(
        llama.family.architectures
    )
