"""The CUDA engine's worker over vLLM's V2 model runner (``VLENVOYS_MODEL_RUNNER=v2``).

vLLM's V2 CPU runner subclasses this one and changes only its warm-up, so the
seams `vlenvoys.worker.v2` overrides, and their order, are the same here.
vLLM's own CPU worker module is not imported: it patches torch's streams and
events for the CPU when imported.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.config import CUDAGraphMode
from vllm.v1.worker.gpu.model_runner import GPUModelRunner as VLLMGPUModelRunnerV2
from vllm.v1.worker.gpu_worker import Worker as VLLMGPUWorker

from ..runner import StandardRunner, StandardWorker
from . import NNsightV2Runner, V2Steps, V2WorkerCalls, runs_a_block

__all__ = ["EagerBlockSteps", "GPUV2Runner", "GPUWorker"]


class EagerBlockSteps:
    """A step that runs a block (a trace's, an installed edit's) replays no CUDA graph on V2 either.

    A replayed graph runs no Python, so its hooks would serve no read and no edit: the blocks' decode steps would
    never come (#48). V1 forces such a step eager through ``_determine_batch_execution_and_padding``
    (`vlenvoys.worker.runner.StandardRunner`); V2 picks a graph in its ``cudagraph_manager.dispatch``, after the
    step's new requests (and their blocks) are added and before its inputs are built. The manager's class is
    swapped for one whose dispatch answers "no graph, no padding" on such steps; steered, collected and plain
    steps keep their graphs.
    """

    def initialize_kv_cache(self, *args: Any, **kwargs: Any) -> Any:
        result = super().initialize_kv_cache(*args, **kwargs)
        manager = getattr(self, "cudagraph_manager", None)
        if manager is not None and not hasattr(manager, "vlenvoys_runner"):
            manager.__class__ = _eager_for_blocks(type(manager))
            manager.vlenvoys_runner = self
        return result

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        dummy = kwargs.get("dummy_run") or scheduler_output is None
        self.vlenvoys_scheduled = () if dummy else tuple(scheduler_output.num_scheduled_tokens)
        try:
            return super().execute_model(scheduler_output, *args, **kwargs)
        finally:
            self.vlenvoys_scheduled = ()


def _eager_for_blocks(manager_class: type) -> type:
    """A subclass of vLLM's CUDA graph manager whose dispatch runs a step eagerly where it runs a block."""

    class EagerForBlocks(manager_class):
        def dispatch(self, num_reqs: int, num_tokens: int, *args: Any, **kwargs: Any) -> Any:
            chosen = super().dispatch(num_reqs, num_tokens, *args, **kwargs)
            runner = self.vlenvoys_runner
            if chosen.cg_mode == CUDAGraphMode.NONE or not runs_a_block(
                runner.nnsight_requests, getattr(runner, "vlenvoys_scheduled", ())
            ):
                return chosen
            # As the manager's own answer where no graph fits: the step's own size, no padding. Under data parallelism
            # with microbatching, vLLM dispatches again expecting every rank's answer alike; this rank's may now
            # differ (ranks with a block run eagerly). `vlenvoys serve` refuses data parallelism; `load` does not yet.
            return dataclasses.replace(chosen, cg_mode=CUDAGraphMode.NONE, num_tokens=num_tokens, num_reqs=num_reqs,
                                       uniform_token_count=None, max_query_len=None)

    EagerForBlocks.__name__ = EagerForBlocks.__qualname__ = f"EagerForBlocks{manager_class.__name__}"
    return EagerForBlocks


class GPUV2Runner(EagerBlockSteps, V2Steps, StandardRunner, NNsightV2Runner, VLLMGPUModelRunnerV2):
    """vLLM's V2 CUDA runner with nnsight's blocks and vlenvoys' envoys, collectors and steering."""


class GPUWorker(V2WorkerCalls, StandardWorker, VLLMGPUWorker):
    """vLLM's GPU worker over its V2 runner, with nnsight's RPCs (collect, register) and the V2 runner above."""

    vlenvoys_v2_runner = VLLMGPUModelRunnerV2
    vlenvoys_v2_instrumented = GPUV2Runner
