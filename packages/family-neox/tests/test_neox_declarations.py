"""Where each architecture runs and which block it gets, from the checkpoint's config."""

import json

import pytest
import torch

import vlenvoys
import vlenvoys_testing as testing
from vlenvoys.values.family import resolve_checkpoint


@pytest.mark.parametrize("parallel", [True, False])
def test_neox_runs_on_the_transformers_backend_by_itself(tmp_path, parallel):
    """vLLM 0.32 has no GPT-NeoX of its own: load picks the backend, and the config picks the block."""
    path = testing.tiny_model("GPTNeoXForCausalLM", tmp_path / "neox", use_parallel_residual=parallel)
    engine_kwargs = {}
    installed, name, architecture = resolve_checkpoint(path, engine_kwargs)
    assert (installed.name, name) == ("neox", "GPTNeoXForCausalLM")
    assert engine_kwargs == {"model_impl": "transformers"}
    assert architecture.layer.BATCHED
    assert architecture.layer.PARALLEL is parallel
    support = vlenvoys.support(str(path))
    assert support["layer", "layer_mid"].available is not parallel
    if parallel:
        assert support["layer", "layer_mid"].note == vlenvoys.PARALLEL


def test_neox_without_the_setting_gets_transformers_default_the_parallel_block(tmp_path):
    path = testing.tiny_model("GPTNeoXForCausalLM", tmp_path / "neox")
    config = json.loads((path / "config.json").read_text())
    del config["use_parallel_residual"]
    (path / "config.json").write_text(json.dumps(config))
    _, _, architecture = resolve_checkpoint(path, {})
    assert architecture.layer.PARALLEL


def test_gptj_runs_on_vllms_own_model(tmp_path):
    path = testing.tiny_model("GPTJForCausalLM", tmp_path / "gptj")
    engine_kwargs = {}
    _, name, architecture = resolve_checkpoint(path, engine_kwargs)
    assert name == "GPTJForCausalLM" and engine_kwargs == {}
    assert architecture.layer.PARALLEL and not architecture.layer.BATCHED


@pytest.mark.parametrize("architecture", ["GPTNeoXForCausalLM", "GPTJForCausalLM"])
def test_the_tiny_models_rotate_part_of_each_head(tmp_path, architecture):
    """So that the oracle suite checks partial rotary: a quarter of each 32-wide head."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(testing.tiny_model(architecture, tmp_path / "model"))
    head = config.hidden_size // config.num_attention_heads
    rotated = config.rotary_dim if architecture == "GPTJForCausalLM" else head * config.rope_parameters["partial_rotary_factor"]
    assert 0 < rotated < head == 32


def test_each_subject_runs_where_it_is_declared(subject):
    assert vlenvoys.on_transformers_backend(subject.model) is subject.name.startswith("GPTNeoX")
    assert subject.parallel is (not subject.name.endswith("sequential"))


def test_cohere_runs_on_vllms_own_model_as_a_parallel_block(tmp_path):
    """vLLM 0.32 has Cohere of its own (commandr.py): no backend, GPT-J's parallel block under Llama's names."""
    path = testing.tiny_model("CohereForCausalLM", tmp_path / "cohere")
    engine_kwargs = {}
    installed, name, architecture = resolve_checkpoint(path, engine_kwargs)
    assert (installed.name, name) == ("neox", "CohereForCausalLM") and engine_kwargs == {}
    assert architecture.layer.PARALLEL and not architecture.layer.BATCHED
    assert architecture.rename["model.embed_tokens"] == ["embed_tokens", "lm_head"]  # tied: no lm_head child
    support = vlenvoys.support(str(path))
    assert support["layer", "layer_mid"].note == vlenvoys.PARALLEL
    assert support["mlp", "mlp_activation"].note == vlenvoys.GATED


def test_the_tiny_cohere_has_what_a_misplaced_piece_would_show(tmp_path):
    """q/k norms, a logit scale other than 1, tied embeddings, and norm weights that are not ones."""
    from safetensors import safe_open
    from transformers import AutoConfig

    path = testing.tiny_model("CohereForCausalLM", tmp_path / "cohere")
    config = AutoConfig.from_pretrained(path)
    assert config.use_qk_norm and config.logit_scale not in (0.0, 1.0) and config.tie_word_embeddings
    with safe_open(str(path / "model.safetensors"), "pt") as weights:
        norms = [weights.get_tensor(key) for key in weights.keys() if key.endswith("norm.weight")]
    assert len(norms) == 3 * config.num_hidden_layers + 1  # input_layernorm, q_norm, k_norm per block; model.norm
    assert all(not torch.equal(norm, torch.ones_like(norm)) for norm in norms)


def test_support_reads_neox_from_its_declarations_on_the_backend(tmp_path):
    """`vlenvoys.support` of a checkpoint declared on the transformers backend alone: its parallel block by name."""
    path = testing.tiny_model("GPTNeoXForCausalLM", tmp_path / "neox")
    support = vlenvoys.support(str(path))
    assert support["layer", "layer_mid"].code == "PARALLEL"
