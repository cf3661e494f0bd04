"""The oracle suite (every value, every layer, edits) on GPT-J, Cohere and GPT-NeoX, parallel and sequential."""

import vlenvoys
import vlenvoys_neox
from vlenvoys_testing.conformance import *  # noqa: F403  (the suite's tests, collected here)


def test_registered_with_its_version():
    (installed,) = [i for i in vlenvoys.families() if i.name == "neox"]
    assert installed.distribution == "vlenvoys-neox"
    assert installed.version == vlenvoys_neox.__version__
    assert {"GPTJForCausalLM", "CohereForCausalLM"} <= set(installed.family.architectures)
    assert "GPTNeoXForCausalLM" in installed.family.transformers_backend
