"""The oracle suite (every value, every layer, edits) on the Llama family's models."""

import vlenvoys
from vlenvoys_testing.conformance import *  # noqa: F403  (the suite's tests, collected here)


def test_families_lists_llama():
    (llama,) = [installed for installed in vlenvoys.families() if installed.name == "llama"]
    import vlenvoys_llama

    assert llama.distribution == "vlenvoys-llama"
    assert llama.version == vlenvoys_llama.__version__
    assert {
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
        "Qwen3MoeForCausalLM",
    } <= set(llama.family.architectures)
