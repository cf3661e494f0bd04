"""The oracle suite (every value, every layer, edits) on GPT-2."""

import vlenvoys
import vlenvoys_gpt2
from vlenvoys_testing.conformance import *  # noqa: F403  (the suite's tests, collected here)


def test_registered_with_its_version():
    (installed,) = [i for i in vlenvoys.families() if i.name == "gpt2"]
    assert installed.distribution == "vlenvoys-gpt2"
    assert installed.version == vlenvoys_gpt2.__version__
    assert "GPT2LMHeadModel" in installed.family.architectures
