"""vLLM workers that run nnsight's model runner with a family's envoys.

vLLM names its worker class by path (``worker_cls``), so one of these is
imported in every worker process: `vlenvoys.workers.cpu.CPUWorker` on vLLM's
CPU engine, `vlenvoys.workers.gpu.GPUWorker` on CUDA/ROCm. nnsight's runner
builds its own envoy tree over the loaded module with the default envoys; the
user's block runs against that tree, so the family's envoys and names are
installed there, right after the model loads, on the same interleaver.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
from nnsight.intervention.envoy import Envoy
from nnsight.modeling.vllm.batching import VLLMBatcher
from nnsight.modeling.vllm.collect import _CompactPickler
from nnsight.tracing.tracer import Tracer

from ..handover import ALIGN


def instrument_sources(model: Any) -> None:
    """Source-instrument every block whose values are read at operations inside its forward.

    A value with no module boundary (GPT-2's stream after the attention add)
    is an operation of the block's forward; nnsight serves those once the
    module's forward is rewritten, which is done here, once, where the model
    runs.
    """
    from nnsight.intervention.source import install_source

    from ..envoys import StandardEnvoy
    from ..support import values_of

    for envoy in model.modules():
        if not isinstance(envoy, StandardEnvoy):
            continue
        for name, value in values_of(type(envoy)):
            if envoy.unavailable(name) is None and value.located_key(envoy).startswith("source."):
                install_source(envoy)
                break


def track_only_nnsight_work(requests: Any) -> None:
    """Worker side: nnsight's runner tracks a request only where it can have nnsight work.

    nnsight's ``Requests.add`` makes an entry for every new request, traced or
    not, and each step walks all of them twice (``scope``, ``record_saves``)
    until they finish: with hundreds of plain, collected or steered requests in
    flight that is Python work on every step of the engine core, which is the
    bottleneck of a decode step that replays a CUDA graph. A request that
    carries no block and names no edits, while no edit is installed, has
    nothing for nnsight to run or keep, and its entry would be dropped
    unread when it finishes; it is not made. ``requests`` is the runner's
    ``nnsight_requests``; its ``add`` is wrapped.
    """
    from ..stepping import carries_nnsight_work

    add = requests.add

    def add_tracked(new_requests: list, persistent_objects: dict) -> None:
        if not requests.templates:
            new_requests = [data for data in new_requests if carries_nnsight_work(data.sampling_params)]
        add(new_requests, persistent_objects)

    requests.add = add_tracked


#: How many distinct sources `compile_blocks_once` keeps compiled (then it starts over).
COMPILED_SOURCES = 512


def compile_blocks_once() -> None:
    """Worker side: a traced block's source, and each function it ships by source, is compiled once.

    nnsight sends a block (and every function of the user's it calls) as source
    and compiles it again for every request: 64 invokes of one trace compiled
    the same block 64 times, a tenth of the engine core's time in a trace on an
    H200. The compiled code is kept by its source text (the code object is
    immutable; each request still gets its own function and globals), and the
    source is registered once in ``linecache`` under a name of its own, so a
    block's traceback and source introspection read as before.
    """
    import linecache
    import types

    from nnsight.intervention import serialization
    from nnsight.intervention.interleaver import Mediator

    if getattr(serialization._load_function, "vlenvoys", False):
        return
    load = serialization._load_function
    functions: dict[tuple, types.CodeType] = {}
    blocks: dict[str, tuple[types.CodeType, str]] = {}

    def load_function(source, name, defaults, kwdefaults, annotations, origin_filename, origin_line):
        key = (source, name, origin_filename, origin_line)
        code = functions.get(key)
        if code is None:
            made = load(source, name, defaults, kwdefaults, annotations, origin_filename, origin_line)
            if len(functions) >= COMPILED_SOURCES:
                functions.clear()
            functions[key] = made.__code__
            return made
        # As nnsight's own builds it: empty globals, which its pickle fills after this returns.
        made = types.FunctionType(code, {"__builtins__": serialization.__builtins__}, name, defaults, None)
        if kwdefaults:
            made.__kwdefaults__ = kwdefaults
        if annotations:
            made.__annotations__ = annotations
        return made

    def setstate(self: Mediator, state: dict) -> None:
        source, glbls, lcls = state["reduced"]
        if source not in blocks:
            if len(blocks) >= COMPILED_SOURCES:
                blocks.clear()
            filename = f"<edit-{len(blocks)}-{abs(hash(source)):x}>"
            linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
            blocks[source] = (compile(source, filename, "exec"), filename)
        self.__init__(blocks[source][0], glbls, lcls, copy=state["copy"])
        self.presaved = state["presaved"]

    load_function.vlenvoys = True
    load_function.__module__, load_function.__qualname__ = load.__module__, load.__qualname__  # pickles as nnsight's
    serialization._load_function = load_function
    Mediator.__setstate__ = setstate


#: The most steps an open-ended ``tracer.iter[:]`` hands out in a worker (`end_open_iterations`).
_OPEN_STEPS: dict[str, int] = {"limit": 0}


def end_open_iterations(limit: int) -> None:
    """Worker side: an open-ended ``tracer.iter[:]`` hands out at most ``limit`` steps (the engine's longest sequence).

    Such a loop ends when its block parks on a step the model never runs; a
    block that reads nothing of the model (``with tracer.iter[:] as step:
    saved.append(step)``) never parks, so the loop ran forever inside the
    engine's step and every request in the engine hung with it. No request
    runs more steps than ``limit``, so ending the loop there, as the model
    stopping ends it, takes nothing from a block that does read the model.
    """
    from nnsight.intervention.iterator import Iterations

    _OPEN_STEPS["limit"] = limit
    if getattr(Iterations._indices, "vlenvoys", False):
        return
    indices = Iterations._indices

    def bounded(self: Iterations) -> Any:
        for step in indices(self):
            if self.stop is None and self.steps is None and step >= _OPEN_STEPS["limit"]:
                return
            yield step

    bounded.vlenvoys = True
    Iterations._indices = bounded


class SplicingBatcher(VLLMBatcher):
    """nnsight's vLLM batcher, without the copy when a block hands back its own rows unchanged.

    Every standard value read in a block is handed back when the block moves
    on (an unedited one as the model's own tensors), and nnsight splices each
    request's rows back into the step by concatenating the whole step's tensor: with many requests in a step that
    is one full copy per request and value. A block that hands back the very
    view it was served, edited in place or not, left the step's tensor
    holding its rows already, so the step's tensor is handed on as it is.
    """

    def _widen_tensor(self, full: torch.Tensor, group: list, edited: torch.Tensor) -> torch.Tensor:
        dim = self._token_dim(full)
        if dim is not None and isinstance(edited, torch.Tensor) and _is_span(full, dim, group, edited):
            return full
        return super()._widen_tensor(full, group, edited)


def _is_span(full: torch.Tensor, dim: int, group: list, edited: torch.Tensor) -> bool:
    """Whether ``edited`` is exactly ``full``'s rows of ``group`` (the same memory, not a copy)."""
    start, size = group
    span = full.narrow(dim, start, size)
    return (
        edited.data_ptr() == span.data_ptr()
        and edited.shape == span.shape
        and edited.stride() == span.stride()
        and edited.dtype == span.dtype
        and edited.device == span.device
    )


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
        from ..collector import worker_arena

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
                    f"messages they may take at most {limit / 2**30:.3g} GiB (`vlenvoys.workers.message_bytes`): save "
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

    With the worker's `vlenvoys.handover.Arena`, the block lies in one of its
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


def unpacked(meta: bytes, block: bytearray | tuple[str, int], entries: list, size: int = 0) -> Any:
    """What `dumps_saves` packed: ``meta`` unpickled, each tensor reference resolved from ``block``.

    ``block`` is the bytes themselves, or ``(file, byte offset)`` of ``size``
    bytes in shared memory (`vlenvoys.handover.taken_saves`).
    """
    from ..handover import one_thread_beside_a_cpu_engine, taken_saves

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
    from ..handover import SHARED_MEMORY

    try:
        room = os.statvfs(SHARED_MEMORY)
    except OSError:
        return 0
    return room.f_bavail * room.f_frsize


#: The largest block `dumps_saves` page-locks (a larger one is filled by waiting copies).
PINNED_BYTES = 256 << 20
#: The most bytes `unpacked` copies to a device at once.
COPY_BYTES = 256 << 20
#: From this many bytes on, `unpacked` copies to a CUDA device through page-locked memory.
STAGED_BYTES = 1 << 20


def _plain(tensor: torch.Tensor) -> bool:
    return (
        type(tensor) is torch.Tensor
        and tensor.layout is torch.strided
        and tensor.device.type != "meta"
        and not (tensor.requires_grad or tensor.is_quantized or tensor.is_nested)
        # An expanded tensor (a stride 0) would travel at its full size; torch's pickling keeps it small.
        and all(stride != 0 or length <= 1 for stride, length in zip(tensor.stride(), tensor.shape))
    )


def _tensor_slot(index: int) -> Any:
    """Stands in `dumps_saves`'s metadata for its ``index``-th tensor; `_SavesUnpickler` resolves it."""
    raise RuntimeError("a vlenvoys tensor slot is resolved only while its saves are unpacked")


class _SavesPickler(_CompactPickler):
    # reducer_override, not persistent_id: pickle skips it for ints, floats, strings and plain
    # containers (a saved list of a million floats), and memoizes what it returns (one object saved twice).
    def __init__(self, file: Any, tensors: list) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and _plain(obj):
            self.tensors.append(obj)
            return _tensor_slot, (len(self.tensors) - 1,)
        if isinstance(obj, _RUN_OBJECTS):
            # An unentered ``tracer.iter[:]`` pickles, and an envoy may (with its module's weights, where no
            # kernel stops it): either would arrive as a copy bound to nothing, so neither goes.
            raise TypeError(f"{type(obj).__name__} is an object of the engine's run, which means nothing outside it")
        return super().reducer_override(obj)


#: nnsight's tracers (the step object of ``tracer.iter``, the tracer itself) and envoys: never sent back.
_RUN_OBJECTS = (Tracer, Envoy)


class _SavesUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, tensors: list) -> None:
        super().__init__(file)
        self.tensors = tensors

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == "_tensor_slot":
            return self.tensors.__getitem__
        return super().find_class(module, name)


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


class StandardWorker:
    """Mixin for nnsight's workers: `vlenvoys.collector`'s RPCs, called by name with vLLM's ``collective_rpc``."""

    def vlenvoys_collect_start(self, name: str, reads: list) -> str:
        from .. import collector

        return collector.start(self, name, reads)

    def vlenvoys_collect_start_checked(self, name: str, reads: list) -> dict:
        from .. import collector

        return collector.start_checked(self, name, reads)

    def vlenvoys_collect_take(self, name: str, requests: list) -> tuple:
        from .. import collector

        return collector.take(self, name, requests)

    def vlenvoys_collect_stop(self, name: str) -> int:
        from .. import collector

        return collector.stop(self, name)

    def vlenvoys_steer_failures(self, requests: list) -> dict:
        from .. import steering

        return steering.failures(self, requests)

    def vlenvoys_collect_count(self) -> int:
        from .. import collector

        return collector.count(self)

    def vlenvoys_collect_stats(self) -> dict:
        from .. import collector

        return collector.stats(self)

    def shutdown(self) -> None:
        from .. import collector

        collector.close_arena(self)  # its files in shared memory go with the worker
        if _SENDING["runner"] is self.model_runner:  # its saves no longer go through an arena, nor keep it alive
            _SENDING["runner"] = None
        super().shutdown()


class StandardRunner:
    """Mixin for nnsight's runner: rebuilds its envoy tree with the model's family declarations,
    and tells `vlenvoys.collector`'s collectors which rows of each step are whose."""

    def _update_states(self, scheduler_output: Any) -> None:
        from nnsight.modeling.vllm.model_runners.GPUModelRunner import NNsightGPUModelRunner

        from ..stepping import carries_nnsight_work

        requests = self.nnsight_requests
        refuse_recomputed(self, scheduler_output)  # before nnsight scopes its workers over the step
        if requests.requests or requests.templates or any(
            carries_nnsight_work(data.sampling_params) for data in scheduler_output.scheduled_new_reqs
        ):
            super()._update_states(scheduler_output)
        else:
            # No block in flight or installed, none arriving: nnsight's bookkeeping (its harvest, its spans of
            # every request, its scope of no workers) would find nothing to do. vLLM's own states only.
            super(NNsightGPUModelRunner, self)._update_states(scheduler_output)
        from ..collector import step_spans
        from ..steering import plan_step

        self.vlenvoys_spans = step_spans(self, scheduler_output)
        plan_step(self, scheduler_output, self.vlenvoys_spans)

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().execute_model(*args, **kwargs)
        finally:
            # A forward outside a step (a warm-up) reads nothing, and eagerly steers nothing.
            self.vlenvoys_spans = []
            steerer = getattr(self, "vlenvoys_steerer", None)
            if steerer is not None:
                steerer.active = set()

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        from ..collect import serve_private_edits
        from ..engine import StandardizedVLLM
        from ..family import resolve
        from ..parallel import KernelFragments

        # Registrations vlenvoys.collect installs run only on the requests that name them.
        serve_private_edits(self.nnsight_requests)
        track_only_nnsight_work(self.nnsight_requests)
        compile_blocks_once()
        send_back_what_can_be_sent(self)
        end_open_iterations(self.model_config.max_model_len)

        backend = type(self.get_model()).__name__.startswith("Transformers")
        installed, name, architecture = resolve(
            self.model_config.hf_config.architectures, backend=backend, config=self.model_config.hf_config
        )
        plain = self.nnsight_model
        interleaver = plain.interleaver
        interleaver.batcher.__class__ = SplicingBatcher
        # The plain tree registered every module; a module already registered
        # would become an alias of the plain envoy instead of getting ours.
        interleaver.envoys.clear()
        # nnsight's sharding rules plus the attention kernel's heads, recorded
        # afresh as our tree is built (a no-op on one rank).
        ranks = self.parallel_config.tensor_parallel_size
        interleaver.fragments = KernelFragments(max(1, ranks // self.model_config.get_total_num_kv_heads()))
        model = StandardizedVLLM(self.get_model(), interleaver=interleaver, architecture=architecture)
        model.tokenizer = plain.tokenizer
        model.family, model.architecture_name = installed, name  # as `vlenvoys.load` sets them on the client's
        instrument_sources(model)
        self.nnsight_model = model
        self.nnsight_persistent_objects = model._remoteable_persistent_objects()
        if replays_graphs(self):
            from ..steering import Steerer, eligible

            # Graphs are captured once the engine has its cache, before any request: the
            # steering hooks must be in the forward by then, on every block (`Steerer`).
            if eligible(model) is None:
                self.vlenvoys_steerer = Steerer(self, every_block=True)


def refuse_recomputed(runner: Any, scheduler_output: Any) -> None:
    """End, with `vlenvoys.Preempted`, the blocks of requests vLLM resumes after a preemption by recomputing them.

    A preempted request comes back with its cache blocks gone and runs its
    tokens again from position 0 (or from a cached prefix) in new steps.
    nnsight hands such a step to the request's block as one more visit: a
    ``tracer.iter[:]`` loop got extra steps of many rows (measured: 153 steps
    for 150 tokens), and whatever the block wrote at the earlier positions is
    not in the recomputed cache, so the values after it differ from an
    unpressured run's. A block still running (a trace's, or an installed
    edit's copy) is ended instead, its request's error naming why; a block that
    finished before the preemption keeps its values (it sees nothing more).
    `vlenvoys.collect`'s and `generate`'s hooks need no refusal: they skip rows
    already read, and steer every recomputed position again.
    """
    cached = scheduler_output.scheduled_cached_reqs
    resumed = getattr(cached, "resumed_req_ids", None)
    requests = runner.nnsight_requests
    if not resumed or not requests.requests:
        return
    from greenlet import GreenletExit, getcurrent
    from nnsight.intervention.errors import capture_exception

    from ..errors import Preempted

    for index, request_id in enumerate(cached.req_ids):
        tracked, state = requests.requests.get(request_id), runner.requests.get(request_id)
        if request_id not in resumed or tracked is None or state is None:
            continue
        running = [
            mediator for mediator in tracked.workers()
            if mediator.exception is None and (mediator.alive or getattr(mediator, "caches", None))
        ]
        # Tokens fed before the preemption: the prompt and every sampled token but the last.
        fed = state.num_prompt_tokens + max(len(state.output_token_ids) - 1, 0)
        start = cached.num_computed_tokens[index]
        if not running or start >= fed:
            continue
        error = Preempted(
            f"vLLM preempted this request (its key/value cache went to other requests) and recomputes its {fed} "
            f"tokens from position {start}: a block would see those positions again as extra steps, without its "
            "earlier edits in the cache. Give the engine more key/value cache (kv_cache_memory_bytes, "
            "gpu_memory_utilization) or run fewer requests at once (max_num_seqs, fewer invokes)"
        )
        for mediator in running:
            if mediator.alive:  # unwound (its finally blocks run); GreenletExit passes any `except Exception`
                mediator.worker.parent = getcurrent()
                try:
                    mediator.worker.throw(GreenletExit)
                except BaseException:  # noqa: S110 - what the block raised on its way out: the request has its error
                    pass
            mediator.caches = []
            # Erred as a block that raised: nnsight keeps its row, ends the request early, reports the error.
            mediator.exception = error
        if tracked.error is None:
            tracked.error = capture_exception(error)


def replays_graphs(runner: Any) -> bool:
    """Whether ``runner``'s engine captures CUDA graphs (`vlenvoys.load` with ``cuda_graphs=True``, on a GPU)."""
    mode = getattr(getattr(runner, "compilation_config", None), "cudagraph_mode", None)
    return mode is not None and mode.name != "NONE"
