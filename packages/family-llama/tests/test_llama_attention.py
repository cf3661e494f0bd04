"""Attention values beyond the comparison in test_llama_values: edits, read-only patterns, decode steps, windows."""

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


def check(subject, label, got, want, baseline) -> None:
    difference = (got - want).abs().max().item()
    record(subject.name, f"edit: {label}", difference)
    assert difference <= TOLERANCE * max(1.0, want.abs().max().item())
    assert (got - baseline).abs().max() > 1e-4, "the edit changed nothing, so the comparison proves nothing"


def test_zero_one_heads_output_at_one_position(subject):
    prompt = subject.prompts[2]
    head, position, layer = 1, len(prompt) - 1, 0
    head_dim = subject.model.layers[0].self_attn.head_dim

    def edit(model):
        model.layers[layer].self_attn.attention_head_outputs[:, position, head] = 0

    def on_reference(mixed):
        mixed = mixed.clone()
        mixed[:, position, head * head_dim : (head + 1) * head_dim] = 0
        return mixed

    want = edited_logits(subject.reference, prompt, [(layer, "self_attn.o_proj", "input", on_reference)])
    check(subject, "head output zeroed", logits_of(subject.model, prompt, edit), want, logits_of(subject.model, prompt))


def test_replace_a_key_row(subject):
    """Give the second-to-last token the last token's keys (rotated, as the kernel receives them).

    A token near the end, so that it is inside every sliding window.
    """
    prompt = subject.prompts[2]
    layer, target = 0, len(prompt) - 2

    def edit(model):
        keys = model.layers[layer].self_attn.attention_keys
        keys[:, target] = keys[:, -1]

    def on_reference(keys):  # [1, kv_heads, tokens, head_dim]
        keys = keys.clone()
        keys[:, :, target] = keys[:, :, -1]
        return keys

    want = edited_logits(subject.reference, prompt, key_edits={layer: on_reference})
    check(subject, "key row replaced", logits_of(subject.model, prompt, edit), want, logits_of(subject.model, prompt))


def test_assign_queries_reaches_the_model(subject):
    prompt = subject.prompts[1]
    baseline = logits_of(subject.model, prompt)

    def edit(model):
        attention = model.layers[0].self_attn
        attention.attention_queries = torch.zeros_like(attention.attention_queries)

    assert not torch.equal(logits_of(subject.model, prompt, edit), baseline)


def test_pattern_is_read_only(subject):
    def edit(model):
        model.layers[0].self_attn.attention_probabilities = torch.zeros(1)

    with pytest.raises(vlenvoys.ReadOnly, match="edit attention_queries or attention_keys"):
        logits_of(subject.model, subject.prompts[0], edit)


def test_pattern_rows_sum_to_one_and_respect_the_causal_mask_and_window(subject):
    model = subject.model
    prompt = subject.prompts[-1]
    with model.trace(prompt, temperature=0.0):
        patterns = list().save()
        for layer in model.layers:
            patterns.append(layer.self_attn.attention_probabilities)
    config = subject.reference.config
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    tokens = len(prompt)
    distance = torch.arange(tokens)[:, None] - torch.arange(tokens)[None, :]
    outside = distance < 0
    if window:
        outside |= distance >= window
        assert window < tokens, "the window must be shorter than the prompt to be tested"
    for pattern in patterns:
        assert pattern.shape == (1, subject.reference.config.num_attention_heads, tokens, tokens)
        assert torch.allclose(pattern.sum(-1), torch.ones(()), atol=1e-5)
        assert torch.all(pattern[..., outside] == 0)


def test_scores_on_a_decode_step_are_refused_by_name(subject):
    model = subject.model
    with pytest.raises(vlenvoys.Unavailable, match="read it on the prefill") as raised:
        with model.trace(subject.prompts[0], temperature=0.0, max_tokens=2) as tracer:
            for step in tracer.iter[0:2]:
                model.layers[0].self_attn.attention_scores.save()
    assert raised.value.reason == vlenvoys.DECODE_STEP
    assert raised.value.value == "attention_scores"
    # The engine goes on serving.
    assert logits_of(model, subject.prompts[0]).shape[-1] == subject.reference.config.vocab_size


def test_decode_steps_serve_one_row_of_queries_keys_values(subject):
    model = subject.model
    prompt = subject.prompts[1]
    config = subject.reference.config
    with model.trace(prompt, temperature=0.0, max_tokens=3) as tracer:
        shapes = list().save()
        for _ in tracer.iter[0:3]:
            attention = model.layers[1].self_attn
            shapes.append(
                (
                    tuple(attention.attention_queries.shape),
                    tuple(attention.attention_keys.shape),
                    tuple(attention.attention_head_outputs.shape),
                )
            )
    head_dim = model.layers[1].self_attn.head_dim
    for step, (queries, keys, outputs) in enumerate(shapes):
        rows = len(prompt) if step == 0 else 1
        assert queries == outputs == (1, rows, config.num_attention_heads, head_dim)
        assert keys == (1, rows, config.num_key_value_heads, head_dim)
