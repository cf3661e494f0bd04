"""One vLLM engine per model for the session, beside the transformers model with the same weights."""

import pytest
from vlenvoys_testing import conformance
from vlenvoys_testing.oracle import GRANITE_LAYOUT

#: Tiny random models, one per declared architecture (test name: architecture,
#: config overrides), and the real SmolLM2. The windowed Mistral slides a
#: 4-token window over prompts of up to 24 tokens.
MODELS = {
    "LlamaForCausalLM": ("LlamaForCausalLM", {}),
    "MistralForCausalLM-window4": ("MistralForCausalLM", {"sliding_window": 4}),
    "Qwen2ForCausalLM": ("Qwen2ForCausalLM", {}),
    "Qwen3ForCausalLM": ("Qwen3ForCausalLM", {}),
    "Qwen2MoeForCausalLM": ("Qwen2MoeForCausalLM", {}),
    "MixtralForCausalLM": ("MixtralForCausalLM", {}),
    # transformers' fused qkv_proj/gate_up_proj need no layout of their own: the oracle reads q/k/v
    # in the attention function and the neurons at down_proj's input, as for Llama.
    "Phi3ForCausalLM": ("Phi3ForCausalLM", {}),
    "Qwen3MoeForCausalLM": ("Qwen3MoeForCausalLM", {}),
    # Multipliers far from 1: embedding 8, residual 0.5, attention 0.25, logits scaling 0.5.
    "GraniteForCausalLM": ("GraniteForCausalLM", {}, GRANITE_LAYOUT),
    "SmolLM2": (None, {}),
    # Both engines in bfloat16 (the checkpoint's float32 weights rounded alike), against BF16_TOLERANCE.
    "LlamaForCausalLM-bf16": ("LlamaForCausalLM", {}, {"dtype": "bfloat16"}),
    # Tensor parallelism, two ranks of one core each: heads and neurons split across ranks
    # (the MoE's two key/value heads one per rank; Qwen2's one key/value head copied on both).
    "Qwen2ForCausalLM-kv1-tp2": ("Qwen2ForCausalLM", {"num_key_value_heads": 1}, {"tensor_parallel_size": 2}),
    "Qwen2MoeForCausalLM-tp2": ("Qwen2MoeForCausalLM", {}, {"tensor_parallel_size": 2}),
}

subject = conformance.subject_fixture(MODELS)


def pytest_terminal_summary(terminalreporter):
    conformance.summary(terminalreporter)


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One ``vlenvoys serve`` of the tiny Llama for the session (test_llama_serve.py, test_llama_fuzz.py)."""
    from test_llama_serve import started_server

    with started_server(tmp_path_factory) as started:
        yield started
