"""The CUDA/ROCm engine's worker: nnsight's own GPU worker, with the standard runner."""

from __future__ import annotations

from nnsight.modeling.vllm.model_runners.GPUModelRunner import NNsightGPUModelRunner
from nnsight.modeling.vllm.workers.GPUWorker import NNsightGPUWorker

from .runner import StandardRunner, StandardWorker

__all__ = ["GPURunner", "GPUWorker"]


class GPURunner(StandardRunner, NNsightGPUModelRunner):
    """nnsight's GPU runner with the family's envoys."""


class GPUWorker(StandardWorker, NNsightGPUWorker):
    """nnsight's GPU worker (which checks the runner is the one it instruments), installing the standard runner."""

    def init_device(self) -> None:
        super().init_device()
        self.model_runner.__class__ = GPURunner
