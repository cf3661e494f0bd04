"""The package registers itself by entry point; its architectures come in their own issue."""

import pytest

import vlenvoys
import vlenvoys_gpt2
from vlenvoys import testing


def test_registered_with_its_version():
    (installed,) = [i for i in vlenvoys.families() if i.name == "gpt2"]
    assert installed.distribution == "vlenvoys-gpt2"
    assert installed.version == vlenvoys_gpt2.__version__
    assert installed.family is vlenvoys_gpt2.FAMILY


def test_undeclared_architecture_is_refused_by_name(tmp_path):
    path = testing.tiny_model("GPT2LMHeadModel", tmp_path / "model")
    with pytest.raises(vlenvoys.UnknownArchitecture, match="GPT2LMHeadModel.*install vlenvoys-gpt2"):
        vlenvoys.load(path)
