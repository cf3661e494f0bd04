"""Steered generation from the client: `Steering` and `generate` (`generation`); the worker's side is
`vlenvoys.worker.steerer`."""

from .generation import Steering, generate

__all__ = ["Steering", "generate"]
