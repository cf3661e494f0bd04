"""The package registers itself by entry point; its architectures come in their own issue."""

import pytest

import vlenvoys
import vlenvoys_exaone
from vlenvoys import testing


def test_registered_with_its_version():
    (installed,) = [i for i in vlenvoys.families() if i.name == "exaone"]
    assert installed.distribution == "vlenvoys-exaone"
    assert installed.version == vlenvoys_exaone.__version__
    assert installed.family is vlenvoys_exaone.FAMILY


def test_undeclared_architecture_is_refused_by_name(tmp_path):
    path = testing.tiny_model("Exaone4ForCausalLM", tmp_path / "model")
    with pytest.raises(vlenvoys.UnknownArchitecture, match="Exaone4ForCausalLM.*install vlenvoys-exaone"):
        vlenvoys.load(path)
