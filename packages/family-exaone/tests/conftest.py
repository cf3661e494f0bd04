"""One vLLM engine per EXAONE 4 / OLMo 2 model for the session, beside transformers with the same weights.

OLMo 2 runs on vLLM's transformers backend, which decorates transformers' OLMo 2 classes in the
process that starts the engine: its subject is marked ``transformers_backend`` and runs in a pytest
process of its own (``-m transformers_backend``), as nox's family session runs them.
"""

from vlenvoys_testing import conformance
from vlenvoys_testing.oracle import HFLayout

#: transformers' EXAONE 4 names for the standard values, under one block. The block
#: norms after each sublayer, so the contributions are the post norms' outputs and the
#: mid-layer stream is the MLP's input; there is no pre-sublayer norm to read.
EXAONE4_LAYOUT = HFLayout(
    places={
        "layer_input": ("", "input"),
        "attention_output": ("post_attention_layernorm", "output"),
        "layer_mid": ("mlp", "input"),
        "mlp_output": ("post_feedforward_layernorm", "output"),
        "layer_output": ("", "output"),
        "attention_premix": ("self_attn.o_proj", "input"),
        "mlp_neurons": ("mlp.down_proj", "input"),
    },
)

#: Hybrid: layers slide (8-token window, rotary), attend fully (no rotary), slide, over
#: prompts of up to 24 tokens. Full: every layer attends fully with rotary (EXAONE 4.0 1.2B's form).
MODELS = {
    "Exaone4ForCausalLM-window8": ("Exaone4ForCausalLM", {"sliding_window": 8}),
    "Exaone4ForCausalLM-full": (
        "Exaone4ForCausalLM",
        {"sliding_window": None, "layer_types": ["full_attention"] * 3, "seed": 1},
    ),
    # Two ranks: q/k norms per head on each rank's heads.
    "Exaone4ForCausalLM-window8-tp2": ("Exaone4ForCausalLM", {"sliding_window": 8}, {"tensor_parallel_size": 2}),
    # EXAONE 4's block under the same transformers names. vLLM 0.32 runs it on its transformers backend
    # (vlenvoys.load chooses it by itself; named here so that the subject is marked transformers_backend).
    "Olmo2ForCausalLM": ("Olmo2ForCausalLM", {}, {"model_impl": "transformers"}),
}

subject = conformance.subject_fixture(MODELS, EXAONE4_LAYOUT)


def pytest_terminal_summary(terminalreporter):
    conformance.summary(terminalreporter)
