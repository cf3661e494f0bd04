"""The client's side of a collector's take: each request's rows, handed over in shared memory, in its value's layout.

The worker's collector (`vlenvoys.worker.collector`) answers a take with where
each finished request's rows lie (`vlenvoys.engine.handover`); here they become
each request's values as a trace serves them (`split`), or rows not yet read
(`unread`) for a caller that reads them straight into its own memory.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..engine import handover
from ..values.names import Read
from ..values.reads import located

__all__ = ["new_name", "received", "split", "unread"]


def received(taken: dict[str, Any], maps: dict | None = None, joined: bool = True) -> dict[str, Any]:
    """Client side: a take's answer (`vlenvoys.worker.collector.take`) with each request's rows as tensors (``{"order", "missing", "prompts", "values":
    {key: [rows of each id in order]}}``; ``maps``, ``joined`` (False: each request's rows as a list of pieces)
    and the errors: `vlenvoys.engine.handover.received`)."""
    return {
        "order": taken["order"], "missing": taken["missing"], "prompts": taken.get("prompts", {}),
        "values": handover.received(taken, maps, joined),
    }


def split(model: Any, reads: Sequence[Read], taken: dict) -> dict[str, dict[str, torch.Tensor] | str]:
    """Client side: each request's values in their layouts (``[1, tokens, ...]``), or why it has none.

    The values are views of the engine's host blocks (`received`): rows of
    different requests never overlap, so each is that request's own.
    """

    def laid_out(envoy: Any, value: Any, rows: torch.Tensor, head_dim: int | None) -> torch.Tensor:
        if head_dim is not None:
            rows = rows.reshape(*rows.shape[:-1], -1, head_dim)
        return value._stub(envoy, rows.unsqueeze(0))

    return _per_request(model, reads, taken, taken["values"], laid_out)


def unread(model: Any, reads: Sequence[Read], taken: dict[str, Any]) -> dict[str, dict[str, handover.Rows] | str]:
    """Client side: a take's answer as each request's values not yet read (`vlenvoys.engine.handover.Rows`, one
    row per token, each row in the value's layout), or why it has none: for a caller that reads them straight
    into its own memory (`vlenvoys.collect.activations.collect_dataset`). Raises what `vlenvoys.engine.handover.rows_of` raises."""

    def laid_out(envoy: Any, value: Any, rows: handover.Rows, head_dim: int | None) -> handover.Rows:
        if head_dim is not None:
            rows = dataclasses.replace(rows, shape=(*rows.shape[:-1], rows.shape[-1] // head_dim, head_dim))
        return rows  # every value's stub returns what it is given

    return _per_request(model, reads, taken, handover.rows_of(taken), laid_out)


def _per_request(model: Any, reads: Sequence[Read], taken: dict, values: dict[str, list], laid_out: Callable) -> dict[str, Any]:
    """``{request: {key: laid_out(envoy, value, rows, head_dim)}}`` for each read's rows of each request in
    ``taken["order"]`` (``values``: key -> rows per request), and ``{request: why}`` for those missing."""
    result: dict[str, Any] = dict(taken["missing"])
    for read in reads:
        envoy, value = located(model, read)
        key, head_dim = f"{read[2]}.{read[0]}", value._head_dim(envoy)
        for caller_id, rows in zip(taken["order"], values.get(key, ()), strict=True):
            result.setdefault(caller_id, {})[key] = laid_out(envoy, value, rows, head_dim)
    return result


def new_name() -> str:
    """A name for a collector the client installs on the worker (``vlenvoys_collect_start``)."""
    return f"collect-{uuid.uuid4().hex}"
