"""The "cpu" backend's driver: active, on the CPU (see the package's docstring)."""

from __future__ import annotations

import torch
from triton.backends.driver import DriverBase

__all__ = ["InterpreterDriver"]


class InterpreterDriver(DriverBase):
    """What vLLM's Triton check asks of a backend: that its driver is active."""

    @classmethod
    def is_active(cls) -> bool:
        return True

    def map_python_to_cpp_type(self, ty: str) -> str:
        return ty

    def get_current_target(self):
        return None

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_benchmarker(self):
        raise NotImplementedError("Triton's interpreter has no benchmarker")
