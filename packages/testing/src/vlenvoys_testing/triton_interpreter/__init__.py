"""Triton's interpreter as the "cpu" Triton backend vLLM's CPU engine looks for, so its V2 model runner runs here.

vLLM's V2 model runner prepares every step with Triton kernels (its input
batch, block tables, staged writes, sampler), and on the CPU engine it runs
them through triton-cpu, a Triton build with a "cpu" backend: without one,
vLLM refuses the V2 runner ("Model Runner V2 requires Triton",
``vllm/config/vllm.py``) and its kernels could not launch anyway. PyPI's
Triton has no CPU backend, but it has an interpreter that runs any
``@triton.jit`` kernel on CPU tensors (``TRITON_INTERPRET=1``).

`environment` writes a distribution's metadata declaring this package as
Triton's "cpu" backend (Triton finds backends by the entry point group
``triton.backends``) and returns the environment that puts it on the path
with the interpreter on: every process started with it (the engine's
client, core and workers) sees a CPU backend, and every kernel runs
interpreted. The backend itself compiles nothing (the interpreter never
asks it to). For tests only: nothing of vlenvoys imports it.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["environment"]

_DISTRIBUTION = "vlenvoys_triton_interpreter-0.dist-info"


def environment(directory: str | os.PathLike, base: dict | None = None) -> dict:
    """``base`` (default: this process's environment) with Triton's interpreter as its "cpu" backend, declared
    in ``directory`` (created; put first on ``PYTHONPATH``)."""
    root = Path(directory)
    info = root / _DISTRIBUTION
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vlenvoys-triton-interpreter\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[triton.backends]\ncpu = {__name__}\n")
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(part for part in (str(root), env.get("PYTHONPATH", "")) if part)
    env["TRITON_INTERPRET"] = "1"
    return env
