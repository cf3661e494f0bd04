"""One vLLM engine per model for the session, beside transformers with the same weights.

GPT-NeoX runs on vLLM's transformers backend, which wraps transformers' GPT-NeoX classes in the
process that starts the engine; see `test_neox_oracle` for how its subjects are run.
"""

from vlenvoys import conformance
from vlenvoys.oracle import HFLayout

#: transformers' GPT-J names for the standard values, under one block: one norm (ln_1) feeds both sublayers.
GPTJ_LAYOUT = HFLayout(
    layers="transformer.h",
    places={
        "layer_input": ("", "input"),
        "attention_norm_output": ("ln_1", "output"),
        "attention_output": ("attn", "output"),
        "mlp_norm_output": ("ln_1", "output"),
        "mlp_output": ("mlp", "output"),
        "layer_output": ("", "output"),
        "attention_premix": ("attn.out_proj", "input"),
        "mlp_neurons": ("mlp.fc_out", "input"),
        "mlp_activation": ("mlp.fc_out", "input"),
    },
    # transformers' GPT-J computes its attention in its own `_attn`, not through the attention interface.
    attention_method="_attn",
)

#: transformers' GPT-NeoX names; layer_mid (the post-attention norm's input) only on the sequential block.
NEOX_LAYOUT = HFLayout(
    layers="gpt_neox.layers",
    places={
        "layer_input": ("", "input"),
        "attention_norm_output": ("input_layernorm", "output"),
        "attention_output": ("attention", "output"),
        "layer_mid": ("post_attention_layernorm", "input"),
        "mlp_norm_output": ("post_attention_layernorm", "output"),
        "mlp_output": ("mlp", "output"),
        "layer_output": ("", "output"),
        "attention_premix": ("attention.dense", "input"),
        "mlp_neurons": ("mlp.dense_4h_to_h", "input"),
        "mlp_activation": ("mlp.dense_4h_to_h", "input"),
    },
)

MODELS = {
    # Parallel block, 8 of each head's 32 dimensions rotated (interleaved, GPT-J style).
    "GPTJForCausalLM": ("GPTJForCausalLM", {}, GPTJ_LAYOUT),
    # Pythia: parallel block, a quarter of each head rotated (rotate-half, NeoX style).
    "GPTNeoXForCausalLM-parallel": ("GPTNeoXForCausalLM", {}, NEOX_LAYOUT),
    "GPTNeoXForCausalLM-sequential": ("GPTNeoXForCausalLM", {"use_parallel_residual": False}, NEOX_LAYOUT),
}

subject = conformance.subject_fixture(MODELS)


def pytest_terminal_summary(terminalreporter):
    conformance.summary(terminalreporter)
