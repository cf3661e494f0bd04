"""Family discovery, the error for a model no family knows, and the CLI, with no family installed."""

from __future__ import annotations

import sys

import pytest
from typer.testing import CliRunner

import vlenvoys
import vlenvoys_testing as testing
from vlenvoys.cli import app
from vlenvoys.values.family import resolve, resolve_checkpoint
from vlenvoys_testing import kept_runner_choice


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
        ({"pipeline_parallel_size": 2}, "pipeline parallelism \\(pipeline_parallel_size > 1\\) is not served"),
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


@pytest.fixture
def future_family(tmp_path, monkeypatch):
    """A family package installed by entry point, as pip would, that declares itself verified on a later vLLM only."""
    from vlenvoys.values import family

    (tmp_path / "vlenvoys_future.py").write_text(
        "from vlenvoys import Architecture, Family, Layer\n"
        "FAMILY = Family(name='future', architectures={'FutureForCausalLM': Architecture(Layer)}, vllm='>=99')\n"
    )
    info = tmp_path / "vlenvoys_future-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vlenvoys-future\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[{family.GROUP}]\nfuture = vlenvoys_future:FAMILY\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(family.ALLOW_UNVERIFIED, raising=False)
    family._discover.cache_clear()
    try:
        yield
    finally:
        family._discover.cache_clear()


def test_a_vllm_outside_the_family_range_is_refused_naming_the_range(future_family, monkeypatch):
    """#50: the installed vLLM (0.32 here) against a family verified on >=99 only: an error before any engine starts."""
    import vllm

    from vlenvoys.values import family

    with pytest.raises(vlenvoys.UnsupportedVLLM) as refused:
        resolve(["FutureForCausalLM"])
    said = str(refused.value)
    assert "vlenvoys-future 0.1.0 is verified against vLLM >=99" in said
    assert f"vLLM {vllm.__version__} is installed" in said and "pip install 'vllm>=99'" in said
    assert family.ALLOW_UNVERIFIED in said
    # Asked to go on: a warning naming the range, and the family's declarations.
    monkeypatch.setenv(family.ALLOW_UNVERIFIED, "1")
    with pytest.warns(UserWarning, match="verified against vLLM >=99.*not been checked against transformers"):
        installed, name, _ = resolve(["FutureForCausalLM"])
    assert (installed.name, name) == ("future", "FutureForCausalLM")


def test_load_chooses_the_model_runner_vlenvoys_instruments(monkeypatch):
    """#50: `load` and `serve` set VLLM_USE_V2_MODEL_RUNNER to the runner vlenvoys runs where it is unset (V2 on CUDA,
    V1 on the CPU engine), and refuse by name the other runner asked for by hand (before any engine starts), saying
    how to choose."""
    kept_runner_choice(monkeypatch)
    import os

    from vlenvoys.engine.loading import V2_RUNNER, model_runner
    from vlenvoys.engine.processes import RUNNER_CHOICE, runner_choice

    monkeypatch.delenv(RUNNER_CHOICE, raising=False)
    monkeypatch.delenv(V2_RUNNER, raising=False)
    ours, other = ("1", ["0"]) if runner_choice() == "v2" else ("0", ["1", "true"])
    model_runner()
    assert os.environ[V2_RUNNER] == ours
    model_runner()  # the user's value, the same as ours, stands
    monkeypatch.setenv(V2_RUNNER, "")  # vLLM's int("") would stop the engine
    model_runner()
    assert os.environ[V2_RUNNER] == ours
    for asked in other:
        monkeypatch.setenv(V2_RUNNER, asked)
        with pytest.raises(vlenvoys.UnsupportedVLLM, match=f"{V2_RUNNER}={asked} asks vLLM for its V[12] model runner.*{RUNNER_CHOICE}=v"):
            model_runner()


def test_cli_names_an_unverified_vllm_in_one_line(future_family, tmp_path):
    """The CLI says the range in one line (exit 1), as it does an unknown architecture."""
    import json

    checkpoint = tmp_path / "future"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"architectures": ["FutureForCausalLM"]}))
    result = CliRunner().invoke(app, ["lens", str(checkpoint)])
    assert result.exit_code == 1, result.output
    assert "verified against vLLM >=99" in result.output and "Traceback" not in result.output


def test_vllms_registry_tells_the_architectures_it_runs_on_its_transformers_backend_alone():
    """#50: vLLM 0.32 runs OLMo 2 and GPT-NeoX there alone and Llama in a module of its own, Gemma 1 too until 0.34
    dropped it; as vLLM does, the first registered of a config's architectures decides; an architecture vLLM does
    not know is not said to be on the backend."""
    import vllm
    from packaging.version import Version

    from vlenvoys.values.family import on_transformers_backend_alone

    assert on_transformers_backend_alone(["Olmo2ForCausalLM"]) and on_transformers_backend_alone(["GPTNeoXForCausalLM"])
    assert not on_transformers_backend_alone(["LlamaForCausalLM"])
    assert on_transformers_backend_alone(["GemmaForCausalLM"]) is (Version(vllm.__version__) >= Version("0.34"))
    assert on_transformers_backend_alone(["NoSuchForCausalLM", "Olmo2ForCausalLM", "LlamaForCausalLM"])
    assert not on_transformers_backend_alone(["LlamaForCausalLM", "Olmo2ForCausalLM"])
    assert not on_transformers_backend_alone(["NoSuchForCausalLM"]) and not on_transformers_backend_alone([])


@pytest.fixture
def olmo2_family(tmp_path, monkeypatch):
    """Install, by entry point, a family that declares OLMo 2 (run by vLLM 0.32 on its transformers backend alone)
    for vLLM's own module, and on the backend where asked, as vlenvoys-gemma's Gemma 1 stands on vLLM 0.34; the only
    family asked (another installed one, vlenvoys-exaone, declares OLMo 2 on the backend itself)."""
    from vlenvoys.values import family

    discover = family._discover

    def install(on_backend: bool) -> None:
        backend = "{'Olmo2ForCausalLM': Architecture(TransformersLayer)}" if on_backend else "{}"
        (tmp_path / "vlenvoys_olmo.py").write_text(
            "from vlenvoys import Architecture, Family, FusedLayer, TransformersLayer\n"
            "FAMILY = Family(name='olmo', architectures={'Olmo2ForCausalLM': Architecture(FusedLayer)}, "
            f"transformers_backend={backend})\n"
        )
        info = tmp_path / "vlenvoys_olmo-0.1.0.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vlenvoys-olmo\nVersion: 0.1.0\n")
        (info / "entry_points.txt").write_text(f"[{family.GROUP}]\nolmo = vlenvoys_olmo:FAMILY\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.delitem(sys.modules, "vlenvoys_olmo", raising=False)  # another case's declarations
        discover.cache_clear()
        only = tuple(installed for installed in discover() if installed.name == "olmo")
        assert len(only) == 1
        monkeypatch.setattr(family, "_discover", lambda: only)

    try:
        yield install
    finally:
        discover.cache_clear()


@pytest.mark.parametrize("on_backend", [True, False])
@pytest.mark.parametrize("model_impl", [None, "auto", "vllm"])
def test_an_architecture_vllm_runs_on_its_backend_alone_gets_the_backend_declarations(olmo2_family, tmp_path, on_backend,
                                                                                      model_impl):
    """#50: the declarations for vLLM's own module would fit no module of the engine: the backend's are chosen (and
    asked of vLLM where the user named no implementation), or, where the family has none, the load is refused by
    name before any engine starts."""
    olmo2_family(on_backend)
    path = testing.tiny_model("Olmo2ForCausalLM", tmp_path / "olmo2")
    engine_kwargs = {} if model_impl is None else {"model_impl": model_impl}
    if on_backend:
        installed, name, architecture = resolve_checkpoint(path, engine_kwargs)
        assert (installed.name, name) == ("olmo", "Olmo2ForCausalLM")
        assert architecture.layer is vlenvoys.TransformersLayer
        assert engine_kwargs == {"model_impl": "vllm" if model_impl == "vllm" else "transformers"}
    else:
        with pytest.raises(vlenvoys.UnknownArchitecture, match="on its transformers backend alone.*vlenvoys-olmo 0.1.0 "
                           "declares Olmo2ForCausalLM for vLLM's own module only"):
            resolve_checkpoint(path, engine_kwargs)
