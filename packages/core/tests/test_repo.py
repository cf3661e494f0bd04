"""The repository keeps its promises to a new user: README's commands are what CI runs."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ["core", "testing", "family-llama", "family-gpt2", "family-gemma", "family-exaone", "family-neox"]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```(?:sh|bash)\n(.*?)```", text, flags=re.S)


def test_readme_starts_with_the_main_job_and_the_tests():
    main_job, every_test = readme_commands()[:2]
    assert "nox -s lens" in main_job
    assert every_test.strip().endswith("nox")


def test_ci_runs_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert readme_commands()[1].strip().splitlines()[-1].split()[-1] == "nox"
    assert re.search(r"^\S*nox\s*$", ci, flags=re.M), "CI must run plain `nox`, README's test command"


def test_every_package_is_its_own_versioned_distribution():
    for folder in PACKAGES:
        project = tomllib.loads((ROOT / "packages" / folder / "pyproject.toml").read_text())
        assert project["build-system"]["build-backend"] == "hatchling.build"
        assert project["project"]["dynamic"] == ["version"]
        version_file = ROOT / "packages" / folder / project["tool"]["hatch"]["version"]["path"]
        assert re.search(r'__version__ = "\d+\.\d+\.\d+"', version_file.read_text())
        assert (version_file.parent / "py.typed").exists()
        if folder.startswith("family-"):
            entry = project["project"]["entry-points"]["vlenvoys.families"]
            assert list(entry) == [folder.removeprefix("family-")]
            # Their tests import the conformance suite from the test-support distribution.
            assert any(need.startswith("vlenvoys-testing") for need in project["project"]["optional-dependencies"]["test"])



def test_the_runtime_ships_no_test_support():
    """Test support (the oracle, the conformance suite, tiny models) is vlenvoys-testing's, not the runtime wheel's."""
    runtime = ROOT / "packages" / "core" / "src" / "vlenvoys"
    for path in runtime.rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"^\s*(import|from) (pytest|vlenvoys_testing)\b", text, flags=re.M), path
    for gone in ("testing.py", "oracle.py", "conformance.py"):
        assert not (runtime / gone).exists()


def test_testing_builds_a_tiny_model_as_a_lone_file(tmp_path):
    """compat/nnterp_side.py loads vlenvoys_testing's models.py as a file, in a process without vLLM or vlenvoys."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("lone_testing", ROOT / "packages/testing/src/vlenvoys_testing/models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = Path(module.tiny_model("LlamaForCausalLM", tmp_path / "llama"))
    assert json.loads((path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
