"""A trace's saves sent back from the worker: one block of tensor data in shared memory, what cannot go refused.

The client loads them with `vlenvoys.engine.saves.unpacked`, which the pickle names.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
from typing import Any

import torch
from nnsight.intervention.envoy import Envoy
from nnsight.modeling.vllm.collect import _CompactPickler
from nnsight.tracing.tracer import Tracer

from ..engine.saves import tensor_slot, unpacked
from ..wire.shm import ALIGN, SHARED_MEMORY
from .arena import worker_arena

__all__ = ["SavesTooLarge", "dumps_saves", "message_bytes", "send_back_what_can_be_sent", "stop_sending"]


#: The model runner whose arena `send_back_what_can_be_sent`'s pickling uses (one per worker process).
_SENDING: dict[str, Any] = {"runner": None}


def send_back_what_can_be_sent(runner: Any = None) -> None:
    """Worker side: a saved value that cannot be pickled fails its own trace, not the engine.

    nnsight pickles every request's saves in one go when the caller collects
    them; one value that will not pickle (a lambda, nnsight's step object of
    ``with tracer.iter[:] as step``) raised there, in the engine's RPC, and the
    engine died with every request in it. Pickling is retried value by value:
    what will not go is dropped and becomes that request's error, a TypeError
    naming the saved variable and its type. So are saves too large to send:
    where shared memory has no room for them, the largest values go until the
    rest fits `message_bytes` (gigabytes of bytes copied through the engine's
    messages put the memory of the engine every request shares at risk).

    With ``runner`` (the worker's model runner), the tensors' data goes
    through the runner's shared-memory arena (`dumps_saves`).
    """
    from nnsight.intervention.errors import capture_exception
    from nnsight.modeling.vllm.model_runners import GPUModelRunner as runner_module

    _SENDING["runner"] = runner  # nnsight's pickling is a module function: the latest runner's arena serves it
    if getattr(runner_module.dumps_compact, "vlenvoys", False):
        return
    dumps = dumps_saves

    def arena() -> Any:
        if _SENDING["runner"] is None:
            return None
        return worker_arena(_SENDING["runner"])

    def refuse(entry: dict, name: str, value: Any, why: str) -> None:
        if entry.get("error") is None:
            entry["error"] = capture_exception(TypeError(
                f"the saved variable {name!r} ({_type_name(value)}) cannot be sent back from the engine: {why}"
            ))

    def drop_unpicklable(collected: dict) -> None:
        """Value by value: what will not pickle goes, its request's error (only the pickling is tried)."""
        for entry, bucket, name, value in _saved_values(collected):
            try:
                _tensors_of(value)
            except Exception as error:
                bucket.pop(name, None)
                why = _why_unsendable(value, error, _tensors_of)
                refuse(entry, name, value, f"{why}; save tensors, numbers, strings or containers of them")

    def drop_largest(collected: dict) -> None:
        """The largest saved values go, each its requests' error, until the rest may travel in a message."""
        holders: dict[int, list] = {}  # one value saved under several names, or by several requests, counts once
        for item in _saved_values(collected):
            holders.setdefault(id(item[3]), []).append(item)
        sizes = {key: _tensor_bytes(items[0][3]) for key, items in holders.items()}
        total, limit = sum(sizes.values()), message_bytes()
        for key in sorted(sizes, key=sizes.__getitem__, reverse=True):
            if total <= limit:
                return
            total -= sizes[key]
            for entry, bucket, name, value in holders[key]:
                bucket.pop(name, None)
                refuse(entry, name, value, (
                    f"it holds {sizes[key] / 2**30:.3g} GiB of tensors; shared memory had no room for this trace's "
                    f"saves ({_free_shared_memory() / 2**30:.3g} GiB free in /dev/shm), and through the engine's "
                    f"messages they may take at most {limit / 2**30:.3g} GiB (`vlenvoys.worker.saves.message_bytes`): save "
                    "less (a slice, fewer positions), or read many prompts with vlenvoys.collect"
                ))

    def dumps_what_can_be_sent(collected: dict) -> bytes:
        for attempt in range(2):
            try:
                return dumps(collected, arena())
            except SavesTooLarge:
                drop_largest(collected)
            except Exception:
                if attempt:
                    raise
                drop_unpicklable(collected)
        return dumps(collected, arena())

    dumps_what_can_be_sent.vlenvoys = True
    runner_module.dumps_compact = dumps_what_can_be_sent


def dumps_saves(value: Any, arena: Any = None) -> bytes:
    """Pickle a request's saves as nnsight's ``dumps_compact`` does, the plain tensors' data in one block.

    Pickling a tensor the default way runs a ``torch.save`` per tensor and a
    synchronous copy off the device, and loading it a ``torch.load`` and a copy
    back: on an H200 a trace of 64 requests with 3 stream reads each spent more
    time there than in the forward. Here each dense tensor is a reference into
    one host block, filled by queued copies and one wait per device (only a
    view's own elements, as nnsight's compact pickler does). `unpacked`
    rebuilds each tensor on the device it was saved on, contiguous, in its own
    storage. Other tensors (a subclass, sparse, nested, quantized, expanded,
    with gradients) and everything else go nnsight's way; an object saved
    twice is still one.

    With the worker's `vlenvoys.worker.arena.Arena`, the block lies in one of its
    shared-memory chunks and only where it lies is pickled: the data is not
    copied into the message, sent through vLLM's RPC and copied out again (on
    an H200, 600 MB of a trace's saves cost 4 s that way). The client must
    load what this returns (its flag holds the block until then); without
    room in shared memory the block travels in the message, as without an arena.
    """
    tensors: list[torch.Tensor] = []
    meta = io.BytesIO()
    _SavesPickler(meta, tensors).dump(value)
    if not tensors:
        return meta.getvalue()
    # Laid out device by device, so the client copies each device's part of the block to that device alone.
    entries: list = [None] * len(tensors)
    offset = 0
    for index in sorted(range(len(tensors)), key=lambda index: str(tensors[index].device)):
        tensor = tensors[index]
        offset = -(-offset // ALIGN) * ALIGN  # a dtype view of the block needs an aligned offset
        size = tensor.numel() * tensor.element_size()
        entries[index] = (offset, size, tensor.dtype, tuple(tensor.shape), str(tensor.device))
        offset += size
    devices = {tensor.device for tensor in tensors if tensor.is_cuda}
    try:
        shared = arena.saves(offset) if arena is not None else None
    except Exception:  # no chunk could be had (no memory to page-lock, no file): the block goes in the message
        shared = None
    if shared is not None:
        block, where = shared
        queued = bool(devices) and arena.device_copies  # its chunks are page-locked (or the copy waits anyway)
    elif offset > message_bytes():
        raise SavesTooLarge(f"{offset} bytes of tensors, and shared memory has no room for them")
    else:
        # Page-locked, the copies are queued; torch's host allocator keeps such a block for reuse, so only small ones.
        queued = bool(devices) and offset <= PINNED_BYTES
        block = torch.empty(offset, dtype=torch.uint8, pin_memory=queued)
    try:
        for tensor, (start, size, *_) in zip(tensors, entries):
            flat = tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
            block[start : start + size].copy_(flat, non_blocking=queued)
        for device in devices if queued else ():
            torch.cuda.synchronize(device)
    except BaseException:
        if shared is not None:
            # Copies queued before the failure may still land: the block is free again only once they have.
            for device in devices if queued else ():
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize(device)
            arena.dropped_saves(where)
        raise
    if shared is not None:
        try:
            return pickle.dumps(_Packed(meta.getvalue(), where, entries, offset), pickle.HIGHEST_PROTOCOL)
        except BaseException:  # no client will load these saves: their block is free again
            arena.dropped_saves(where)
            raise
    packed = pickle.PickleBuffer(block.numpy())  # in-band: it loads as a bytearray
    return pickle.dumps(_Packed(meta.getvalue(), packed, entries), pickle.HIGHEST_PROTOCOL)


class _Packed:
    """Pickles as a call of `unpacked`: the client's plain ``pickle.loads`` rebuilds the saves."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __reduce__(self) -> tuple:
        return unpacked, self.args


def _saved_values(collected: dict) -> list[tuple[dict, dict, str, Any]]:
    """Every saved value of a collect call's entries: (its request's entry, its bucket, its name, the value)."""
    found, seen = [], set()
    for entry in collected.values():
        buckets = [entry["saves"], entry["registered"]]
        for sequence in entry.get("sequences", {}).values():
            buckets += [sequence["saves"], sequence["registered"]]
        for bucket in buckets:
            if id(bucket) not in seen:  # sequence 0's saves are the entry's own dict
                seen.add(id(bucket))
                found += [(entry, bucket, name, value) for name, value in bucket.items()]
    return found


def _tensors_of(value: Any) -> list[torch.Tensor]:
    """The plain tensors `dumps_saves` would put in its block for ``value``, pickling the rest (which may raise)."""
    tensors: list[torch.Tensor] = []
    _SavesPickler(io.BytesIO(), tensors).dump(value)
    return tensors


def _tensor_bytes(value: Any) -> int:
    try:
        return sum(tensor.numel() * tensor.element_size() for tensor in _tensors_of(value))
    except Exception:
        return 0


class SavesTooLarge(ValueError):
    """A trace's saves too large to send back through the engine's messages (see `message_bytes`)."""


def message_bytes() -> int:
    """The most bytes of tensors a request's saves may send in the engine's messages: an eighth of the memory free.

    Saves that shared memory cannot hold travel in vLLM's messages, copied
    about three times on the way (the worker's block, the message, the
    client's copy); past this bound they would risk the memory of the engine
    that every other request shares, so they are refused (`SavesTooLarge`).
    """
    import psutil

    return psutil.virtual_memory().available // 8


def _free_shared_memory() -> int:
    try:
        room = os.statvfs(SHARED_MEMORY)
    except OSError:
        return 0
    return room.f_bavail * room.f_frsize


#: The largest block `dumps_saves` page-locks (a larger one is filled by waiting copies).
PINNED_BYTES = 256 << 20


def _plain(tensor: torch.Tensor) -> bool:
    return (
        type(tensor) is torch.Tensor
        and tensor.layout is torch.strided
        and tensor.device.type != "meta"
        and not (tensor.requires_grad or tensor.is_quantized or tensor.is_nested)
        # An expanded tensor (a stride 0) would travel at its full size; torch's pickling keeps it small.
        and all(stride != 0 or length <= 1 for stride, length in zip(tensor.stride(), tensor.shape))
    )


class _SavesPickler(_CompactPickler):
    # reducer_override, not persistent_id: pickle skips it for ints, floats, strings and plain
    # containers (a saved list of a million floats), and memoizes what it returns (one object saved twice).
    def __init__(self, file: Any, tensors: list) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and _plain(obj):
            self.tensors.append(obj)
            return tensor_slot, (len(self.tensors) - 1,)
        if isinstance(obj, _RUN_OBJECTS):
            # An unentered ``tracer.iter[:]`` pickles, and an envoy may (with its module's weights, where no
            # kernel stops it): either would arrive as a copy bound to nothing, so neither goes.
            raise TypeError(f"{type(obj).__name__} is an object of the engine's run, which means nothing outside it")
        return super().reducer_override(obj)


#: nnsight's tracers (the step object of ``tracer.iter``, the tracer itself) and envoys: never sent back.
_RUN_OBJECTS = (Tracer, Envoy)


def _type_name(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _why_unsendable(value: Any, error: Exception, dumps: Any) -> str:
    """What in ``value`` will not pickle, in the user's terms (the pickler's own error can name a module
    it failed to import while looking for the culprit, such as torchvision for a lambda)."""
    import types

    culprit = value
    while True:
        parts = culprit.values() if isinstance(culprit, dict) else culprit if isinstance(culprit, (list, tuple, set)) else ()
        for part in parts:
            try:
                dumps(part)
            except Exception:
                culprit = part
                break
        else:
            break
    where = "it is" if culprit is value else f"it holds a {_type_name(culprit)}, which is"
    if isinstance(culprit, (types.FunctionType, types.LambdaType, types.MethodType)):
        return f"{where} a function, and functions defined in a trace do not pickle"
    if isinstance(culprit, _RUN_OBJECTS):
        return f"{where} nnsight's own object of the engine's run (a tracer, a step of tracer.iter, an envoy)"
    return f"{where} not picklable ({type(error).__name__}: {error})"


def stop_sending(runner: Any) -> None:
    """At the worker's shutdown: its saves no longer go through ``runner``'s arena, nor keep it alive."""
    if _SENDING["runner"] is runner:
        _SENDING["runner"] = None
