"""The worker's shared-memory writer: rows copied off the device into files the client maps, their memory reused.

How the files are laid out, named and swept is `vlenvoys.wire.shm`'s (the
client's reader is `vlenvoys.engine.handover`). A worker keeps one `Arena` for
its life (`worker_arena`): `vlenvoys.worker.collector`'s rows and a trace's
saves (`vlenvoys.worker.saves`) go into its chunks.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import tempfile
import time
from typing import Any

import torch

from ..wire.shm import ALIGN, LOCK_FILE, SAVES_HEADER, SHARED_MEMORY, row_bytes, sweep, worker_name

__all__ = ["Arena", "Piece", "keep_bytes", "worker_arena"]

#: A new chunk holds `BLOCKS_A_CHUNK` blocks of the size that needed it, at least `FIRST_CHUNK`, at most
#: `LARGEST_CHUNK` bytes (or the one block). Its size never depends on how many chunks came before: a
#: chunk is made only when every other is busy, and one doubling with their count grew a long collection's
#: memory at each such moment (1e6 tokens of a 1B model's stream took 7.1 GiB on an H200, plain prefill 3.8).
FIRST_CHUNK = 64 << 20
LARGEST_CHUNK = 1 << 30
BLOCKS_A_CHUNK = 4
#: Left free in shared memory for everyone else.
MARGIN = 256 << 20


def keep_bytes() -> int:
    """How many bytes of idle chunks a worker keeps for reuse: 8 GiB, at most a quarter of shared memory."""
    try:
        room = os.statvfs(SHARED_MEMORY)
    except OSError:
        return 8 << 30
    return min(8 << 30, room.f_blocks * room.f_frsize // 4)


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
            if LOCK_FILE.match(f"vlenvoys-{name}.lock"):
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
        if chunk is not None and chunk.used:
            self._rewind(chunk)
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

    def _rewind(self, chunk: _Chunk) -> None:
        """Fill the current chunk again from its start where nothing in it is owed any more.

        Without this a run began where the last one stopped, in the middle of the current chunk, and
        whether the runs' blocks fitted in the chunks they had depended on that offset: with the same
        work each run, every so many runs made a new chunk (the fourth on an H200 with V2's steps).
        """
        if not (chunk.live or chunk.waiting or chunk.unread_saves() or chunk.mapped_by_a_client()):
            chunk.used = 0

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


def worker_arena(runner: Any) -> Arena:
    """The worker's one `Arena`, kept for its life: its chunks are reused across collections."""
    if getattr(runner, "vlenvoys_arena", None) is None:
        device_copies = torch.device(runner.device).type == "cuda"
        runner.vlenvoys_arena = Arena(worker_name(), device_copies=device_copies)
    return runner.vlenvoys_arena
