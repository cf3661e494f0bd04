"""A stand-in for vLLM's V1 runner module where vLLM has none (0.34 and later), so nnsight's worker parts import.

nnsight 0.8.1 keeps its per-request bookkeeping (``Requests``, ``Request``) and
its runner's plain-Python methods (collect, register, finish erred requests) in
``nnsight.modeling.vllm.model_runners.GPUModelRunner``, whose runner class
subclasses vLLM's V1 ``GPUModelRunner``: the module cannot import where vLLM
removed V1. The V2 worker (`vlenvoys.worker.v2`) reuses those parts, never
nnsight's V1 runner class. So, on such a vLLM only, `install` puts a module in
V1's place whose ``GPUModelRunner`` refuses to be built; on 0.32 and 0.33 it
does nothing.
"""

from __future__ import annotations

import importlib.util
import sys
import types

__all__ = ["install"]

NAME = "vllm.v1.worker.gpu_model_runner"


class GPUModelRunner:
    """Where vLLM's V1 runner was: nnsight's V1 runner class subclasses it; nothing builds one."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(
            "this vLLM has no V1 model runner (vllm.v1.worker.gpu_model_runner): vlenvoys runs its V2 runner "
            "(vlenvoys.worker.v2); unset VLENVOYS_MODEL_RUNNER"
        )


def install() -> None:
    """Put the stand-in in V1's place, where this vLLM has no V1 runner module (idempotent)."""
    if sys.modules.get(NAME) is not None or importlib.util.find_spec(NAME) is not None:
        return
    module = types.ModuleType(NAME, __doc__)
    module.GPUModelRunner = GPUModelRunner
    # No spec origin: `vlenvoys.engine.processes.has_v1_runner` tells it from vLLM's own.
    module.__spec__ = importlib.util.spec_from_loader(NAME, loader=None)
    sys.modules[NAME] = module
