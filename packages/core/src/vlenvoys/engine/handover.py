"""The client's side of a handover: rows and saves the worker left in shared memory, mapped or read in place.

The worker writes them once, off the device (`vlenvoys.worker.arena`); the
files' layout and names are `vlenvoys.wire.shm`'s. Here the client maps a
collection's rows (`received`), reads an activation dataset's straight into
its shards (`rows_of`, `read_rows`), and copies a trace's saves out of their
block (`taken_saves`, through mappings it keeps: `SavesMaps`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import io
import mmap
import os
import queue
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from ..wire.shm import SAVES_HEADER, row_bytes

__all__ = [
    "SAVES_MAPS", "InThread", "Rows", "SavesMaps", "one_thread_beside_a_cpu_engine", "read_rows", "received", "rows_of",
    "taken_saves",
]


def _opened(path: str, flags: int) -> int:
    """A descriptor of the engine's file at ``path``; RuntimeError where this host has no such file."""
    try:
        return os.open(path, flags)
    except FileNotFoundError as error:
        raise RuntimeError(f"the engine left its values at {path}, which this host does not have") from error


def _mapped(path: str) -> torch.Tensor:
    """The file's bytes, mapped privately, with a shared lock held for as long as any view of them lives.

    The mapping keeps its own duplicate of the descriptor, and with it the
    lock; both go when the last tensor viewing the mapping is freed, and the
    worker may reuse the chunk then (`vlenvoys.worker.arena`'s ``mapped_by_a_client``).
    """
    handle = _opened(path, os.O_RDONLY)
    try:
        fcntl.flock(handle, fcntl.LOCK_SH)
        size = os.fstat(handle).st_size
        view = mmap.mmap(handle, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(handle)
    return torch.frombuffer(view, dtype=torch.uint8)


def received(
    handed: dict[str, Any], maps: dict[str, torch.Tensor] | None = None, joined: bool = True
) -> dict[str, list[Any]]:
    """Client side: each request's rows (``[rows, *row shape]``), per value key, from `Arena.handover`.

    Rows a request has in several pieces (chunks, steps) are joined into one
    tensor (a copy); with ``joined`` False each request's are the list of its
    pieces, in order, each viewing the engine's memory, for a caller that
    copies them into a place of its own anyway.

    ``maps`` (path -> mapping) lets several handovers share one mapping of a
    file, and one descriptor: pass the same dict for the handovers of one run
    whose tensors nobody writes into before the run ends (a write would copy
    its page, and rows handed over later in that page would not show).

    Raises:
        RuntimeError: a file is not on this host (an engine on another machine).
    """
    maps = {} if maps is None else maps
    out: dict[str, list[torch.Tensor]] = {}
    for key, shape, dtype, inline, requests in _per_value(handed):
        each = row_bytes(shape, dtype)
        out[key] = []
        for where in requests:
            parts = []
            for path, offset, count in where:
                if path is None:
                    parts.append(inline[offset : offset + count])
                    continue
                if path not in maps:
                    maps[path] = _mapped(path)
                parts.append(maps[path][offset : offset + count * each].view(dtype).view(count, *shape))
            out[key].append(parts if not joined else parts[0] if len(parts) == 1 else torch.cat(parts))
    return out


def _per_value(handed: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...], torch.dtype, torch.Tensor | None, list]]:
    """A handover's values: ``(key, row shape, dtype, its inline rows or None, each request's pieces)``."""
    inline = torch.load(io.BytesIO(handed["inline"]), weights_only=True) if handed["inline"] else {}
    for key, requests in handed["pieces"].items():
        shape, dtype = handed["rows"][key]
        yield key, tuple(shape), getattr(torch, dtype), inline.get(key), requests


class _Held:
    """A descriptor of one engine file, with a shared lock on it (the worker does not reuse the chunk) while it lives."""

    __slots__ = ("fd",)

    def __init__(self, path: str) -> None:
        self.fd = -1
        handle = _opened(path, os.O_RDONLY)
        fcntl.flock(handle, fcntl.LOCK_SH)
        self.fd = handle

    def __del__(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # the lock goes with it


@dataclasses.dataclass(frozen=True)
class Rows:
    """One request's rows of one value, where the engine left them, not yet read.

    ``count`` rows of ``shape`` (one row's shape, in the value's layout) and
    ``dtype``. Each file's piece holds a descriptor with a shared lock, so the
    worker does not reuse that memory until the object is gone (as with a
    mapping in `received`). `read_rows` reads them with ``os.preadv``
    straight into their place: no mapping and no page faults, and the GIL
    given up once per contiguous run of a file, where a copy out of a mapping
    is a torch call per request (each gives the GIL up and waits for it again
    while another thread runs Python; measured on an H200's host: 0.04 GB/s).
    """

    #: (file or None for the handover's inline bytes, byte offset in the file or row offset in those bytes, rows).
    pieces: tuple[tuple[_Held | None, int, int], ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    #: The handover's inline rows of this value (process memory on the engine), as bytes; None if none.
    inline: memoryview | None = None

    @property
    def count(self) -> int:
        return sum(count for _, _, count in self.pieces)

    @property
    def row_bytes(self) -> int:
        return row_bytes(self.shape, self.dtype)

    def tensor(self) -> torch.Tensor:
        """The rows, read now into a new ``[count, *shape]`` tensor."""
        out = torch.empty((self.count, *self.shape), dtype=self.dtype)
        read_rows([(self, [(0, self.count)], memoryview(out.view(-1).view(torch.uint8).numpy()), 0)])
        return out


def rows_of(handed: dict[str, Any]) -> dict[str, list[Rows]]:
    """Client side: each request's rows (per value key, in the handover's order) as `Rows`, not read.

    Raises:
        RuntimeError: a file is not on this host (an engine on another machine).
    """
    held: dict[str, _Held] = {}
    out: dict[str, list[Rows]] = {}
    for key, shape, dtype, inline, requests in _per_value(handed):
        flat = None if inline is None else memoryview(inline.reshape(-1).view(torch.uint8).numpy())
        out[key] = []
        for where in requests:
            pieces = []
            for path, offset, count in where:
                if path is not None and path not in held:
                    held[path] = _Held(path)
                pieces.append((held.get(path), offset, count))
            out[key].append(Rows(tuple(pieces), shape, dtype, flat))
    return out


#: Buffers one ``preadv`` call takes at most.
_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024


def read_rows(reads: Iterable[tuple[Rows, Sequence[tuple[int, int]], memoryview, int]]) -> None:
    """Read rows into place: for each ``(rows, runs, destination, first)``, the rows ``[start, stop)`` of each run,
    in order, into ``destination`` (the bytes of a tensor of rows as long as these, e.g. a shard's) from row ``first`` on.

    Pieces that lie back to back in a file are read by one ``os.preadv``.

    Raises:
        RuntimeError: a file ended before the rows it should hold.
    """
    segments: dict[int, list[tuple[int, memoryview]]] = {}
    for rows, runs, destination, first in reads:
        each = rows.row_bytes
        at = first * each
        for start, stop in runs:
            base = 0  # the request's row the piece starts at
            for held, offset, count in rows.pieces:
                low, high = max(start, base), min(stop, base + count)
                if low < high:
                    size = (high - low) * each
                    target = destination[at : at + size]
                    if held is None:  # inline: the offset counts rows
                        begin = (offset + low - base) * each
                        target[:] = rows.inline[begin : begin + size]
                    else:
                        segments.setdefault(held.fd, []).append((offset + (low - base) * each, target))
                    at += size
                base += count
    for fd, parts in segments.items():
        parts.sort(key=lambda part: part[0])
        index = 0
        while index < len(parts):
            offset, views = parts[index][0], [parts[index][1]]
            end = offset + len(views[0])
            index += 1
            while index < len(parts) and parts[index][0] == end and len(views) < _IOV_MAX:
                views.append(parts[index][1])
                end += len(parts[index][1])
                index += 1
            if os.preadv(fd, views, offset) != end - offset:
                raise RuntimeError("an engine file ended before the rows it was said to hold")


class InThread:
    """``deliver`` called on a thread of its own, in order, at most ``depth`` calls behind the caller.

    For work on handed-over values that should not hold the thread driving the
    engine (`vlenvoys.collect`'s takes, `vlenvoys.activations`' shard writes).
    After an error the rest is dropped, and the next call, or `close`, raises it.
    """

    def __init__(self, deliver: Callable, depth: int, name: str) -> None:
        self.deliver = deliver
        self.queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._work, name=name, daemon=True)
        self.thread.start()

    def _work(self) -> None:
        try:
            while (job := self.queue.get()) is not None:
                if self.error is None:  # after an error the rest is dropped: the caller raises it at its next call
                    try:
                        self.deliver(*job)
                    except BaseException as error:
                        self.error = error
                del job
        finally:
            # ``deliver`` is most often a method of this object's owner, which holds this object: a cycle that
            # kept what it refers to alive until Python's next full collection. For `vlenvoys.collect` that was
            # the run's mappings of the engine's files, so the worker could reuse none of its row memory and
            # made (and, on a GPU, page-locked) new memory for every run: collect at 0.43 of plain vLLM on an H100.
            self.deliver = None

    def __call__(self, *args: Any) -> None:
        self.raise_error()
        self.queue.put(args)

    def stop(self) -> None:
        """Deliver what was handed over, then end the thread."""
        self.queue.put(None)
        self.thread.join()

    def close(self) -> None:
        self.stop()
        self.raise_error()

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error


def taken_saves(where: tuple[str, int], size: int, take: Any, pin: bool = False) -> Any:
    """Client side: ``take(host)`` of the ``size`` bytes of saves `Arena.saves` placed at ``where``; then their flag is cleared.

    ``host`` is a read-only uint8 tensor over a shared mapping of those
    bytes, valid only during the call: ``take`` must copy what it keeps, and
    finish any asynchronous copy from it, before it returns (the worker reuses
    the block once the flag is clear). The flag is cleared whether or not
    ``take`` succeeds. The client keeps its mapping of each engine file
    (`SavesMaps`) for the next trace; with ``pin`` (copies to a CUDA device
    follow) the mapping is also registered with CUDA, once.

    Raises:
        RuntimeError: the file is not on this host (an engine on another machine).
    """
    path, offset = where
    mapping = SAVES_MAPS.get(path)
    try:
        if pin:
            mapping.pin()
        start = offset + SAVES_HEADER
        return take(mapping.host[start : start + size])
    finally:
        handle = _opened(path, os.O_WRONLY)
        try:
            os.pwrite(handle, b"\0", offset)
        finally:
            os.close(handle)


class _SavesMap:
    """The client's read-only shared mapping of one engine file, whole, and whether CUDA has it page-locked."""

    def __init__(self, path: str) -> None:
        handle = _opened(path, os.O_RDONLY)  # no lock: the worker decides reuse by the saves' flags alone
        try:
            status = os.fstat(handle)
            self.file, self.size = (status.st_dev, status.st_ino), status.st_size
            self.view = mmap.mmap(handle, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(handle)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The given buffer is not writable")  # nothing writes into it
            self.host = torch.frombuffer(self.view, dtype=torch.uint8)
        self.pinned = False

    def pin(self) -> None:
        """Register the mapping with CUDA (read-only), so copies from it to a device run at the bus's speed.

        Once per mapping (page-locking a GiB took 0.38 s on the H200's host). Where CUDA refuses
        (no read-only registration), copies go through page-locked staging (`vlenvoys.engine.saves`).
        """
        if self.pinned is not False:
            return
        cudart = torch.cuda.cudart()
        self.pinned = cudart.cudaHostRegister(self.host.data_ptr(), self.size, _REGISTER_READ_ONLY) == 0
        if not self.pinned:
            cudart.cudaGetLastError()  # a refused registration must not surface at the next kernel's check
            self.pinned = None  # tried

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.host.data_ptr())
        self.pinned = False
        del self.host
        with contextlib.suppress(BufferError):  # a view still alive keeps it; it goes with that view
            self.view.close()


#: ``cudaHostRegisterReadOnly``: the mapping is read-only.
_REGISTER_READ_ONLY = 8


class SavesMaps:
    """The client's mappings of the engine files holding trace saves, kept from trace to trace.

    Mapping a block for every trace and unmapping it after cost a fifth of a
    3-read trace's client time on an H200 (the unmapping alone 8 %), and a
    copy to a device from a mapping CUDA has not registered is staged through
    page-locked memory. The worker reuses its files, so the client keeps one
    read-only mapping per file and registers it with CUDA once. A mapping
    whose file is gone (the worker gave the chunk up, or exited) or was
    replaced is dropped at the next `get`; `forget` drops them all
    (`vlenvoys.shutdown`).
    """

    def __init__(self) -> None:
        self.maps: dict[str, _SavesMap] = {}

    def get(self, path: str) -> _SavesMap:
        self.drop_stale()
        if path not in self.maps:
            self.maps[path] = _SavesMap(path)
        return self.maps[path]

    def drop_stale(self) -> None:
        """Drop the mappings whose file is gone or was replaced (the memory goes with the last of them)."""
        for known, mapping in list(self.maps.items()):
            try:
                status = os.stat(known)
            except FileNotFoundError:
                status = None
            if status is None or (status.st_dev, status.st_ino) != mapping.file or status.st_size != mapping.size:
                del self.maps[known]
                mapping.close()

    def forget(self) -> None:
        for mapping in self.maps.values():
            mapping.close()
        self.maps.clear()


SAVES_MAPS = SavesMaps()


@contextlib.contextmanager
def one_thread_beside_a_cpu_engine() -> Iterator[None]:
    """torch on one thread in this process for the block, where vLLM's engine runs on this machine's CPUs.

    The client's copies out of the engine's memory (`vlenvoys.collect`'s rows, a trace's
    saves) would fork over the machine's threads, and the CPU engine's threads spin on
    those cores between steps: a copy then waits for a thread that has no core. An
    activation dataset's collection on the CPU spent 61 % of its client time in one such
    copy; a 3-read trace's 70 MB took 0.4-0.9 s to copy, 0.03 s on one thread.
    """
    from vllm.platforms import current_platform

    before = torch.get_num_threads()
    if not current_platform.is_cpu() or before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
