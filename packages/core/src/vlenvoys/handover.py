"""How rows read on the engine reach the client: written once, mapped, never serialized.

A collection of a 1B model's streams is about a gigabyte per 500 prompts.
Pickled through vLLM's RPC, or saved with ``torch.save`` into a file, that
costs more than the forward that computed it (measured on an H200: the save
alone took twice the forward). So the rows are copied off the device straight
into their final place: files in shared memory (`SHARED_MEMORY`), in chunks,
registered with CUDA so the copies are asynchronous. The worker hands over
only where each request's rows lie (file, byte offset, rows), and the client
maps the files: no copy after the one off the device.

Ownership: a chunk is written by the worker only, each byte once. A chunk the
worker has finished writing and whose rows have all been handed over is
*retired*: the worker lets its own mapping go and names it in the handover;
the client unlinks it, after mapping it where it needs it. The memory is
freed when the last tensor viewing it is. The client maps privately
(copy-on-write): a user writing into a returned tensor changes nothing else.

Where shared memory has no room (or is not there), chunks are process memory
(pinned on a GPU) and the rows a handover needs are sent as bytes instead.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from typing import Any

import torch

#: A memory file system on the same host.
SHARED_MEMORY = "/dev/shm"
#: The first chunk's size; each next one doubles, up to `LARGEST_CHUNK` (a short run reserves little).
#: Making a chunk is most of a GPU collection's cost now: on the H200's host, reserving a GiB of shared
#: memory took 0.16 s and page-locking it 0.38 s, copying a GiB into it off the device 0.02 s.
FIRST_CHUNK = 64 << 20
LARGEST_CHUNK = 1 << 30
#: Left free in shared memory for everyone else.
MARGIN = 256 << 20
#: Every block of rows starts at a multiple of this many bytes (any dtype's alignment).
ALIGN = 64


class _Chunk:
    __slots__ = ("path", "data", "used", "live", "pinned")

    def __init__(self, path: str | None, data: torch.Tensor, pinned: bool) -> None:
        self.path, self.data, self.pinned = path, data, pinned
        self.used = 0  # bytes given out
        self.live = 0  # blocks of rows not yet handed over or dropped


#: Where one request's rows at one value lie: (chunk id, byte offset, rows).
Piece = tuple[int, int, int]


class Arena:
    """Worker side: host memory for rows copied off the device, in chunks the client can map.

    Args:
        name: Part of each file's name (the collector's), so a leftover file says whose it is.
        device_copies: True on a GPU engine: chunks are registered with CUDA
            (page-locked), so a copy into them does not wait for the device.
    """

    def __init__(self, name: str, device_copies: bool) -> None:
        self.name = name
        self.device_copies = device_copies
        self.chunks: dict[int, _Chunk] = {}
        self.current: int | None = None
        self.files = os.path.isdir(SHARED_MEMORY) and os.access(SHARED_MEMORY, os.W_OK)
        self.made = 0
        #: Retired files not yet named in a handover (the client unlinks them).
        self.retired: list[str] = []

    def block(self, shape: torch.Size, dtype: torch.dtype, holders: int = 1) -> tuple[torch.Tensor, int, int]:
        """A fresh ``[shape]`` host tensor to copy rows into; returns it, its chunk id and byte offset.

        ``holders``: how many pieces of it will be `release`\ d (one per request whose rows it holds).
        """
        size = shape.numel() * dtype.itemsize
        chunk = self.chunks.get(self.current) if self.current is not None else None
        if chunk is None or chunk.used + size > chunk.data.numel():
            self._finish_current()
            self.current, chunk = self._new(max(size, min(LARGEST_CHUNK, FIRST_CHUNK << self.made)))
        offset = chunk.used
        chunk.used = -(-(offset + size) // ALIGN) * ALIGN
        chunk.live += holders
        return chunk.data[offset : offset + size].view(dtype).view(shape), self.current, offset

    def _new(self, size: int) -> tuple[int, _Chunk]:
        chunk_id = self.made
        self.made += 1
        chunk = self._file(size) if self.files else None
        if chunk is None:
            self.files = False  # no room: process memory from here on
            data = torch.empty(size, dtype=torch.uint8, pin_memory=self.device_copies)
            chunk = _Chunk(None, data, pinned=False)
        self.chunks[chunk_id] = chunk
        return chunk_id, chunk

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
        os.close(handle)
        data = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        pinned = False
        if self.device_copies:
            pinned = torch.cuda.cudart().cudaHostRegister(data.data_ptr(), size, 0) == 0
        return _Chunk(path, data, pinned)

    def _finish_current(self) -> None:
        current, self.current = self.current, None
        if current is not None:
            self._retire_if_done(current)

    def release(self, pieces: list[Piece]) -> None:
        """These blocks' rows are handed over or dropped; chunks left with none are retired."""
        for chunk_id, _, _ in pieces:
            self.chunks[chunk_id].live -= 1
        for chunk_id in {chunk_id for chunk_id, _, _ in pieces}:
            self._retire_if_done(chunk_id)

    def _retire_if_done(self, chunk_id: int) -> None:
        chunk = self.chunks.get(chunk_id)
        if chunk is None or chunk.live > 0 or chunk_id == self.current:
            return
        del self.chunks[chunk_id]
        self._let_go(chunk)
        if chunk.path is not None:
            self.retired.append(chunk.path)

    def _let_go(self, chunk: _Chunk) -> None:
        if chunk.pinned:
            torch.cuda.cudart().cudaHostUnregister(chunk.data.data_ptr())
        chunk.data = None  # the worker's mapping goes with its last view

    def handover(self, pieces: dict[str, list[list[Piece]]], rows: dict[str, tuple[list[int], str]]) -> dict[str, Any]:
        """What the client needs to map ``pieces`` (value key -> per request, its pieces).

        Call after the copies into these pieces are complete. Returns plain
        data (vLLM's RPC encoding sends it as is): ``{"rows": {key: (row
        shape, dtype name)}, "pieces": {key: [[(file or None, byte offset,
        rows), ...] per request]}, "inline": bytes or None, "retired": [files]}``.
        Pieces in process memory are copied into ``inline`` (a ``torch.save``
        of ``{key: tensor}``; their byte offset is then a row offset into it).
        """
        inline: dict[str, list[torch.Tensor]] = {}
        sent: dict[str, list[list[tuple[str | None, int, int]]]] = {}
        for key, requests in pieces.items():
            shape, dtype = rows[key]
            row_bytes = torch.Size(shape).numel() * getattr(torch, dtype).itemsize
            sent[key] = []
            for request in requests:
                where = []
                for chunk_id, offset, count in request:
                    chunk = self.chunks[chunk_id]
                    if chunk.path is not None:
                        where.append((chunk.path, offset, count))
                        continue
                    done = sum(len(part) for part in inline.get(key, ()))
                    block = chunk.data[offset : offset + count * row_bytes].view(getattr(torch, dtype))
                    inline.setdefault(key, []).append(block.view(count, *shape).clone())
                    where.append((None, done, count))
                sent[key].append(where)
        packed = None
        if inline:
            buffer = io.BytesIO()
            torch.save({key: torch.cat(parts) for key, parts in inline.items()}, buffer)
            packed = buffer.getvalue()
        for requests in pieces.values():
            for request in requests:
                self.release(request)
        retired, self.retired = self.retired, []
        return {"rows": rows, "pieces": sent, "inline": packed, "retired": retired}

    def close(self) -> None:
        """Let every chunk go and remove the files no client was told of."""
        for chunk in self.chunks.values():
            self._let_go(chunk)
            if chunk.path is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(chunk.path)
        self.chunks.clear()
        self.current = None
        for path in self.retired:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self.retired.clear()


def received(handed: dict[str, Any]) -> dict[str, list[torch.Tensor]]:
    """Client side: each request's rows (``[rows, *row shape]``), per value key, from `Arena.handover`.

    Files are mapped privately, then the retired ones unlinked.

    Raises:
        RuntimeError: a file is not on this host (an engine on another machine).
    """
    inline = torch.load(io.BytesIO(handed["inline"]), weights_only=True) if handed["inline"] else {}
    maps: dict[str, torch.Tensor] = {}

    def mapped(path: str) -> torch.Tensor:
        if path not in maps:
            try:
                maps[path] = torch.from_file(path, shared=False, size=os.path.getsize(path), dtype=torch.uint8)
            except (FileNotFoundError, RuntimeError) as error:
                raise RuntimeError(f"the engine left its values at {path}, which this host does not have") from error
        return maps[path]

    try:
        out: dict[str, list[torch.Tensor]] = {}
        for key, requests in handed["pieces"].items():
            shape, dtype = handed["rows"][key]
            dtype = getattr(torch, dtype)
            row_bytes = torch.Size(shape).numel() * dtype.itemsize
            out[key] = []
            for where in requests:
                parts = []
                for path, offset, count in where:
                    if path is None:
                        parts.append(inline[key][offset : offset + count])
                    else:
                        block = mapped(path)[offset : offset + count * row_bytes]
                        parts.append(block.view(dtype).view(count, *shape))
                out[key].append(parts[0] if len(parts) == 1 else torch.cat(parts))
        return out
    finally:
        for path in handed["retired"]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
