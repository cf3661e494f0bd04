"""The oracle suite (every value, every layer, edits) on EXAONE 4, and what is EXAONE 4's own:
the missing pre-sublayer norms, the mid-layer stream inside the block's forward, the block's
(stream, mid) return, the logit lens, and hybrid sliding/full attention."""

import pytest
import torch

import vlenvoys
import vlenvoys_exaone
from vlenvoys import testing
from vlenvoys.conformance import *  # noqa: F403  (the suite's tests, collected here)
from vlenvoys.conformance import check_edit, close, host, logits_of, steering_vector

#: The hybrid test model's sliding window (conftest's MODELS).
WINDOW = 8

MISSING_NORMS = {
    "attention_norm_output": (vlenvoys_exaone.NO_PRE_ATTENTION_NORM, "layer_input"),
    "mlp_norm_output": (vlenvoys_exaone.NO_PRE_MLP_NORM, "layer_mid"),
}


def test_registered_with_its_version():
    (installed,) = [i for i in vlenvoys.families() if i.name == "exaone"]
    assert installed.distribution == "vlenvoys-exaone"
    assert installed.version == vlenvoys_exaone.__version__
    assert installed.family is vlenvoys_exaone.FAMILY
    assert set(installed.family.architectures) == {"Exaone4ForCausalLM", "ExaoneForCausalLM"}


def test_support_of_a_checkpoint_lists_the_missing_norms_with_what_to_read_instead(tmp_path):
    """From the declarations alone, no engine."""
    path = testing.tiny_model("Exaone4ForCausalLM", tmp_path / "model", sliding_window=WINDOW)
    support = vlenvoys.support(path)
    assert (support.architecture, support.family) == ("Exaone4ForCausalLM", "exaone")
    for name, (reason, instead) in MISSING_NORMS.items():
        row = support["layer", name]
        assert not row.available
        assert row.note == reason
        assert f"read {instead} instead" in row.note
    unavailable = {row.value for row in support if not row.available}
    assert unavailable == {"attention_norm_output", "mlp_norm_output", "mlp_activation"}


@pytest.mark.parametrize("name", list(MISSING_NORMS))
def test_reading_a_missing_norm_is_refused_by_name(subject, name):
    model, prompt = subject.model, subject.prompts[0]
    baseline = logits_of(model, prompt)
    with pytest.raises(vlenvoys.Unavailable, match=f"{name} is unavailable on Exaone4Layer") as raised:
        logits_of(model, prompt, lambda model: getattr(model.layers[1], name).save())
    assert raised.value.value == name
    assert raised.value.reason == MISSING_NORMS[name][0]
    # The engine goes on serving.
    assert torch.equal(logits_of(model, prompt), baseline)


def test_layer_mid_is_the_stream_the_block_returns_beside_its_output(subject):
    """vLLM's block returns (stream, mid): the mid-layer stream read inside the forward is its second element."""
    model = subject.model
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
        mlp_input = layer.mlp.input.clone().save()
        contribution = layer.mlp.mlp_output.save()
        leaving = layer.layer_output.save()
    before, mlp_input, contribution, leaving = host((before, mlp_input, contribution, leaving))
    edited = before.clone()
    edited[:, -2] += vector
    assert torch.equal(mlp_input, edited[0])
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
    hybrid = subject.reference.config.sliding_window is not None
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
