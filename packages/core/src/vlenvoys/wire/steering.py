"""A request's steering as it travels to the worker (under `vlenvoys.wire.requests.STEER_KEY`)."""

from __future__ import annotations

import base64
from typing import Any

import torch

__all__ = ["vector_of"]


def vector_of(encoded: Any) -> torch.Tensor:
    """A spec's vector as float32: raw bytes (`vlenvoys.Steering.encode`), their base64 text (a spec sent as JSON,
    `vlenvoys serve`), or a list of numbers (a hand-written request)."""
    if isinstance(encoded, str):
        encoded = base64.b64decode(encoded, validate=True)
    if isinstance(encoded, (bytes, bytearray, memoryview)):
        if len(encoded) % 4:
            raise ValueError(f"a vector of {len(encoded)} bytes is not float32 values")
        return torch.frombuffer(bytearray(encoded), dtype=torch.float32)
    return torch.tensor(encoded, dtype=torch.float32)
