"""A read of a block value on a loaded model's tree, and whether one hook per module per step can serve it.

The batched paths (`vlenvoys.collect`'s collector, `vlenvoys.generate`'s
steerer, a served capture) read or write a value for every request of a step
at once; the client asks here before it chooses such a path, and the worker
before it installs one, on the same declarations.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .layouts import unhookable
from .names import Read, envoy_of

__all__ = ["located", "unhookable_reads", "unsteerable"]


def located(model: Any, read: Read) -> tuple[Any, Any]:
    """The envoy and the value's declaration (a `Flat`) of one read, on ``model``'s tree."""
    layer, owner, name = read
    envoy = envoy_of(model.layers[layer], owner)
    return envoy, getattr(type(envoy), name)


def unhookable_reads(model: Any, reads: Sequence[Read]) -> str | None:
    """Why ``reads`` cannot take the batched path on ``model`` (None when they can).

    The path serves values one hook per module can read (`vlenvoys.values.layouts.unhookable`). The caller
    also keeps it off tensor-parallel engines, where nnsight's workers gather a
    value from every rank's piece.
    """
    for read in reads:
        reason = unhookable(*located(model, read))
        if reason is not None:
            return f"{read[2]} {reason}"
    return None


def unsteerable(model: Any) -> str | None:
    """Why `vlenvoys.generate` cannot steer ``model`` (None when it can): its layer output must be a `Flat` at a
    block's output."""
    block = model.layers[0]
    value = type(block).layer_output
    reason = unhookable(block, value)
    return None if reason is None else f"layer_output {reason}"
