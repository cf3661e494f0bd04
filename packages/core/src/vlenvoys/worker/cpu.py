"""The CPU engine's worker: vLLM's CPU worker with nnsight's runner, which nnsight lacks."""

from __future__ import annotations

from nnsight.modeling.vllm.model_runners.GPUModelRunner import NNsightGPUModelRunner
from nnsight.modeling.vllm.workers.GPUWorker import NNsightGPUWorker
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker as VLLMCPUWorker

from .runner import StandardRunner, StandardWorker

__all__ = ["CPURunner", "CPUWorker"]


class CPURunner(StandardRunner, NNsightGPUModelRunner, CPUModelRunner):
    """nnsight's runner over vLLM's CPU runner, which subclasses the GPU one.

    nnsight's runner methods all reach vLLM through ``super()``, so placing
    the CPU runner after it in the MRO runs nnsight's steps over the CPU
    engine's forward.
    """


class CPUWorker(StandardWorker, NNsightGPUWorker, VLLMCPUWorker):
    """vLLM's CPU worker with nnsight's RPCs (collect, register) and the standard runner."""

    def init_device(self) -> None:
        # nnsight's init_device refuses any runner but the GPU one: skip it.
        VLLMCPUWorker.init_device(self)
        runner = self.model_runner
        if type(runner) is not CPUModelRunner:
            raise NotImplementedError(
                f"vlenvoys instruments vLLM's CPUModelRunner, but this worker built "
                f"{type(runner).__module__}.{type(runner).__name__}; unset VLLM_USE_V2_MODEL_RUNNER"
            )
        runner.__class__ = CPURunner
