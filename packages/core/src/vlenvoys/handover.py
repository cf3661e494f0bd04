"""How rows read on the engine reach the client: written once, mapped, never serialized; memory reused.

A collection of a 1B model's streams is about a gigabyte per 500 prompts.
Pickled through vLLM's RPC, or saved with ``torch.save`` into a file, that
costs more than the forward that computed it (measured on an H200: the save
alone took twice the forward). So the rows are copied off the device straight
into their final place: files in shared memory (`SHARED_MEMORY`), in chunks,
registered with CUDA so the copies are asynchronous. The worker hands over
only where each request's rows lie (file, byte offset, rows), and the client
maps the files: no copy after the one off the device.

Making that memory cost more than using it (on the H200's host, per GiB:
reserving 0.16 s, page-locking 0.38 s, the copy off the device 0.02 s), so a
worker keeps one `Arena` for its life and reuses its chunks. A chunk is
reused only when nobody can still read it:

- every block of rows in it is handed over or dropped (``live`` is 0), and it
  is no longer the one being filled;
- every collector that named it in a handover has called again since
  (`acknowledge`): the client maps a handover's files before its next call;
- no client mapping of it is left: the client holds a shared ``flock`` on the
  file for as long as any tensor viewing its mapping lives (`received`), and
  the worker takes the chunk back only if an exclusive lock would be granted.

The client maps privately (copy-on-write): a user writing into a returned
tensor changes nothing else. Idle chunks above `keep_bytes` are given up
(unlinked; a client's mapping outlives the name). A worker's arena holds an
exclusive lock on a file of its own for its life; `sweep` removes the files of
arenas whose lock can be taken (their worker exited, or was killed before it
could clean up). A lock, not a process id: containers that share
``/dev/shm`` do not share process ids.

Where shared memory has no room (or is not there), chunks are process memory
(pinned on a GPU) and the rows a handover needs are sent as bytes instead.

A trace's saves use the same chunks (`Arena.saves`): one block per call that
sends saves back, its first byte a flag the client clears once it has copied
them out (`taken_saves`). Until then the chunk is not reused; a client that
dies before it loads them leaves that chunk taken until the worker exits.
The client reads saves through one read-only mapping per file, kept from
trace to trace and registered with CUDA once (`SavesMaps`), holding no lock:
for saves, the flags alone decide reuse.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import io
import mmap
import os
import queue
import re
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

#: A memory file system on the same host.
SHARED_MEMORY = "/dev/shm"
#: A new chunk holds `BLOCKS_A_CHUNK` blocks of the size that needed it, at least `FIRST_CHUNK`, at most
#: `LARGEST_CHUNK` bytes (or the one block). Its size never depends on how many chunks came before: a
#: chunk is made only when every other is busy, and one doubling with their count grew a long collection's
#: memory at each such moment (1e6 tokens of a 1B model's stream took 7.1 GiB on an H200, plain prefill 3.8).
FIRST_CHUNK = 64 << 20
LARGEST_CHUNK = 1 << 30
BLOCKS_A_CHUNK = 4
#: Left free in shared memory for everyone else.
MARGIN = 256 << 20
#: Every block of rows starts at a multiple of this many bytes (any dtype's alignment).
ALIGN = 64
#: A trace's saves in a chunk start with this many bytes: a flag (the first byte), then padding to `ALIGN`.
SAVES_HEADER = ALIGN
#: A worker arena's lock file, ``vlenvoys-rows-<token>.lock``; its chunks are ``vlenvoys-rows-<token>-*.rows``.
_LOCK_FILE = re.compile(r"^vlenvoys-(rows-[0-9a-f]+)\.lock$")
#: A chunk file of a worker arena (`sweep` removes those whose arena holds no lock file).
_CHUNK_FILE = re.compile(r"^vlenvoys-(rows-[0-9a-f]+)-.*\.rows$")


def keep_bytes() -> int:
    """How many bytes of idle chunks a worker keeps for reuse: 8 GiB, at most a quarter of shared memory."""
    try:
        room = os.statvfs(SHARED_MEMORY)
    except OSError:
        return 8 << 30
    return min(8 << 30, room.f_blocks * room.f_frsize // 4)


def row_bytes(shape: Sequence[int], dtype: str | torch.dtype) -> int:
    """Bytes of one row of ``shape`` (the row's own shape) in ``dtype`` (or the dtype it names: ``"bfloat16"``)."""
    return torch.Size(shape).numel() * (getattr(torch, dtype) if isinstance(dtype, str) else dtype).itemsize


class _Chunk:
    __slots__ = ("path", "fd", "data", "used", "live", "pinned", "waiting", "tickets")

    def __init__(self, path: str | None, fd: int | None, data: torch.Tensor, pinned: bool) -> None:
        self.path, self.fd, self.data, self.pinned = path, fd, data, pinned
        self.used = 0  # bytes given out since it was (re)taken
        self.live = 0  # blocks of rows not yet handed over or dropped
        self.waiting: set[str] = set()  # collectors that named it in a handover and have not called since
        self.tickets: set[int] = set()  # byte offsets of trace saves' flags the client may not have cleared yet

    def unread_saves(self) -> bool:
        """True while a trace's saves in it wait for the client (their flag is still set, see `Arena.saves`)."""
        self.tickets = {offset for offset in self.tickets if int(self.data[offset]) != 0}
        return bool(self.tickets)

    @property
    def size(self) -> int:
        return self.data.numel()

    def mapped_by_a_client(self) -> bool:
        """True while some process holds a shared lock on the file (a client's tensors still view it)."""
        if self.fd is None:
            return False
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        return False


#: Where one request's rows at one value lie: (chunk id, byte offset, rows).
Piece = tuple[int, int, int]


class Arena:
    """Worker side: host memory for rows copied off the device, in chunks the client maps and the worker reuses.

    Args:
        name: Part of each file's name, so a leftover file says whose it is
            (a worker's: ``rows-<hex token>``, which `sweep` understands; see `worker_name`).
        device_copies: True on a GPU engine: chunks are registered with CUDA
            (page-locked), so a copy into them does not wait for the device.
        keep: Bytes of idle chunks kept for reuse (default `keep_bytes`).
    """

    def __init__(self, name: str, device_copies: bool, keep: int | None = None) -> None:
        self.name = name
        self.device_copies = device_copies
        self.keep = keep_bytes() if keep is None else keep
        self.chunks: dict[int, _Chunk] = {}
        self.current: int | None = None
        self.files = os.path.isdir(SHARED_MEMORY) and os.access(SHARED_MEMORY, os.W_OK)
        self.made = 0
        #: Bytes of chunks made so far, and the seconds making them took (reserving the memory, and on a
        #: GPU page-locking it: the forward waits meanwhile); `stats` reports them.
        self.made_bytes, self.made_seconds = 0, 0.0
        self.lock: int | None = None  # held for the arena's life: `sweep` leaves its files alone
        if self.files:
            sweep()
            if _LOCK_FILE.match(f"vlenvoys-{name}.lock"):
                # Locked before it is given its name: a sweep never sees it unlocked.
                self.lock, path = tempfile.mkstemp(prefix="vlenvoys-lock-", dir=SHARED_MEMORY)
                fcntl.flock(self.lock, fcntl.LOCK_EX)
                os.rename(path, os.path.join(SHARED_MEMORY, f"vlenvoys-{name}.lock"))

    def block(
        self, shape: torch.Size, dtype: torch.dtype, holders: int = 1, files_only: bool = False
    ) -> tuple[torch.Tensor, int, int] | None:
        r"""A ``[shape]`` host tensor to copy rows into; returns it, its chunk id and byte offset.

        ``holders``: how many pieces of it will be `release`\ d (one per request whose rows it holds).
        ``files_only``: None where the block would need a new chunk and shared memory has no room for one
        (instead of a chunk of process memory).
        """
        size = shape.numel() * dtype.itemsize
        chunk = self.chunks.get(self.current) if self.current is not None else None
        if chunk is None or chunk.used + size > chunk.size:
            self.current = None  # the full chunk is no longer current, so `_reused` may pick it
            self.current = self._reused(size)
            if self.current is None:
                self.current = self._new(max(size, min(LARGEST_CHUNK, max(FIRST_CHUNK, BLOCKS_A_CHUNK * size))), files_only)
                if self.current is None:
                    return None
            chunk = self.chunks[self.current]
        offset = chunk.used
        chunk.used = -(-(offset + size) // ALIGN) * ALIGN
        chunk.live += holders
        return chunk.data[offset : offset + size].view(dtype).view(shape), self.current, offset

    def saves(self, size: int) -> tuple[torch.Tensor, tuple[str, int]] | None:
        """A host block of ``size`` bytes in a shared-memory chunk for a trace's saves, and where the client finds it.

        Returns the block (aligned to `ALIGN`) and ``(file, byte offset of its
        header)``; None where no file chunk has room (the saves go as bytes).
        The header's first byte is set: the chunk is not reused until it reads
        0, which the client writes once it has copied the saves out
        (`taken_saves`), or `dropped_saves` if they are never sent.
        """
        if not self.files:
            return None
        # Never a new chunk of process memory: these saves would go as bytes, and the chunk would lie unused.
        got = self.block(torch.Size([SAVES_HEADER + size]), torch.uint8, holders=0, files_only=True)
        if got is None:
            return None
        data, chunk_id, offset = got
        chunk = self.chunks[chunk_id]
        if chunk.path is None:
            return None
        data[:SAVES_HEADER].zero_()
        data[0] = 1
        chunk.tickets.add(offset)
        return data[SAVES_HEADER:], (chunk.path, offset)

    def dropped_saves(self, where: tuple[str, int]) -> None:
        """The saves at ``where`` (from `saves`) will never reach a client: their block is free again."""
        for chunk in self.chunks.values():
            if chunk.path == where[0]:
                chunk.data[where[1]] = 0

    def _idle(self, chunk_id: int, chunk: _Chunk) -> bool:
        """Nothing the worker owes anyone is in it: not being filled, no rows pending, no handover unread."""
        return chunk_id != self.current and chunk.live == 0 and not chunk.waiting and not chunk.unread_saves()

    def _reused(self, size: int) -> int | None:
        """The largest idle chunk of at least ``size`` bytes no client maps any more, emptied; None if none."""
        fits = [(chunk.size, chunk_id) for chunk_id, chunk in self.chunks.items() if chunk.size >= size and self._idle(chunk_id, chunk)]
        for _, chunk_id in sorted(fits, reverse=True):
            chunk = self.chunks[chunk_id]
            if not chunk.mapped_by_a_client():
                chunk.used = 0
                return chunk_id
        return None

    def _new(self, size: int, files_only: bool = False) -> int | None:
        began = time.perf_counter()
        chunk = self._file(size) if self.files else None
        if chunk is None and files_only:
            return None
        chunk_id = self.made
        self.made += 1
        if chunk is None:  # no room in shared memory now: this chunk is process memory (its rows go as bytes)
            data = torch.empty(size, dtype=torch.uint8, pin_memory=self.device_copies)
            chunk = _Chunk(None, None, data, pinned=False)
        self.chunks[chunk_id] = chunk
        self.made_bytes += size
        self.made_seconds += time.perf_counter() - began
        return chunk_id

    def stats(self) -> dict[str, float]:
        """``{"chunks", "bytes"}`` held now, and ``{"made_bytes", "made_seconds"}`` since the arena began.

        A collection that makes no chunk runs in memory an earlier one left; one that does waits for
        each (on an H200's host, page-locking alone took 0.38 s a GiB).
        """
        return {
            "chunks": len(self.chunks), "bytes": sum(chunk.size for chunk in self.chunks.values()),
            "made_bytes": self.made_bytes, "made_seconds": self.made_seconds,
        }

    def _file(self, size: int) -> _Chunk | None:
        room = os.statvfs(SHARED_MEMORY)
        if room.f_bavail * room.f_frsize < size + MARGIN:
            return None
        handle, path = tempfile.mkstemp(prefix=f"vlenvoys-{self.name}-", suffix=".rows", dir=SHARED_MEMORY)
        try:
            # Reserved now: a tmpfs page that cannot be had at first write would kill the worker (SIGBUS).
            os.posix_fallocate(handle, 0, size)
        except OSError:
            os.close(handle)
            os.unlink(path)
            return None
        data = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        pinned = False
        if self.device_copies:
            pinned = torch.cuda.cudart().cudaHostRegister(data.data_ptr(), size, 0) == 0
        return _Chunk(path, handle, data, pinned)

    def release(self, pieces: list[Piece]) -> None:
        """These blocks' rows are handed over or dropped."""
        for chunk_id, _, _ in pieces:
            self.chunks[chunk_id].live -= 1

    def handover(
        self, pieces: dict[str, list[list[Piece]]], rows: dict[str, tuple[list[int], str]], owner: str
    ) -> dict[str, Any]:
        """What the client needs to map ``pieces`` (value key -> per request, its pieces).

        Call after the copies into these pieces are complete. ``owner`` names
        the caller (a collector); the chunks named here are not reused before
        ``owner`` calls `acknowledge`. Returns plain data (vLLM's RPC encoding
        sends it as is): ``{"rows": {key: (row shape, dtype name)}, "pieces":
        {key: [[(file or None, byte offset, rows), ...] per request]},
        "inline": bytes or None}``. Pieces in process memory are copied into
        ``inline`` (a ``torch.save`` of ``{key: tensor}``; their byte offset is
        then a row offset into it).
        """
        inline: dict[str, list[torch.Tensor]] = {}
        sent: dict[str, list[list[tuple[str | None, int, int]]]] = {}
        try:
            for key, requests in pieces.items():
                shape, dtype = rows[key]
                each = row_bytes(shape, dtype)
                sent[key] = []
                for request in requests:
                    where = []
                    for chunk_id, offset, count in request:
                        chunk = self.chunks[chunk_id]
                        if chunk.path is not None:
                            chunk.waiting.add(owner)
                            where.append((chunk.path, offset, count))
                            continue
                        done = sum(len(part) for part in inline.get(key, ()))
                        block = chunk.data[offset : offset + count * each].view(getattr(torch, dtype))
                        inline.setdefault(key, []).append(block.view(count, *shape).clone())
                        where.append((None, done, count))
                    sent[key].append(where)
            packed = None
            if inline:
                buffer = io.BytesIO()
                torch.save({key: torch.cat(parts) for key, parts in inline.items()}, buffer)
                packed = buffer.getvalue()
        finally:  # handed over or failed on the way (out of memory packing bytes): the worker owes these rows no more
            for requests in pieces.values():
                for request in requests:
                    self.release(request)
        return {"rows": rows, "pieces": sent, "inline": packed}

    def acknowledge(self, owner: str) -> None:
        """``owner`` has mapped every handover it was given (it calls again, or stops): its chunks may be reused.

        Idle chunks above `keep` are given up then, those a client still maps first (the worker could not
        reuse them until the client lets go), then the smallest.
        """
        for chunk in self.chunks.values():
            chunk.waiting.discard(owner)
        idle = [(chunk_id, chunk) for chunk_id, chunk in self.chunks.items() if self._idle(chunk_id, chunk)]
        excess = sum(chunk.size for _, chunk in idle) - self.keep
        if excess <= 0:
            return
        for chunk_id, chunk in sorted(idle, key=lambda item: (not item[1].mapped_by_a_client(), item[1].size)):
            if excess <= 0:
                break
            excess -= chunk.size
            self._give_up(self.chunks.pop(chunk_id))

    def _give_up(self, chunk: _Chunk) -> None:
        if chunk.pinned:
            torch.cuda.cudart().cudaHostUnregister(chunk.data.data_ptr())
        chunk.data = None  # the worker's mapping goes with its last view
        if chunk.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(chunk.path)  # a client's mapping keeps the memory until its tensors go
            os.close(chunk.fd)

    def close(self) -> None:
        """Give every chunk up and remove its file (a client's mappings keep what they view)."""
        for chunk in self.chunks.values():
            self._give_up(chunk)
        self.chunks.clear()
        self.current = None
        if self.lock is not None:  # after the chunks: a lock file gone with chunk files left would be swept
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHARED_MEMORY, f"vlenvoys-{self.name}.lock"))
            os.close(self.lock)
            self.lock = None


#: Set by a client while it starts an engine (`engine_named`): the engine's processes inherit it, and
#: each worker's arena name starts with it, so the client's `sweep` can wait for that engine's arenas.
ENGINE_VARIABLE = "VLENVOYS_ENGINE"


def worker_name() -> str:
    """A name for a worker's arena: ``rows-<hex token>``, unique on the host, led by its engine's name where it has one."""
    engine = os.environ.get(ENGINE_VARIABLE, "")
    return f"rows-{engine if re.fullmatch(r'[0-9a-f]{8}', engine) else ''}{uuid.uuid4().hex[:16]}"


@contextlib.contextmanager
def engine_named() -> Iterator[str]:
    """Start an engine inside the block: its workers' arenas are named for it; yields the name for `sweep`."""
    name, before = uuid.uuid4().hex[:8], os.environ.get(ENGINE_VARIABLE)
    os.environ[ENGINE_VARIABLE] = name
    try:
        yield name
    finally:
        if before is None:
            os.environ.pop(ENGINE_VARIABLE, None)
        else:
            os.environ[ENGINE_VARIABLE] = before


def sweep(engine: str | None = None, wait: float = 0.0) -> list[str]:
    """Remove the files of worker arenas whose lock nobody holds (their worker has exited); returns them.

    Chunk files of a worker arena that has no lock file are left by an arena
    that was removing its files when it died, and go too. With ``engine`` (a
    name from `engine_named`), wait up to ``wait`` seconds for that engine's
    arenas to be let go: a worker vLLM has just killed may still hold its lock
    for a moment, and its files would otherwise outlive it.
    """
    deadline = time.monotonic() + wait
    removed, held = _sweep_once()
    while engine is not None and any(owner.startswith(f"rows-{engine}") for owner in held) and time.monotonic() < deadline:
        time.sleep(0.05)
        more, held = _sweep_once()
        removed += more
    return removed


def _sweep_once() -> tuple[list[str], list[str]]:
    """One `sweep`: the files removed, and the arenas whose lock is held."""
    try:
        entries = os.listdir(SHARED_MEMORY)
    except OSError:
        return [], []
    locked = {}
    for entry in entries:
        match = _LOCK_FILE.match(entry)
        if match is not None:
            locked[match.group(1)] = entry
    removed, held = [], []
    for owner, entry in locked.items():
        path = os.path.join(SHARED_MEMORY, entry)
        try:
            handle = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(handle)
            held.append(owner)
            continue  # its worker is alive
        try:
            removed += _remove([name for name in entries if name.startswith(f"vlenvoys-{owner}-")] + [entry])
        finally:
            os.close(handle)
    removed += _remove(
        [name for name in entries if (match := _CHUNK_FILE.match(name)) and match.group(1) not in locked]
    )
    return removed, held


def _remove(entries: list[str]) -> list[str]:
    removed = []
    for entry in entries:
        try:
            os.unlink(os.path.join(SHARED_MEMORY, entry))
        except OSError:  # gone already, or someone else's
            continue
        removed.append(entry)
    return removed


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
    worker may reuse the chunk then (`_Chunk.mapped_by_a_client`).
    """
    handle = _opened(path, os.O_RDONLY)
    try:
        fcntl.flock(handle, fcntl.LOCK_SH)
        size = os.fstat(handle).st_size
        view = mmap.mmap(handle, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(handle)
    return torch.frombuffer(view, dtype=torch.uint8)


def received(handed: dict[str, Any], maps: dict[str, torch.Tensor] | None = None) -> dict[str, list[torch.Tensor]]:
    """Client side: each request's rows (``[rows, *row shape]``), per value key, from `Arena.handover`.

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
            out[key].append(parts[0] if len(parts) == 1 else torch.cat(parts))
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
        (no read-only registration), copies go through page-locked staging (`vlenvoys.workers`).
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
