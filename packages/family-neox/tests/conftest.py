"""One vLLM engine per model for the session, beside transformers with the same weights.

GPT-NeoX runs on vLLM's transformers backend, which decorates transformers' GPT-NeoX classes in
the process that starts the engine: its subjects are marked ``transformers_backend`` and run in a
pytest process of their own (``-m transformers_backend``), GPT-J's in the other (``-m "not
transformers_backend"``), as nox's family session runs them.
"""

from vlenvoys_testing import conformance
from vlenvoys_testing.oracle import HFLayout

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

#: transformers' Cohere names: Llama's, with one norm (input_layernorm) feeding both sublayers.
COHERE_LAYOUT = HFLayout(
    places={
        "layer_input": ("", "input"),
        "attention_norm_output": ("input_layernorm", "output"),
        "attention_output": ("self_attn", "output"),
        "mlp_norm_output": ("input_layernorm", "output"),
        "mlp_output": ("mlp", "output"),
        "layer_output": ("", "output"),
        "attention_premix": ("self_attn.o_proj", "input"),
        "mlp_neurons": ("mlp.down_proj", "input"),
    },
)

BACKEND = {"model_impl": "transformers"}

MODELS = {
    # Parallel block, 8 of each head's 32 dimensions rotated (interleaved, GPT-J style).
    "GPTJForCausalLM": ("GPTJForCausalLM", {}, GPTJ_LAYOUT),
    # Command-R(+): parallel block under one LayerNorm, per-head q/k norms, logits scaled by 0.5,
    # tied embeddings, norm weights drawn around 1; vLLM's own model (commandr.py).
    "CohereForCausalLM": ("CohereForCausalLM", {}, COHERE_LAYOUT),
    # Pythia: parallel block, a quarter of each head rotated (rotate-half, NeoX style).
    # On vLLM's transformers backend (vlenvoys.load chooses it for GPT-NeoX by itself, see
    # test_neox_runs_on_the_transformers_backend_by_itself; named here so that they are marked).
    "GPTNeoXForCausalLM-parallel": ("GPTNeoXForCausalLM", {}, NEOX_LAYOUT, BACKEND),
    "GPTNeoXForCausalLM-sequential": ("GPTNeoXForCausalLM", {"use_parallel_residual": False}, NEOX_LAYOUT, BACKEND),
}

subject = conformance.subject_fixture(MODELS)


def pytest_terminal_summary(terminalreporter):
    conformance.summary(terminalreporter)
