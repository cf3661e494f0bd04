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

`unpacked` loads what a worker sends back of a trace's saves
(`vlenvoys.worker.saves.dumps_saves`): the pickled values, each tensor's data
copied out of one block in shared memory (or in the message) onto its device.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from .handover import one_thread_beside_a_cpu_engine, taken_saves

__all__ = ["COPY_BYTES", "STAGED_BYTES", "merged", "tensor_slot", "unpacked"]

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


def unpacked(meta: bytes, block: bytearray | tuple[str, int], entries: list, size: int = 0) -> Any:
    """What `dumps_saves` packed: ``meta`` unpickled, each tensor reference resolved from ``block``.

    ``block`` is the bytes themselves, or ``(file, byte offset)`` of ``size``
    bytes in shared memory (`vlenvoys.engine.handover.taken_saves`).
    """
    with one_thread_beside_a_cpu_engine():
        if isinstance(block, tuple):
            pin = any(entry[4].startswith("cuda") for entry in entries)
            tensors = taken_saves(block, size, lambda host: _copied(host, entries), pin=pin)
        else:
            host = torch.frombuffer(block, dtype=torch.uint8) if len(block) else torch.empty(0, dtype=torch.uint8)
            tensors = _copied(host, entries)
    return _SavesUnpickler(io.BytesIO(meta), tensors).load()


def _copied(host: torch.Tensor, entries: list) -> list:
    """Each entry's tensor, copied out of ``host`` onto its device."""
    tensors: list = [None] * len(entries)
    # A device's tensors are copied over in runs of at most COPY_BYTES, each run one copy: the device holds
    # its tensors and one run at a time, not the whole block besides them (on the CPU a run is a view).
    run: list[int] = []
    straight: set[str] = set()  # devices copied to straight from ``host`` (a registered mapping)
    for index in sorted(range(len(entries)), key=lambda index: (entries[index][4], entries[index][0])):
        start, size, dtype, shape, device = entries[index]
        if run and (entries[run[0]][4] != device or start + size - entries[run[0]][0] > COPY_BYTES):
            _copy_run(host, entries, run, tensors, straight)
        run.append(index)
    if run:
        _copy_run(host, entries, run, tensors, straight)
    for device in straight:  # such a copy reads ``host`` until it is done, and the block is let go after this
        torch.cuda.current_stream(device).synchronize()
    return tensors


def _copy_run(host: torch.Tensor, entries: list, run: list[int], tensors: list, straight: set[str]) -> None:
    first, device = entries[run[0]][0], entries[run[0]][4]
    last = entries[run[-1]][0] + entries[run[-1]][1]
    part = host[first:last]
    if device.startswith("cuda") and part.is_pinned():  # the client's registered mapping (`handover.SavesMaps`)
        copied = part.to(device, non_blocking=True)
        straight.add(device)
    elif device.startswith("cuda") and last - first >= STAGED_BYTES:
        # Through page-locked memory: a copy to the device from pageable memory (the engine's shared memory, mapped
        # here) is staged by the driver in small pieces, 3.7 GB/s on an H200, where this copy is spread over the
        # host's threads and the one to the device runs at the bus's speed. torch's host allocator keeps the block
        # for the next run, and for as long as the queued copy reads it.
        staged = torch.empty(last - first, dtype=torch.uint8, pin_memory=True)
        staged.copy_(part)
        copied = staged.to(device, non_blocking=True)
    else:
        copied = part.to(device)
    for index in run:
        start, size, dtype, shape, _ = entries[index]
        # Each its own storage: one kept tensor does not keep the others alive, nor pickle with them.
        tensors[index] = copied[start - first : start - first + size].view(dtype).reshape(shape).clone()
    run.clear()


#: The most bytes `unpacked` copies to a device at once.
COPY_BYTES = 256 << 20
#: From this many bytes on, `unpacked` copies to a CUDA device through page-locked memory.
STAGED_BYTES = 1 << 20


def tensor_slot(index: int) -> Any:
    """Stands in `dumps_saves`'s metadata for its ``index``-th tensor; `_SavesUnpickler` resolves it."""
    raise RuntimeError("a vlenvoys tensor slot is resolved only while its saves are unpacked")


class _SavesUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, tensors: list) -> None:
        super().__init__(file)
        self.tensors = tensors

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == "tensor_slot":
            return self.tensors.__getitem__
        return super().find_class(module, name)
