"""The repository keeps its promises to a new user: README's commands are what CI runs."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ["core", "family-llama", "family-gpt2", "family-gemma", "family-exaone"]


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
        if folder != "core":
            entry = project["project"]["entry-points"]["vlenvoys.families"]
            assert list(entry) == [folder.removeprefix("family-")]


def test_benchmark_prompts_are_torchs_draws_made_without_torch():
    """benchmarks/workloads.py (shared with the nnterp environment) draws as torch.Generator(seed) did."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("workloads", ROOT / "benchmarks" / "workloads.py")
    workloads = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(workloads)
    words = workloads.WORDS
    for count, low, high, seed in ((16, 8, 40, 0), (64, 16, 16, 80), (300, 1, 1000, 2**40 + 3)):
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(low, high + 1, (count,), generator=generator).tolist()
        starts = torch.randint(0, len(words), (count,), generator=generator).tolist()
        expected = [
            " ".join(words[(start + i) % len(words)] for i in range(length))
            for start, length in zip(starts, lengths, strict=True)
        ]
        assert workloads.prompts(count, low, high, seed) == expected
