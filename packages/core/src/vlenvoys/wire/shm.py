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

This module holds what the worker's writer (`vlenvoys.worker.arena.Arena`) and
the client's reader (`vlenvoys.engine.handover`) agree on: where the files lie,
how they are named and aligned, and `sweep`, which removes an exited worker's.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import time
import uuid
from collections.abc import Iterator, Sequence

import torch

__all__ = [
    "ALIGN", "CHUNK_FILE", "ENGINE_VARIABLE", "LOCK_FILE", "SAVES_HEADER", "SHARED_MEMORY", "engine_named", "row_bytes",
    "sweep", "worker_name",
]

#: A memory file system on the same host.
SHARED_MEMORY = "/dev/shm"
#: Every block of rows starts at a multiple of this many bytes (any dtype's alignment).
ALIGN = 64
#: A trace's saves in a chunk start with this many bytes: a flag (the first byte), then padding to `ALIGN`.
SAVES_HEADER = ALIGN
#: A worker arena's lock file, ``vlenvoys-rows-<token>.lock``; its chunks are ``vlenvoys-rows-<token>-*.rows``.
#: A ``vlenvoys serve``'s, ``vlenvoys-serve-<token>.lock`` (its beacon, `vlenvoys.serve.capture.Beacon`); its
#: held captures are ``vlenvoys-serve-<token>-*.safetensors``.
LOCK_FILE = re.compile(r"^vlenvoys-((?:rows|serve)-[0-9a-f]+)\.lock$")
#: A chunk file of a worker arena, or a capture file of a server (`sweep` removes those whose owner holds no lock
#: file).
CHUNK_FILE = re.compile(r"^vlenvoys-((?:rows|serve)-[0-9a-f]+)-.*\.(?:rows|safetensors)$")


def row_bytes(shape: Sequence[int], dtype: str | torch.dtype) -> int:
    """Bytes of one row of ``shape`` (the row's own shape) in ``dtype`` (or the dtype it names: ``"bfloat16"``)."""
    return torch.Size(shape).numel() * (getattr(torch, dtype) if isinstance(dtype, str) else dtype).itemsize


#: Set by a client while it starts an engine (`engine_named`): the engine's processes inherit it, and
#: each worker's arena name starts with it, so the client's `sweep` can wait for that engine's arenas.
ENGINE_VARIABLE = "VLENVOYS_ENGINE"


def worker_name() -> str:
    """A name for a worker's arena: ``rows-<hex token>``, unique on the host, led by its engine's name where it
    has one."""
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
    while engine is not None and any(owner.startswith(f"rows-{engine}") for owner in held) and (
        time.monotonic() < deadline
    ):
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
        match = LOCK_FILE.match(entry)
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
        [name for name in entries if (match := CHUNK_FILE.match(name)) and match.group(1) not in locked]
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
