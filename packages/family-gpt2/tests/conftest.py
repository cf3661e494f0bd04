"""One vLLM engine per GPT-2 model for the session, beside transformers with the same weights."""

from vlenvoys_testing import conformance
from vlenvoys_testing.oracle import HFLayout

#: transformers' GPT-2 names for the standard values, under one block.
GPT2_LAYOUT = HFLayout(
    layers="transformer.h",
    places={
        "layer_input": ("", "input"),
        "attention_norm_output": ("ln_1", "output"),
        "attention_output": ("attn", "output"),
        "layer_mid": ("ln_2", "input"),
        "mlp_norm_output": ("ln_2", "output"),
        "mlp_output": ("mlp", "output"),
        "layer_output": ("", "output"),
        "attention_premix": ("attn.c_proj", "input"),
        "mlp_neurons": ("mlp.c_proj", "input"),
        "mlp_activation": ("mlp.c_proj", "input"),
    },
)

MODELS = {
    "GPT2LMHeadModel": ("GPT2LMHeadModel", {}),
    "GPT2LMHeadModel-4layers": ("GPT2LMHeadModel", {"num_hidden_layers": 4, "seed": 1}),
    # Two ranks: c_attn's heads and c_fc's neurons split, the shared GELU between them.
    "GPT2LMHeadModel-tp2": ("GPT2LMHeadModel", {}, {"tensor_parallel_size": 2}),
}

subject = conformance.subject_fixture(MODELS, GPT2_LAYOUT)


def pytest_terminal_summary(terminalreporter):
    conformance.summary(terminalreporter)
