"""One vLLM engine per Gemma architecture for the session, beside transformers with the same weights."""

from vlenvoys_testing import conformance
from vlenvoys.values.family import on_transformers_backend_alone
from vlenvoys_testing.oracle import LLAMA_LAYOUT, HFLayout

#: transformers' Gemma 2 / Gemma 3 names, under one block: each sublayer's
#: contribution is its post-norm's output, and the MLP's norm is
#: pre_feedforward_layernorm, whose input is the stream after the attention add.
GEMMA2_LAYOUT = HFLayout(
    places={
        "layer_input": ("", "input"),
        "attention_norm_output": ("input_layernorm", "output"),
        "attention_output": ("post_attention_layernorm", "output"),
        "layer_mid": ("pre_feedforward_layernorm", "input"),
        "mlp_norm_output": ("pre_feedforward_layernorm", "output"),
        "mlp_output": ("post_feedforward_layernorm", "output"),
        "layer_output": ("", "output"),
        "attention_premix": ("self_attn.o_proj", "input"),
        "mlp_neurons": ("mlp.down_proj", "input"),
    }
)

#: Windows of 8 tokens (prompts reach 24) on the sliding layers 0 and 2, and a
#: query scale of 16**-0.5 where head_dim**-0.5 would be 32**-0.5. Gemma 2's soft
#: caps (attention 5, final 3) are small enough to change scores and logits
#: (test_gemma_oracle checks that they do); Gemma 3 gets a final cap too.
GEMMA2_CAPS = {
    "sliding_window": 8,
    "query_pre_attn_scalar": 16,
    "attn_logit_softcapping": 5.0,
    "final_logit_softcapping": 3.0,
}
MODELS = {
    "GemmaForCausalLM": ("GemmaForCausalLM", {}, LLAMA_LAYOUT),
    # vLLM 0.34 has no Gemma 1 of its own and runs it here; on 0.32 the backend is asked for by name.
    "GemmaForCausalLM-on-transformers": ("GemmaForCausalLM", {}, LLAMA_LAYOUT, {"model_impl": "transformers"}),
    "Gemma2ForCausalLM-window8-caps": ("Gemma2ForCausalLM", GEMMA2_CAPS, GEMMA2_LAYOUT),
    "Gemma3ForCausalLM-window8-cap": (
        "Gemma3ForCausalLM",
        {"sliding_window": 8, "query_pre_attn_scalar": 16, "final_logit_softcapping": 3.0},
        GEMMA2_LAYOUT,
    ),
    # Two ranks: the soft-capped, windowed pattern from each rank's heads; post-norms on reduced outputs.
    "Gemma2ForCausalLM-window8-caps-tp2": (
        "Gemma2ForCausalLM",
        GEMMA2_CAPS,
        GEMMA2_LAYOUT,
        {"tensor_parallel_size": 2},
    ),
}
if on_transformers_backend_alone(["GemmaForCausalLM"]):
    # vLLM 0.34 has no Gemma 1 of its own: the subject above would run on the backend too, in this process, where
    # the backend's wrapping of transformers' classes would reach the Gemma 2 and 3 references built after it.
    del MODELS["GemmaForCausalLM"]

subject = conformance.subject_fixture(MODELS)


def pytest_terminal_summary(terminalreporter):
    conformance.summary(terminalreporter)
