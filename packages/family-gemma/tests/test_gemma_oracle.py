"""The oracle suite (every value, every layer, edits) on Gemma, Gemma 2 and Gemma 3, and what is Gemma's own:
the embedding scale, the query scale and soft caps, the unembedding through ``embed_tokens``, the logit lens."""

import math

import torch

import vlenvoys
import vlenvoys_gemma
import vlenvoys_testing as testing
from vlenvoys_testing.conformance import *  # noqa: F403  (the suite's tests, collected here)
from vlenvoys_testing.conformance import close
from vlenvoys.cli.lens import logit_lens


def architecture(subject) -> str:
    return subject.reference.config.architectures[0]


def test_registered_with_its_version():
    (installed,) = [i for i in vlenvoys.families() if i.name == "gemma"]
    assert installed.distribution == "vlenvoys-gemma"
    assert installed.version == vlenvoys_gemma.__version__
    assert installed.family is vlenvoys_gemma.FAMILY
    assert set(installed.family.architectures) == {"GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"}
    assert set(installed.family.transformers_backend) == {"GemmaForCausalLM"}


def test_token_embeddings_are_the_embeddings_times_sqrt_hidden(subject):
    """vLLM's own Gemma scales the embeddings outside embed_tokens, transformers' embedding module (on vLLM's
    transformers backend) inside it; token_embeddings is the scaled stream block 0 receives either way."""
    model, prompt = subject.model, subject.prompts[1]
    with model.trace(prompt, temperature=0.0):
        raw = model.embed_tokens.output.save()
        embeddings = model.token_embeddings.save()
    weight = subject.reference.get_input_embeddings().weight.detach()
    if vlenvoys.on_transformers_backend(model):
        assert close(subject, "embed_tokens (scaled inside, backend)", raw[0], weight[prompt] * math.sqrt(subject.hidden_size))
    else:
        assert close(subject, "embed_tokens (unscaled)", raw, weight[prompt])
    assert close(subject, "token_embeddings", embeddings[0], weight[prompt] * math.sqrt(subject.hidden_size))


def test_scores_use_the_query_scale_and_the_attention_soft_cap(subject):
    """The served scores are cap * tanh(q.k * scale / cap) of the served queries and keys, scale
    query_pre_attn_scalar**-0.5 (Gemma 2/3), and where there is a cap it changes scores and pattern."""
    config = subject.reference.config
    scale = (getattr(config, "query_pre_attn_scalar", None) or config.head_dim) ** -0.5
    cap = getattr(config, "attn_logit_softcapping", None)
    model, prompt = subject.model, subject.prompts[-1]
    with model.trace(prompt, temperature=0.0):
        read = list().save()
        for layer in model.layers:
            attention = layer.self_attn
            read.append(
                (
                    attention.attention_queries.save(),
                    attention.attention_keys.save(),
                    attention.attention_scores.save(),
                    attention.attention_probabilities.save(),
                )
            )
    heads, kv_heads = subject.heads
    for layer, (queries, keys, scores, pattern) in enumerate(read):
        keys = keys.repeat_interleave(heads // kv_heads, dim=2)
        raw = torch.einsum("bqhd,bkhd->bhqk", queries, keys) * scale
        allowed = ~torch.isinf(scores)
        expected = cap * torch.tanh(raw / cap) if cap else raw
        assert close(subject, "attention_scores (recomputed)", scores[allowed], expected[allowed]), layer
        if cap:
            assert scores[allowed].abs().max() < cap
            # The cap must bite, or the comparisons above and against transformers prove nothing about it.
            assert (raw - scores)[allowed].abs().max() > 0.5, layer
            uncapped = raw.masked_fill(~allowed, float("-inf")).softmax(-1)
            assert (uncapped - pattern).abs().max() > 1e-2, layer


def test_last_stream_projected_on_the_vocabulary_is_the_logits(subject):
    """project_on_vocab applies the final norm, the tied unembedding and the logits processor's soft cap."""
    model, index = subject.model, 2
    with model.trace(subject.prompts[index], temperature=0.0):
        stream = model.layers[-1].layer_output[:, -1].save()
        projected = model.project_on_vocab(stream).save()
        logits = model.logits.save()
    assert close(subject, "project_on_vocab(last stream) vs vLLM logits", projected, logits.reshape(projected.shape))
    assert close(subject, "project_on_vocab(last stream)", projected[0], subject.expected(index)["logits"])
    projected = projected.cpu()
    reference = subject.reference
    with torch.no_grad():
        uncapped = reference.lm_head(reference.model.norm(stream.cpu()))
    cap = getattr(reference.config, "final_logit_softcapping", None)
    if cap:
        assert close(subject, "final soft cap", projected, cap * torch.tanh(uncapped / cap))
        assert projected.abs().max() < cap
        assert (uncapped - projected).abs().max() > 0.5, "the final soft cap must change the logits"
    else:
        assert close(subject, "final logits (no cap)", projected, uncapped)


def test_lm_head_is_a_standard_name(subject):
    """Gemma 2 unembeds with embed_tokens itself, which is also lm_head; Gemma and Gemma 3 tie lm_head's weight."""
    model = subject.model
    if architecture(subject) == "Gemma2ForCausalLM":
        assert model.lm_head is model.embed_tokens
    else:
        assert model.lm_head is not model.embed_tokens
    with model.trace(subject.prompts[0], temperature=0.0):
        unembedding = model.lm_head.weight.clone().save()
    weight = subject.reference.lm_head.weight.detach()
    # vLLM pads the vocabulary's rows; under tensor parallelism a rank holds the first slice.
    rows = min(len(unembedding), len(weight))
    assert rows >= len(weight) // 2
    assert torch.equal(unembedding[:rows].cpu(), weight[:rows])


def test_logit_lens(subject, tmp_path):
    """What `vlenvoys lens` runs once its engine is up: the last layer's last position is the model's prediction."""
    model, index = subject.model, 3
    text = testing.PROMPTS[index]
    assert model.tokenizer(text)["input_ids"] == subject.prompts[index]
    lens = logit_lens(model, text, k=3)
    tokens, layers = len(subject.prompts[index]), len(subject.layout.blocks(subject.reference))
    assert lens.probabilities.shape == (layers, tokens, subject.reference.config.vocab_size)
    want = subject.expected(index)["logits"].softmax(-1)
    assert (lens.probabilities[-1, -1] - want).abs().max() <= 1e-5
    assert lens.top_ids.shape == (layers, 3)
    lens.heatmap(tmp_path / "lens.png", title=text)
    assert (tmp_path / "lens.png").is_file()
