"""MLP values: neurons read and edited like transformers', the gated activation refused by name."""

from __future__ import annotations

import pytest
import torch
from conftest import record

import vlenvoys
from vlenvoys.oracle import edited_logits


def logits_of(model, prompt, edit=None) -> torch.Tensor:
    with model.trace(prompt, temperature=0.0):
        if edit is not None:
            edit(model)
        logits = model.logits.save()
    return logits.reshape(-1)


def test_zero_one_neuron_at_one_position(subject):
    if subject.routed:  # nothing to zero; the refusal is tested in test_neurons_by_mlp_kind
        assert not vlenvoys.support(subject.model)["mlp", "mlp_neurons"].available
        return
    prompt = subject.prompts[2]
    layer, position = 1, len(prompt) - 2
    # The neuron with the largest activation there, so zeroing it matters.
    with subject.model.trace(prompt, temperature=0.0):
        neurons = subject.model.layers[layer].mlp.mlp_neurons.save()
    neuron = int(neurons[0, position].abs().argmax())

    def edit(model):
        model.layers[layer].mlp.mlp_neurons[:, position, neuron] = 0

    def on_reference(hidden):
        hidden = hidden.clone()
        hidden[:, position, neuron] = 0
        return hidden

    want = edited_logits(subject.reference, prompt, [(layer, "mlp.down_proj", "input", on_reference)])
    got = logits_of(subject.model, prompt, edit)
    difference = (got - want).abs().max().item()
    record(subject.name, "edit: one neuron zeroed", difference)
    assert difference <= 1e-4 * max(1.0, want.abs().max().item())
    assert not torch.equal(got, logits_of(subject.model, prompt))


def test_neurons_by_mlp_kind(subject):
    """Gated: neurons are [1, tokens, intermediate]. Routed (mixture of experts): refused by name (ROUTED)."""
    if subject.routed:
        with pytest.raises(vlenvoys.Unavailable, match="mlp_output") as raised:
            logits_of(subject.model, subject.prompts[0], lambda model: model.layers[0].mlp.mlp_neurons.save())
        assert raised.value.reason == vlenvoys.ROUTED
        return
    with subject.model.trace(subject.prompts[1], temperature=0.0):
        neurons = subject.model.layers[0].mlp.mlp_neurons.save()
    assert neurons.shape == (1, len(subject.prompts[1]), subject.reference.config.intermediate_size)


def test_gated_activation_is_unavailable_by_name(subject):
    reason = vlenvoys.ROUTED if subject.routed else vlenvoys.GATED
    with pytest.raises(vlenvoys.Unavailable, match="instead") as raised:
        logits_of(subject.model, subject.prompts[0], lambda model: model.layers[0].mlp.mlp_activation.save())
    assert raised.value.reason == reason
    assert raised.value.value == "mlp_activation"


def test_support_lists_every_value_with_its_reason(subject):
    support = vlenvoys.support(subject.model)
    assert not support["mlp", "mlp_activation"].available
    assert support["mlp", "mlp_activation"].note == (vlenvoys.ROUTED if subject.routed else vlenvoys.GATED)
    assert support["mlp", "mlp_neurons"].available is not subject.routed
    assert support["attention", "attention_probabilities"].available
    assert "prefill only" in support["attention", "attention_probabilities"].note
    assert all(row.available for row in support if row.envoy in ("layer", "model"))
    assert "mlp_neurons" in str(support)
