"""The package registers itself by entry point; its architectures come in their own issue."""

import pytest

import vlenvoys
import vlenvoys_gemma
from vlenvoys import testing


def test_registered_with_its_version():
    (installed,) = [i for i in vlenvoys.families() if i.name == "gemma"]
    assert installed.distribution == "vlenvoys-gemma"
    assert installed.version == vlenvoys_gemma.__version__
    assert installed.family is vlenvoys_gemma.FAMILY


def test_undeclared_architecture_is_refused_by_name(tmp_path):
    path = testing.tiny_model("Gemma2ForCausalLM", tmp_path / "model")
    with pytest.raises(vlenvoys.UnknownArchitecture, match="Gemma2ForCausalLM.*install vlenvoys-gemma"):
        vlenvoys.load(path)
