"""Edits made on vLLM give the logits the same edits give on transformers."""

from __future__ import annotations

import pytest
import torch
from conftest import record

import vlenvoys
from vlenvoys.oracle import edited_logits

TOLERANCE = 1e-4


def logits_of(model, prompt, edit=None) -> torch.Tensor:
    with model.trace(prompt, temperature=0.0):
        if edit is not None:
            edit(model)
        logits = model.logits.save()
    return logits.reshape(-1)


def check(subject, label: str, got: torch.Tensor, want: torch.Tensor, baseline: torch.Tensor) -> None:
    difference = (got - want).abs().max().item()
    record(subject.name, f"edit: {label}", difference)
    assert difference <= TOLERANCE * max(1.0, want.abs().max().item())
    # The edit must have done something, or the comparison proves nothing.
    assert (got - baseline).abs().max() > 1e-3


def steering_vector(subject) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return 4 * torch.randn(subject.reference.config.hidden_size, generator=generator)


def test_add_to_layer_mid_in_place(subject):
    """Add a vector at one position of layer 1's mid stream, in place."""
    prompt, vector = subject.prompts[2], steering_vector(subject)
    position = len(prompt) - 2  # inside every sliding window of the last token

    def edit(model):
        model.layers[1].layer_mid[:, position] += vector

    def on_reference(output):
        output = output.clone()
        output[:, position] += vector
        return output

    # On transformers the mid stream is the block input plus the attention
    # output, so adding to the attention output adds to it.
    want = edited_logits(subject.reference, prompt, [(1, "self_attn", "output", on_reference)])
    check(subject, "layer_mid += v", logits_of(subject.model, prompt, edit), want, logits_of(subject.model, prompt))


def test_zero_mlp_output(subject):
    prompt = subject.prompts[2]

    def edit(model):
        model.layers[1].mlp.mlp_output[:] = 0

    want = edited_logits(subject.reference, prompt, [(1, "mlp", "output", torch.zeros_like)])
    check(subject, "mlp_output = 0", logits_of(subject.model, prompt, edit), want, logits_of(subject.model, prompt))


def test_assign_layer_output(subject):
    """Assign a new stream to layer 1's output: half of what it was."""
    prompt = subject.prompts[3]

    def edit(model):
        model.layers[1].layer_output = model.layers[1].layer_output * 0.5

    want = edited_logits(subject.reference, prompt, [(1, "", "output", lambda output: output * 0.5)])
    check(subject, "layer_output = x/2", logits_of(subject.model, prompt, edit), want, logits_of(subject.model, prompt))


def test_assign_token_embeddings(subject):
    prompt = subject.prompts[1]

    def edit(model):
        model.token_embeddings = model.token_embeddings.flip(1)

    want = edited_logits(subject.reference, prompt, [(0, "", "input", lambda hidden: hidden.flip(1))])
    check(subject, "token_embeddings flipped", logits_of(subject.model, prompt, edit), want, logits_of(subject.model, prompt))


def test_unedited_reads_leave_logits_bit_identical(subject):
    prompt = subject.prompts[2]
    baseline = logits_of(subject.model, prompt)

    def read_everything(model):
        for layer in model.layers:
            layer.layer_input.save()
            layer.attention_norm_output.save()
            layer.self_attn.attention_output.save()
            layer.layer_mid.save()
            layer.mlp_norm_output.save()
            layer.mlp.mlp_output.save()
            layer.layer_output.save()

    assert torch.equal(logits_of(subject.model, prompt, read_everything), baseline)


@pytest.mark.parametrize("extra", [1, -1])
def test_wrong_token_count_is_refused_and_engine_goes_on(subject, extra):
    prompt = subject.prompts[1]
    baseline = logits_of(subject.model, prompt)
    hidden = subject.reference.config.hidden_size

    def edit(model):
        model.layers[1].layer_output = torch.zeros(1, len(prompt) + extra, hidden)

    with pytest.raises(vlenvoys.InvalidWrite, match=rf"layer_output: expected shape \[1, {len(prompt)}, {hidden}\]"):
        logits_of(subject.model, prompt, edit)
    assert torch.equal(logits_of(subject.model, prompt), baseline)


def test_wrong_dtype_is_refused(subject):
    prompt = subject.prompts[1]

    def edit(model):
        model.layers[0].layer_mid = model.layers[0].layer_mid.double()

    with pytest.raises(vlenvoys.InvalidWrite, match="dtype"):
        logits_of(subject.model, prompt, edit)
