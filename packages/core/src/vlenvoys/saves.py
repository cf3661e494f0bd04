"""Containers saved above a trace's invokes and filled inside them, merged as they would be filled locally.

On vLLM every invoke is its own request, and a container bound (and saved)
above the invokes travels with each: each request fills its own copy, and the
client gets one copy per request back. nnsight merges those copies slot by
slot where they have the same length, and otherwise keeps the last; so
``rows = [list() for _ in prompts].save()`` filled with ``rows[i].append(...)``
in invoke ``i`` came back holding the last invoke's entries only, and a flat
``list().save()`` appended to in every invoke held one entry.

The client still has each container as it was when the trace was sent (the
base every request started from). With it the merge is three-way, as
sequential invokes on transformers would leave it: a list keeps its base
slots (each merged in turn) followed by every request's appended entries, in
invoke order; a dict keeps its base keys (merged, or dropped where a request
deleted one) and takes every request's new keys, a later invoke's over an
earlier's; any other value is the last value that differs from the base (an
invoke that left it alone changes nothing). Where a request shortened a list
below its base, no order of appends explains it, and the last copy is kept.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["merged"]

#: Stands for "this request's copy has no such key" in a dict's merge.
_ABSENT = object()


def merged(mediators: list, per_request_saves: list[dict]) -> dict[str, Any]:
    """Merge names saved above the invokes across the requests' copies; write them into every mediator's scope.

    The replacement for nnsight's ``merge_shared_saves`` (same arguments and
    return: the merged values by name, for names more than one request sent
    back). ``mediators`` are the client's, whose scopes hold each name's base.
    """
    presaved: set[str] = set()
    for mediator in mediators:
        presaved |= getattr(mediator, "presaved", set())
    copies: dict[str, list] = {}
    for saves in per_request_saves:
        for name, value in saves.items():
            if name in presaved:
                copies.setdefault(name, []).append(value)
    shared = {}
    for name, found in copies.items():
        if len(found) < 2:
            continue
        base = next((mediator.lcls[name] for mediator in mediators if name in mediator.lcls), _ABSENT)
        shared[name] = found[-1] if base is _ABSENT else _merge(base, found)
    for mediator in mediators:
        for name, value in shared.items():
            mediator.lcls[name] = value
    return shared


def _merge(base: Any, copies: list) -> Any:
    if isinstance(base, list) and all(isinstance(copy, list) for copy in copies):
        if any(len(copy) < len(base) for copy in copies):
            return copies[-1]
        slots = [_merge(item, [copy[index] for copy in copies]) for index, item in enumerate(base)]
        return slots + [item for copy in copies for item in copy[len(base) :]]
    if isinstance(base, dict) and all(isinstance(copy, dict) for copy in copies):
        result = {}
        for key, item in base.items():
            present = [copy[key] for copy in copies if key in copy]
            if len(present) == len(copies):
                result[key] = _merge(item, present)
            elif present and any(not _same(value, item) for value in present):
                result[key] = present[-1]  # deleted by one request, changed by another: the change stays
        for copy in copies:
            for key, item in copy.items():
                if key not in base:
                    result[key] = item
        return result
    changed = [copy for copy in copies if not _same(copy, base)]
    return changed[-1] if changed else copies[-1]


def _same(a: Any, b: Any) -> bool:
    """Whether a request's copy equals the base (copies come back as new objects, so by value)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a)
    try:
        return bool(a == b)
    except Exception:  # an object whose == is not a truth value
        return False
