"""The CPU engine's worker over vLLM's V2 model runner (``VLENVOYS_MODEL_RUNNER=v2``)."""

from __future__ import annotations

from vllm.v1.worker.cpu.model_runner import CPUModelRunner as VLLMCPUModelRunnerV2
from vllm.v1.worker.cpu_worker import CPUWorker as VLLMCPUWorker

from ..runner import StandardRunner, StandardWorker
from . import NNsightV2Runner, V2Steps, V2WorkerCalls

__all__ = ["CPUV2Runner", "CPUWorker"]


class CPUV2Runner(V2Steps, StandardRunner, NNsightV2Runner, VLLMCPUModelRunnerV2):
    """vLLM's V2 CPU runner with nnsight's blocks and vlenvoys' envoys, collectors and steering."""


class CPUWorker(V2WorkerCalls, StandardWorker, VLLMCPUWorker):
    """vLLM's CPU worker over its V2 runner, with nnsight's RPCs (collect, register) and the V2 runner above."""

    vlenvoys_v2_runner = VLLMCPUModelRunnerV2
    vlenvoys_v2_instrumented = CPUV2Runner
