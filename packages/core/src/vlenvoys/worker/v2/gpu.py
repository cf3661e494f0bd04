"""The CUDA engine's worker over vLLM's V2 model runner (``VLENVOYS_MODEL_RUNNER=v2``).

vLLM's V2 CPU runner subclasses this one and changes only its warm-up, so the
seams `vlenvoys.worker.v2` overrides, and their order, are the same here.
vLLM's own CPU worker module is not imported: it patches torch's streams and
events for the CPU when imported.
"""

from __future__ import annotations

from vllm.v1.worker.gpu.model_runner import GPUModelRunner as VLLMGPUModelRunnerV2
from vllm.v1.worker.gpu_worker import Worker as VLLMGPUWorker

from ..runner import StandardRunner, StandardWorker
from . import NNsightV2Runner, V2Steps, V2WorkerCalls

__all__ = ["GPUV2Runner", "GPUWorker"]


class GPUV2Runner(V2Steps, StandardRunner, NNsightV2Runner, VLLMGPUModelRunnerV2):
    """vLLM's V2 CUDA runner with nnsight's blocks and vlenvoys' envoys, collectors and steering."""


class GPUWorker(V2WorkerCalls, StandardWorker, VLLMGPUWorker):
    """vLLM's GPU worker over its V2 runner, with nnsight's RPCs (collect, register) and the V2 runner above."""

    vlenvoys_v2_runner = VLLMGPUModelRunnerV2
    vlenvoys_v2_instrumented = GPUV2Runner
