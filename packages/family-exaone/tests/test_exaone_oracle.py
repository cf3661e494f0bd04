"""The oracle suite (every value, every layer, edits) on EXAONE 4 and OLMo 2, and what their block has
of its own: the missing pre-sublayer norms, the mid-layer stream inside the block's forward, EXAONE 4's
(stream, mid) return, the logit lens, and EXAONE 4's hybrid sliding/full attention."""

import pytest
import torch

import vlenvoys
import vlenvoys_exaone
import vlenvoys_testing as testing
from vlenvoys_testing.conformance import *  # noqa: F403  (the suite's tests, collected here)
from vlenvoys_testing.conformance import check_edit, close, host, logits_of, steering_vector

#: The hybrid test model's sliding window (conftest's MODELS).
WINDOW = 8

MISSING_NORMS = {
    "attention_norm_output": (vlenvoys_exaone.NO_PRE_ATTENTION_NORM, "layer_input"),
    "mlp_norm_output": (vlenvoys_exaone.NO_PRE_MLP_NORM, "layer_mid"),
}


def architecture(subject) -> str:
    return subject.reference.config.architectures[0]


def test_registered_with_its_version():
    (installed,) = [i for i in vlenvoys.families() if i.name == "exaone"]
    assert installed.distribution == "vlenvoys-exaone"
    assert installed.version == vlenvoys_exaone.__version__
    assert installed.family is vlenvoys_exaone.FAMILY
    assert set(installed.family.architectures) == {"Exaone4ForCausalLM", "ExaoneForCausalLM"}
    assert set(installed.family.transformers_backend) == {"Olmo2ForCausalLM"}


@pytest.mark.parametrize("architecture", ["Exaone4ForCausalLM", "Olmo2ForCausalLM"])
def test_support_of_a_checkpoint_lists_the_missing_norms_with_what_to_read_instead(tmp_path, architecture):
    """From the declarations alone, no engine (OLMo 2's, on the transformers backend vLLM runs it on)."""
    path = testing.tiny_model(architecture, tmp_path / "model")
    support = vlenvoys.support(path)
    assert (support.architecture, support.family) == (architecture, "exaone")
    for name, (reason, instead) in MISSING_NORMS.items():
        row = support["layer", name]
        assert not row.available
        assert row.note == reason
        assert f"read {instead} instead" in row.note
    unavailable = {row.value for row in support if not row.available}
    routes = {"mlp_router_logits", "mlp_router_experts", "mlp_router_weights"}  # a dense MLP (NOT_ROUTED)
    assert unavailable == {"attention_norm_output", "mlp_norm_output", "mlp_activation", *routes}


@pytest.mark.parametrize("name", list(MISSING_NORMS))
def test_reading_a_missing_norm_is_refused_by_name(subject, name):
    model, prompt = subject.model, subject.prompts[0]
    baseline = logits_of(model, prompt)
    layer = type(model.layers[1]).__name__
    assert layer == {"Exaone4ForCausalLM": "Exaone4Layer", "Olmo2ForCausalLM": "Olmo2Layer"}[architecture(subject)]
    with pytest.raises(vlenvoys.Unavailable, match=f"{name} is unavailable on {layer}") as raised:
        logits_of(model, prompt, lambda model: getattr(model.layers[1], name).save())
    assert raised.value.value == name
    assert raised.value.reason == MISSING_NORMS[name][0]
    # The engine goes on serving.
    assert torch.equal(logits_of(model, prompt), baseline)


def test_layer_mid_is_the_stream_the_block_returns_beside_its_output(subject):
    """vLLM's block returns (stream, mid): the mid-layer stream read inside the forward is its second element."""
    model = subject.model
    if architecture(subject) == "Olmo2ForCausalLM":
        pytest.skip("transformers' OLMo 2 block returns the stream alone (its layer_mid is the MLP's input, below)")
    with model.trace(subject.prompts[2], temperature=0.0):
        pairs = list().save()
        for layer in model.layers:
            mid = layer.layer_mid.save()
            pairs.append((mid, layer.output[1].clone().save()))
    for mid, returned in pairs:
        assert torch.equal(mid[0], returned)


def test_layer_mid_edit_reaches_the_mlp_and_the_residual_add(subject):
    """An edit of the mid-layer stream is what the MLP reads and what its contribution is added to."""
    model, prompt, vector = subject.model, subject.prompts[2], steering_vector(subject)
    with model.trace(prompt, temperature=0.0):
        layer = model.layers[1]
        before = layer.layer_mid.clone().save()
        mid = layer.layer_mid
        mid[:, -2] += vector.to(mid.device)
        mlp_input = layer.mlp.input.clone().save()  # [tokens, hidden]; [1, tokens, hidden] on the backend
        contribution = layer.mlp.mlp_output.save()
        leaving = layer.layer_output.save()
    before, mlp_input, contribution, leaving = host((before, mlp_input, contribution, leaving))
    edited = before.clone()
    edited[:, -2] += vector
    assert torch.equal(mlp_input, edited if subject.model.architecture.mlp.BATCHED else edited[0])
    assert (leaving - contribution - edited).abs().max() <= 1e-5 * max(1.0, leaving.abs().max().item())


def test_logit_lens_of_every_layer_matches_transformers(subject):
    """project_on_vocab applies the final norm (called with the stream alone) and the unembedding."""
    model, index = subject.model, 3
    with model.trace(subject.prompts[index], temperature=0.0):
        lens = list().save()
        for layer in model.layers:
            lens.append(model.project_on_vocab(layer.layer_output))
        logits = model.logits.save()
    reference = subject.reference
    with torch.no_grad():
        for layer, got in enumerate(lens):
            stream = subject.expected(index)["values"]["layer_output"][layer]
            want = reference.lm_head(reference.model.norm(stream))
            assert got.shape == want.shape == (1, len(subject.prompts[index]), subject.reference.config.vocab_size)
            assert close(subject, "logit lens", got, want), layer
    # The last layer's lens is the model's own next-token logits.
    assert close(subject, "logit lens", lens[-1][0, -1], logits.reshape(-1))


def test_each_layer_attends_with_its_own_window(subject):
    """Sliding layers see the last `window` tokens; full-attention layers (no rotary in a hybrid) see all.

    The patterns themselves are compared with transformers by the suite; this checks that the test
    models have the layers they are meant to, and that a full layer's pattern reaches past the window.
    """
    model, prompt = subject.model, subject.prompts[-1]
    with model.trace(prompt, temperature=0.0):
        patterns = list().save()
        for layer in model.layers:
            patterns.append(layer.self_attn.attention_probabilities)
    windows = [subject.window(layer) for layer in range(len(patterns))]
    hybrid = getattr(subject.reference.config, "sliding_window", None) is not None
    assert windows == ([WINDOW, None, WINDOW] if hybrid else [None, None, None])
    tokens = len(prompt)
    assert WINDOW < tokens
    distance = torch.arange(tokens)[:, None] - torch.arange(tokens)[None, :]
    for pattern, window in zip(patterns, windows):
        beyond = pattern[..., distance >= WINDOW]
        if window:
            assert torch.all(beyond == 0)
        else:
            assert beyond.sum() > 0.1


def test_skipped_block_hands_its_input_on_as_both_returns(subject):
    """Skipping a block that returns (stream, mid) hands the stream on; the next block reads only the first."""
    model, prompt, skipped = subject.model, subject.prompts[2], 1
    with model.trace(prompt, temperature=0.0):
        model.layers[skipped].skip(model.layers[skipped].layer_input)
        logits = model.logits.save()
    block = subject.block(skipped)
    # transformers' block returns its input: the same skip.
    handle = block.register_forward_hook(lambda module, args, output: args[0])
    try:
        want = subject.edited(prompt)
    finally:
        handle.remove()
    check_edit(subject, f"block {skipped} skipped", logits.reshape(-1), want, subject.edited(prompt))
