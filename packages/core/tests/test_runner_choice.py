"""Which vLLM model runner vlenvoys runs (#50), on a vLLM with its V1 runner (this one) and, in a process of its own,
on one without it (as 0.34 is): V2 chosen for the user, nnsight's worker parts importing over the stand-in."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from vlenvoys.engine.loading import V2_RUNNER, model_runner
from vlenvoys.engine.processes import RUNNER_CHOICE, has_v1_runner, runner_choice
from vlenvoys.errors import UnsupportedVLLM
from vlenvoys_testing import kept_runner_choice


def test_the_default_runner_and_v1_asked_for(monkeypatch):
    """Unset, V1 on the CPU engine and V2 on CUDA (vLLM's own default there); asked for, V1 wherever vLLM has it."""
    kept_runner_choice(monkeypatch)
    from vllm.platforms import current_platform
    from vlenvoys.wire.requests import SITED_GRAPHS

    monkeypatch.delenv(RUNNER_CHOICE, raising=False)
    monkeypatch.delenv(V2_RUNNER, raising=False)
    monkeypatch.delenv(SITED_GRAPHS, raising=False)
    assert has_v1_runner() and runner_choice() == ("v2" if current_platform.is_cuda() else "v1")
    monkeypatch.setenv(RUNNER_CHOICE, "v1")
    model_runner()
    assert __import__("os").environ[V2_RUNNER] == "0"
    monkeypatch.setenv(V2_RUNNER, "1")
    with pytest.raises(UnsupportedVLLM, match=f"{V2_RUNNER}=1 asks vLLM for its V2 model runner"):
        model_runner()


def test_a_v1_engine_after_a_v2_engine_in_the_same_process(monkeypatch):
    """The "1" `model_runner` set for an earlier V2 engine is not the user's: a later V1 engine (sited graphs, or
    ``VLENVOYS_MODEL_RUNNER=v1``) of the same process starts (on an H100 it was refused, in one pytest session)."""
    kept_runner_choice(monkeypatch)
    import os

    from vlenvoys.engine import loading

    monkeypatch.setenv(RUNNER_CHOICE, "v2")
    monkeypatch.delenv(V2_RUNNER, raising=False)
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:  # a CUDA engine: V2 as load chooses it
        model_runner()
    else:  # vLLM's CPU engine refuses V2 without triton-cpu: the state its V2 engine would have left
        monkeypatch.setattr(loading, "_runner_set", "1")
        monkeypatch.setenv(V2_RUNNER, "1")
    assert os.environ[V2_RUNNER] == "1"
    monkeypatch.setenv(RUNNER_CHOICE, "v1")
    model_runner()
    assert os.environ[V2_RUNNER] == "0"
    monkeypatch.setenv(V2_RUNNER, "1")  # the user's own, set after
    with pytest.raises(UnsupportedVLLM, match=f"{V2_RUNNER}=1 asks vLLM for its V2 model runner"):
        model_runner()


WITHOUT_V1 = textwrap.dedent("""
    import os, sys
    sys.modules["vllm.v1.worker.gpu_model_runner"] = None  # as on vLLM 0.34: no V1 runner module
    from vlenvoys.engine.loading import model_runner
    from vlenvoys.engine.processes import has_v1_runner, runner_choice
    from vlenvoys.errors import UnsupportedVLLM
    os.environ.pop("VLENVOYS_MODEL_RUNNER", None)
    os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    assert not has_v1_runner() and runner_choice() == "v2"
    from vllm.triton_utils import HAS_TRITON
    if HAS_TRITON:
        model_runner()
        assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    else:  # vLLM's CPU engine with PyPI's Triton: V2 refused by name, before any engine starts
        try:
            model_runner()
        except UnsupportedVLLM as error:
            assert "triton-cpu" in str(error), error
        else:
            raise AssertionError("V2 without a Triton backend was not refused")
    os.environ["VLENVOYS_MODEL_RUNNER"] = "v1"
    try:
        model_runner()
    except UnsupportedVLLM as error:
        assert "no longer has" in str(error), error
    else:
        raise AssertionError("V1 chosen on a vLLM without it was not refused")
    # The worker's side: nnsight's bookkeeping imports over the stand-in, whose runner refuses to be built.
    from vlenvoys.worker import v2
    from nnsight.modeling.vllm.model_runners.GPUModelRunner import NNsightGPUModelRunner, Requests
    assert v2.Requests is Requests
    assert not has_v1_runner()  # the stand-in is no V1 runner
    try:
        NNsightGPUModelRunner(None, None)
    except RuntimeError as error:
        assert "no V1 model runner" in str(error), error
    else:
        raise AssertionError("the stand-in built a runner")
    print("ok")
""")


def test_v2_where_vllm_has_no_v1_runner():
    ran = subprocess.run([sys.executable, "-c", WITHOUT_V1], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0 and ran.stdout.strip().endswith("ok"), ran.stdout[-3000:] + ran.stderr[-6000:]
