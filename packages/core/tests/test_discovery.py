"""Family discovery, the error for a model no family knows, and the CLI, with no family installed."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import vlenvoys
import vlenvoys_testing as testing
from vlenvoys.cli import app
from vlenvoys.values.family import resolve, resolve_checkpoint


def installed_names() -> set[str]:
    return {installed.name for installed in vlenvoys.families()}


@pytest.mark.parametrize(
    "architecture, package",
    [
        ("LlamaForCausalLM", "vlenvoys-llama"),
        ("GPT2LMHeadModel", "vlenvoys-gpt2"),
        ("Gemma2ForCausalLM", "vlenvoys-gemma"),
        ("Olmo2ForCausalLM", "vlenvoys-exaone"),  # declared on vLLM's transformers backend alone
    ],
)
def test_unknown_architecture_names_the_package_that_serves_it(tmp_path, architecture, package):
    """In the core session no family is installed; beside one, the model resolves to it instead."""
    path = testing.tiny_model(architecture, tmp_path / "model")
    serving = [
        i for i in vlenvoys.families() if architecture in {**i.family.architectures, **i.family.transformers_backend}
    ]
    if serving:
        installed, _, _ = resolve_checkpoint(path, {})
        assert installed.distribution == package == serving[0].distribution
        return
    with pytest.raises(vlenvoys.UnknownArchitecture, match=rf"{architecture}.*install {package}"):
        vlenvoys.load(path)


def test_an_architecture_no_package_serves_says_so():
    with pytest.raises(vlenvoys.UnknownArchitecture, match="FalconForCausalLM.*no published family serves it"):
        resolve(["FalconForCausalLM"])


def test_families_command_lists_what_is_installed():
    result = CliRunner().invoke(app, ["families"])
    assert result.exit_code == 0, result.output
    for name in installed_names():
        assert name in result.output
    for installed in vlenvoys.families():  # an architecture declared on the transformers backend alone is listed too
        for name in installed.family.transformers_backend:
            assert name in result.output


def test_help_names_the_main_job():
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "lens" in result.output


def test_support_command_needs_an_installed_family(tmp_path):
    path = testing.tiny_model("LlamaForCausalLM", tmp_path / "model")
    result = CliRunner().invoke(app, ["support", str(path)])
    if any("LlamaForCausalLM" in i.family.architectures for i in vlenvoys.families()):
        assert result.exit_code == 0 and "mlp_activation" in result.output
    else:
        assert result.exit_code == 1
        assert "error: no installed vlenvoys family declares architecture LlamaForCausalLM" in result.output
        assert "install vlenvoys-llama" in result.output


@pytest.mark.parametrize("path", ["/nonexistent/model", "./nope"])
def test_a_missing_checkpoint_is_named(path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        vlenvoys.load(path)


def test_cli_errors_are_one_line_not_a_traceback():
    result = CliRunner().invoke(app, ["support", "/nonexistent/model"])
    assert result.exit_code == 1
    assert "error: no checkpoint at /nonexistent/model" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    "engine_kwargs, message",
    [
        ({"taps": ["model.layers.*.output"]}, "does not run nnsight's taps="),
        ({"cuda_graphs": True, "enforce_eager": True}, "drop enforce_eager"),
        ({"cuda_graphs": True, "compilation_config": {"mode": 3}}, "captures the eager forward"),
        ({"cuda_graphs": True, "compilation_config": {"mode": "VLLM_COMPILE"}}, "got mode 'VLLM_COMPILE'"),
        ({"cuda_graphs": True, "compilation_config": 3}, "got mode 3"),
    ],
)
def test_engines_that_would_serve_short_values_are_refused_before_starting(tmp_path, engine_kwargs, message):
    """nnsight's taps= replays skip every untapped location; torch.compile would trace the hooks away."""
    path = testing.tiny_model("LlamaForCausalLM", tmp_path / "model")
    with pytest.raises(ValueError, match=message):
        vlenvoys.load(path, **engine_kwargs)


def test_a_family_package_that_fails_to_load_is_skipped_and_named(tmp_path, monkeypatch):
    """A broken family package (built for another core, half-installed) leaves the others served."""
    from vlenvoys.values import family

    info = tmp_path / "vlenvoys_broken-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vlenvoys-broken\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[{family.GROUP}]\nbroken = vlenvoys_no_such_module:FAMILY\n")
    before = installed_names()
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(family, "BROKEN", [])
    family._discover.cache_clear()
    try:
        with pytest.warns(UserWarning, match="failed to load and is skipped: vlenvoys-broken.*vlenvoys_no_such_module"):
            assert installed_names() == before
        with pytest.raises(vlenvoys.UnknownArchitecture, match="Failed to load \\(skipped\\): vlenvoys-broken"):
            resolve(["FalconForCausalLM"])
    finally:
        family._discover.cache_clear()
