"""Capture in ``vlenvoys serve``: standard values of a request's run, returned in its response.

A completion or chat completion may carry a top-level ``capture`` field::

    "capture": [{"value": "layer_output", "layers": [0, 2], "positions": "prompt", "dtype": "float32"}]

and its (non-streamed) response gets a top-level ``capture`` list, one entry
per requested one, in the same order::

    {"value": "layer_output", "layers": [0, 2], "positions": [0, 1, ...], "prompt_tokens": 7,
     "generated_rows": 0, "dtype": "float32", "shape": [2, 7, 128], "data": "<base64>"}

``data`` is the base64 of the values' bytes in C order, ``shape`` ``[layers,
positions, *row]``, where a row is the value's layout less its batch and
token axes (``[hidden_size]`` for the residual stream, ``[heads, head_dim]``
for queries, keys and head outputs, ``[intermediate_size]`` for neurons). In
Python: ``torch.frombuffer(bytearray(base64.b64decode(data)),
dtype=torch.float32).view(shape)``, which `decode` does for any of the dtypes;
numpy reads float32 and float16 the same way (``numpy.frombuffer(...).reshape(shape)``).

A request chooses how its values come back with a top-level
``capture_transport``: ``"inline"`` (the default, also for ``null``) as
above, or ``"fetch"``, binary, which spares both sides base64 and JSON of
the values: each entry then carries no ``data`` but the capture's ``id`` and
``url``, ``"/v1/captures/{id}"``, one for all entries of a response::

    {"value": "layer_output", ..., "dtype": "float32", "shape": [2, 7, 128],
     "id": "5f0c...", "url": "/v1/captures/5f0c..."}

``GET`` of that url on the same server (behind ``--api-key``, as every
``/v1`` path) answers the values as a safetensors file
(``application/octet-stream``), one tensor per entry, named by its
``value``, of the entry's ``shape`` and ``dtype``, and forgets them: a
capture is served once. The server holds each capture until its fetch, for
``vlenvoys serve --capture-ttl`` seconds at most (`HELD_SECONDS` by default),
and ``--capture-held-bytes`` of values in all (`HELD_BYTES`): a new capture
drops the oldest unfetched ones it needs room for; one larger than that alone
is a 400 (its completion not returned). A fetch of a capture not held is a
404 that says why: fetched already, expired, dropped for room, or never held
here. ``GET /v1/captures?ids=ID,ID,...`` (up to `FETCH_TOGETHER` ids) fetches
several in one safetensors file: each tensor named ``{id}/{value}``, and the
file's metadata ``gone`` a JSON object of the ids not held and why.

A held capture lies in a file of its own under `HELD_FOLDER` (``/dev/shm``,
where there is room; else in the server's memory), laid out as the
safetensors file a fetch answers: its values are copied once, from the
engine's memory into that file, and a fetch sends its bytes as they lie. A
client that can read the server's files may fetch with ``local=1`` (either
form; from a loopback address, else a 400): the server then sends no values
but names each capture's file in the answer's metadata ``files`` (a JSON
object of id -> path), and the file is the client's: it maps it (no copy of
the values) and removes it. A loopback address is no proof that the client
reads the server's ``/dev/shm`` (an SSH tunnel, ``kubectl port-forward``), so
the client proves it before it asks: the server makes a `Beacon` there when it
starts (mode 0600, a random token, removed when it exits), and each entry of a
capture held in a file names it::

    "beacon": {"path": "/dev/shm/vlenvoys-serve-<16 hex>.lock", "token": "<32 hex>"}

A client that opens that path and reads that token reads the server's files
(the same host's ``/dev/shm``, the server's user or root); any other fetches
the bytes. It opens only the server's own capture files (`CAPTURE_FILE`,
directly in the folder, no link, of the beacon's owner), and removes only
those. A file is removed with its capture when it expires or is dropped
unfetched; a file handed over counts against ``--capture-held-bytes`` until
its client removes it, and one its client did not remove is removed
``--capture-ttl`` seconds after, on a timer (and every one left when the
server exits). The beacon is the server's lock file as a worker arena's is
(`vlenvoys.wire.shm`), and its capture files are named after it, so a server
killed before it could clean up leaves them only until the next `sweep`.
In Python, `fetch` (`fetch_async` under asyncio, which gathers concurrent
fetches on one client into such requests) gives a response's values, fetched
or inline, as the tensors `decode` gives, with ``local=1`` where the beacon
reads (and again without it where the server answers a 400).
Any other ``capture_transport`` is a
400 before the request reaches the engine.

``positions`` counts the sequence as steering does: ``"prompt"`` (default; the
prefill's rows, positions 0 to ``prompt_tokens - 1``), ``"generated"`` (the
decode steps' rows: generated token ``k``, counted from 0, sits at
``prompt_tokens + k`` and has a row once it is fed back, so the last token
sampled has none: ``generated_rows`` is the completion's tokens less one),
``"all"`` (both), ``"last"`` (the prompt's last position, whose output chose
the first token), or a list of positions (negative ones count from the end of
the rows: prompt and generated). ``layers`` is a block index, a list of them
(negative ones count from the end), or ``"all"``. ``dtype``: ``float32``
(default), ``bfloat16`` or ``float16``, cast from the model's dtype. Each value
is read as `vlenvoys.collect` reads it, one hook per module per step over the
whole batch, so it equals a trace's read of the same prompt (bit-identical on
the CPU engine), and a decode step's row a trace's read at that step; a
request that is also steered captures its steered run (at a steered block,
``layer_output`` is the sum of vLLM's two stream halves the next block gets,
within float32 rounding of a trace's read). ``"capture": null`` or ``[]`` is a
request that captures nothing. Decode steps' rows
are served on an eager engine: a server replaying CUDA graphs of decode steps
(``--cuda-graphs``) runs no hooks there, and refuses ``"generated"`` and
``"all"`` (a list reads the prompt's rows there).

A request that asks for a value the model does not serve (by its family, or
not at a module boundary: attention patterns are recomputed per request), a
block that does not exist, streaming, several prompts or choices (``n``), or
beam search is a 400 before it reaches the engine. A position outside the
rows, or more than `MAX_BYTES` of values, is known only once the request ran:
the response is then a 400 naming it (its completion is not returned). The
request runs with a cache salt of its own, so no cached prefix skips the rows
it reads.
"""

from __future__ import annotations

import asyncio
import base64
import fcntl
import json
import mmap
import os
import re
import secrets
import struct
import time
import uuid
import weakref
from collections import OrderedDict
from typing import Any

import numpy
import torch

from ..collect.rows import new_name, received
from ..values.names import ORDER, OWNERS
from ..wire.requests import COLLECT_GENERATED_KEY, COLLECT_ID_KEY, COLLECT_KEY, STEER_KEY
from ..wire.steering import MAX_POSITIONS, salt_of
from .fields import CAPTURE_POSITIONS as POSITIONS
from .fields import CAPTURES_PATH, GENERATING, TRANSPORTS, SteeringError, field_entries

__all__ = [
    "BEACON_FILE", "CAPTURE_FILE", "DTYPES", "HELD_BYTES", "HELD_SECONDS", "MAX_BYTES", "PENDING", "TRANSPORTS",
    "Beacon", "CaptureError", "CaptureGone", "Captures", "HELD_FOLDER", "Held", "Image", "as_file", "capture_spec",
    "fetch_body", "transport_of",
]

#: An entry's keys.
ENTRY_KEYS = frozenset({"value", "layers", "positions", "dtype"})
#: The dtypes values are returned in.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: The most values a response carries, in bytes before base64 (a third more after).
MAX_BYTES = 64 << 20
#: The most entries a request's capture may have.
MAX_ENTRIES = 16
#: Collectors (one per distinct set of reads) kept on the engine; the least recently used idle one goes beyond.
MAX_COLLECTORS = 32
#: Capture ids of requests on their way to the engine from this server (`guard` lets only these name a collector).
PENDING: set[str] = set()
#: Seconds a capture is held for its fetch, by default (``vlenvoys serve --capture-ttl``).
HELD_SECONDS = 300.0
#: The most bytes of values held for fetching, by default (``--capture-held-bytes``); beyond, the oldest go first.
HELD_BYTES = 2 << 30
#: Ids of captures gone (fetched, expired, dropped) remembered with why, so a late fetch's 404 can say.
GONE_REMEMBERED = 1 << 16
#: Where held captures lie as files (`Image`), for a client on this host to map (a fetch with ``local=1``).
HELD_FOLDER = "/dev/shm"
#: A server's beacon under `HELD_FOLDER` (`Beacon`), also its lock file: ``vlenvoys-serve-<16 hex>.lock`` (a worker
#: arena's lock file's form, which `vlenvoys.wire.shm.sweep` knows: a dead server's files are swept).
BEACON_FILE = re.compile(r"^vlenvoys-(serve-[0-9a-f]{16})\.lock$")
#: A held capture's file under `HELD_FOLDER`: ``vlenvoys-serve-<its server's 16 hex>-<32 hex>.safetensors``.
CAPTURE_FILE = re.compile(r"^vlenvoys-(serve-[0-9a-f]{16})-[0-9a-f]{32}\.safetensors$")
#: safetensors' names of the dtypes values are returned in.
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class CaptureGone(LookupError):
    """A held capture that is not there (an HTTP 404 with this message): fetched already, expired, dropped, unknown."""


def transport_of(field: Any) -> str:
    """A request's ``capture_transport``, checked: ``"inline"`` (also for ``null``) or ``"fetch"``.

    Raises:
        CaptureError: anything else.
    """
    if field is None:
        return "inline"
    if not isinstance(field, str) or field not in TRANSPORTS:
        raise CaptureError(f"capture_transport: expected {' or '.join(map(repr, TRANSPORTS))}, got {field!r}")
    return field


class Beacon:
    """A server's file under ``folder`` (`HELD_FOLDER`) that proves a client shares that folder with it.

    Made when the server starts (`Held`), mode 0600, holding a random
    ``token``, and removed when it exits; each entry of a held capture names
    it (``beacon``: its ``path`` and ``token``). A client that opens that path
    and reads that token sees the server's files (the same host's /dev/shm, and
    the server's user or root): only then does it ask for files (``local=1``).
    Its name is the server's ``owner`` name, which leads its capture files'
    (`CAPTURE_FILE`); it is locked (``flock``) for the server's life, as a
    worker arena's lock file is, so `vlenvoys.wire.shm.sweep` removes a dead
    (SIGKILLed) server's files.

    Raises:
        OSError: the file could not be made (no such folder, no room).
    """

    def __init__(self, folder: str = HELD_FOLDER) -> None:
        #: The server's name in its files' names, ``serve-<16 hex>``.
        self.owner = f"serve-{secrets.token_hex(8)}"
        self.folder = folder
        self.path = os.path.join(folder, f"vlenvoys-{self.owner}.lock")
        self.token = secrets.token_hex(16)
        handle = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(handle, self.token.encode())
        except OSError:
            os.close(handle)
            _remove(self.path)
            raise
        self._close = weakref.finalize(self, _let_go, handle, self.path)

    @property
    def prefix(self) -> str:
        """Where this server's capture files' paths start (a capture's 32 hex digits and ``.safetensors`` follow)."""
        return os.path.join(self.folder, f"vlenvoys-{self.owner}-")

    def close(self) -> None:
        """Remove the beacon (its lock let go after)."""
        self._close()


def _let_go(handle: int, path: str) -> None:
    _remove(path)  # while locked: no sweep takes the server's files before it is gone
    os.close(handle)


class Image:
    """A capture's values laid out as a safetensors file: in a file of its own under `HELD_FOLDER`, mapped,
    where there is room; else in this process's memory.

    ``layout``: each tensor's name -> (dtype, shape). `tensors` views the
    image's data (the server writes the values straight into them, no copy
    after); `data` is its bytes after the header, `view` the whole file's.
    Laid out once, a capture is answered without serializing it again: a
    fetch sends these bytes as they lie (`fetch_body`), and a fetch with
    ``local=1`` hands the file itself to the client (`handed`), which maps it
    and removes it. The file is removed when the image is `discard`-ed or
    garbage-collected (or the server exits), unless it was handed over.

    Args:
        layout: The tensors, in order (larger dtypes first, so each is aligned to its dtype's size).
        prefix: Where the file's path starts (`Beacon.prefix`); None, or no room there: in memory.
    """

    def __init__(self, layout: dict[str, tuple[torch.dtype, tuple[int, ...]]], prefix: str | None = None) -> None:
        names = sorted(layout, key=lambda name: -layout[name][0].itemsize)  # stable: in order within a dtype size
        #: Each tensor's entry in the file's header, offsets counted from the end of the header.
        self.header: dict[str, dict] = {}
        at = 0
        for name in names:
            dtype, shape = layout[name]
            size = torch.Size(shape).numel() * dtype.itemsize
            self.header[name] = {
                "dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [at, at + size]
            }
            at += size
        text = _header_text(self.header)
        self.start = 8 + len(text)
        #: Bytes of values (the file's, less its header).
        self.size = at
        self.path, self.buffer = _backing(self.start + at, prefix)
        self._removal = None if self.path is None else weakref.finalize(self, _remove, self.path)
        self.view = memoryview(self.buffer)
        self.view[: self.start] = struct.pack("<Q", len(text)) + text
        self.data = self.view[self.start :]
        #: Each tensor, viewing the image's data.
        self.tensors = {
            name: _viewed(self.buffer, *layout[name], self.start + self.header[name]["data_offsets"][0])
            for name in names
        }

    def handed(self) -> str | None:
        """The image's file, now the caller's to remove (None where the image is in memory)."""
        if self._removal is not None:
            self._removal.detach()
        return self.path

    def discard(self) -> None:
        """Remove the image's file now (its mappings stay readable while they live)."""
        if self._removal is not None:
            self._removal()


def _header_text(header: dict) -> bytes:
    """A safetensors header's JSON, padded with spaces to a multiple of 8 bytes (so the data starts aligned)."""
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)


def _backing(size: int, prefix: str | None) -> tuple[str | None, Any]:
    """``size`` bytes to lay an image in: a new file whose path starts with ``prefix``, mapped, with its pages
    reserved (so no write into the mapping can fault for want of room); else, on any error, a bytearray."""
    if prefix is not None:
        path = f"{prefix}{uuid.uuid4().hex}.safetensors"
        try:
            handle = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            return None, bytearray(size)
        try:
            os.posix_fallocate(handle, 0, size)
            return path, mmap.mmap(handle, size)
        except OSError:
            _remove(path)
        finally:
            os.close(handle)
    return None, bytearray(size)


def _viewed(buffer: Any, dtype: torch.dtype, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    count = torch.Size(shape).numel()
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset).view(shape)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def fetch_body(images: dict[str, Image], metadata: dict[str, str] | None = None, prefixed: bool = True) -> list:
    """The parts of a safetensors file of ``images`` (id -> image), in order: a header, then each image's
    `Image.data` as it lies (memoryviews: no copy). Each tensor is named ``{id}/{name}``, or ``name`` where not
    ``prefixed`` (one image)."""
    header: dict[str, Any] = {} if metadata is None else {"__metadata__": metadata}
    at, parts = 0, []
    for name, image in images.items():
        for each, entry in image.header.items():
            begin, end = entry["data_offsets"]
            header[f"{name}/{each}" if prefixed else each] = {**entry, "data_offsets": [at + begin, at + end]}
        at += image.size
        parts.append(image.data)
    text = _header_text(header)
    return [struct.pack("<Q", len(text)) + text, *parts]


class Held:
    """Captures held for their one fetch, oldest first: each until fetched, ``seconds`` old, or pushed out by newer
    ones beyond ``most`` bytes of values.

    Each is an `Image` (a file under ``folder``, `HELD_FOLDER`, where there is
    room; the server's `Beacon` there names them): dropped, its file goes with
    it. A file handed to a client on this host (`hand_over`) is the client's
    to remove, and counts against ``most`` until it is gone; one still there
    ``seconds`` after is removed here (a client that died before it could), as
    is every one still there when the server exits. Expiry runs on a timer of
    the running event loop (armed by `put` and `hand_over`), and on every
    `put` and `take`.
    """

    def __init__(self, seconds: float = HELD_SECONDS, most: int = HELD_BYTES, folder: str | None = HELD_FOLDER) -> None:
        self.seconds = seconds
        self.most = most
        self.held: OrderedDict[str, tuple[float, int, Image]] = OrderedDict()
        self.bytes = 0
        self.gone: OrderedDict[str, str] = OrderedDict()
        #: Files handed over -> (when they are removed if their client has not, their bytes of values).
        self.handed: OrderedDict[str, tuple[float, int]] = OrderedDict()
        #: Bytes of values in files handed over and not known to be removed.
        self.handed_bytes = 0
        self.timer: asyncio.TimerHandle | None = None
        self.timer_due = 0.0
        weakref.finalize(self, _remove_all, self.handed)
        try:
            self.beacon: Beacon | None = None if folder is None else Beacon(folder)
        except OSError:  # no such folder, no room: captures are held in memory, and sent
            self.beacon = None

    @property
    def prefix(self) -> str | None:
        """Where held captures' files' paths start (`Image`'s ``prefix``); None: in memory."""
        return None if self.beacon is None else self.beacon.prefix

    def put(self, image: Image) -> str:
        """Hold ``image`` under a new id, which it returns.

        Raises:
            CaptureError: the image alone is more than ``most`` bytes, or files handed over and not removed yet
                leave no room for it (it is discarded).
        """
        size = image.size
        if size > self.most:
            image.discard()
            raise CaptureError(
                f"capture: {_amount(size)} of values, beyond the {_amount(self.most)} this server holds "
                "for fetching (--capture-held-bytes); capture fewer layers or positions, or inline"
            )
        now = time.monotonic()
        self._expire(now)
        if self.bytes + self.handed_bytes + size > self.most:
            self._reclaim()
        while self.held and self.bytes + self.handed_bytes + size > self.most:
            self._drop(next(iter(self.held)), f"dropped unfetched to make room for newer captures: the server holds "
                       f"at most {self.most} bytes of them (--capture-held-bytes), the oldest go first")
        if self.bytes + self.handed_bytes + size > self.most:
            image.discard()
            raise CaptureError(
                f"capture: no room for {_amount(size)} of values: {_amount(self.handed_bytes)} of the "
                f"{_amount(self.most)} this server holds (--capture-held-bytes) lie in files handed to clients on "
                f"its host that they have not removed yet (removed {self.seconds:g} s after at most, --capture-ttl)"
            )
        name = uuid.uuid4().hex
        self.held[name] = (now + self.seconds, size, image)
        self.bytes += size
        self._arm()
        return name

    def take(self, name: str) -> Image:
        """The capture held as ``name``; held no longer (its file goes once the image is gone).

        Raises:
            CaptureGone: fetched already, expired, dropped for room, or never held here.
        """
        self._expire(time.monotonic())
        if name not in self.held:
            why = self.gone.get(name) or (
                f"never held here, or gone long ago (a capture is held until its one fetch, for {self.seconds:g} s "
                "at most)"
            )
            raise CaptureGone(f"capture {name!r}: {why}")
        image = self.held[name][2]
        self._drop(name, "fetched already: a capture is served once", discard=False)
        return image

    def hand_over(self, name: str) -> tuple[str | None, Image]:
        """`take`, with the capture's file (None where it is in memory) now the client's to map and remove; removed
        here ``seconds`` from now if it is still there, and counted against ``most`` until then."""
        image = self.take(name)
        path = image.handed()
        if path is not None:
            self.handed[path] = (time.monotonic() + self.seconds, image.size)
            self.handed_bytes += image.size
            self._arm()
        return path, image

    def close(self) -> None:
        """Remove every file held or handed over, and the beacon (the server exits)."""
        if self.timer is not None:
            self.timer.cancel()
        for name in list(self.held):
            self._drop(name, "the server stopped")
        _remove_all(self.handed)
        self.handed.clear()
        self.handed_bytes = 0
        if self.beacon is not None:
            self.beacon.close()

    def _arm(self) -> None:
        """Ring `_ring` at the next expiry, on the running event loop (none running: expiry waits for a call)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        due = [each[0] for each in (next(iter(self.held.values()), None), next(iter(self.handed.values()), None)) if each]
        if not due:
            return
        if self.timer is not None:
            if self.timer_due <= min(due):
                return
            self.timer.cancel()
        # A delay, not a time on the loop's clock (uvloop's is not time.monotonic(), which the deadlines are on).
        self.timer_due = min(due)
        self.timer = loop.call_later(max(0.0, self.timer_due - time.monotonic()) + 0.01, self._ring)

    def _ring(self) -> None:
        self.timer = None
        self._expire(time.monotonic())
        self._arm()

    def _expire(self, now: float) -> None:
        # Held in the order they came, all for the same seconds: the first is the first to expire.
        while self.held and next(iter(self.held.values()))[0] <= now:
            self._drop(next(iter(self.held)), f"expired: not fetched within {self.seconds:g} s (--capture-ttl)")
        while self.handed and next(iter(self.handed.values()))[0] <= now:
            path, (_, size) = self.handed.popitem(last=False)
            self.handed_bytes -= size
            _remove(path)

    def _reclaim(self) -> None:
        """Forget the files handed over that their clients removed (their bytes count no more)."""
        for path in [path for path in self.handed if not os.path.lexists(path)]:
            self.handed_bytes -= self.handed.pop(path)[1]

    def _drop(self, name: str, why: str, discard: bool = True) -> None:
        _, size, image = self.held.pop(name)
        if discard:
            image.discard()
        self.bytes -= size
        self.gone[name] = why
        while len(self.gone) > GONE_REMEMBERED:
            self.gone.popitem(last=False)


def _remove_all(paths: dict[str, Any]) -> None:
    for path in list(paths):
        _remove(path)


def _amount(size: int) -> str:
    """A size for a message: MiB from one MiB up, bytes below (where MiB would read "0.0")."""
    return f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size:,} bytes"


def as_file(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """``tensors`` as the bytes of a safetensors file (what a fetch of a capture answers), with ``metadata``."""
    from safetensors.torch import save

    return save(tensors, metadata)


class CaptureError(SteeringError):
    """A request's ``capture`` field the model cannot serve: an HTTP 400 with this message."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "capture")


def capture_spec(field: Any, num_layers: int) -> list[dict]:
    """A request's ``capture`` field, checked: each entry as ``{value, owner, layers, positions, dtype}``.

    ``layers`` are block indices in ``range(num_layers)``; ``positions`` is
    one of `POSITIONS` or a list of ints (checked against the rows later).

    Raises:
        CaptureError: an unknown value or key, a block that does not exist, a
            bad positions or dtype, one value in two entries, more than
            `MAX_ENTRIES` entries.
    """
    owners = OWNERS
    made, seen = [], set()
    for where, entry in field_entries(field, "capture", ENTRY_KEYS, MAX_ENTRIES, CaptureError):
        value = entry.get("value")
        if not isinstance(value, str) or value not in owners:
            raise CaptureError(f"{where}: unknown value {value!r}; the standard values are {', '.join(owners)}")
        if value in seen:
            raise CaptureError(f"{where}: {value!r} is captured by two entries (list its layers in one)")
        seen.add(value)
        layers = entry.get("layers")
        if layers == "all":
            layers = list(range(num_layers))
        elif isinstance(layers, int) and not isinstance(layers, bool):
            layers = [layers]
        if not isinstance(layers, list) or not layers or not all(
            isinstance(each, int) and not isinstance(each, bool) for each in layers
        ):
            raise CaptureError(f"{where}.layers: expected a block index, a non-empty list of them or \"all\", got {layers!r}")
        for layer in layers:
            if not -num_layers <= layer < num_layers:
                raise CaptureError(f"{where}.layers: block {layer} does not exist; the model has blocks 0 to {num_layers - 1}")
        layers = [layer % num_layers for layer in layers]
        if len(set(layers)) != len(layers):
            raise CaptureError(f"{where}.layers: a block is listed twice in {entry['layers']!r}")
        positions = entry.get("positions", "prompt")
        if isinstance(positions, list) and len(positions) > MAX_POSITIONS:
            raise CaptureError(f"{where}.positions: {len(positions)} positions, at most {MAX_POSITIONS} are served")
        if not (positions in POSITIONS or (isinstance(positions, list) and positions and all(
            isinstance(each, int) and not isinstance(each, bool) for each in positions
        ))):
            raise CaptureError(
                f"{where}.positions: expected {', '.join(map(repr, POSITIONS))} or a non-empty list of positions, got {positions!r}"
            )
        dtype = entry.get("dtype", "float32")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise CaptureError(f"{where}.dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
        made.append({"value": value, "owner": owners[value], "layers": layers, "positions": positions, "dtype": dtype})
    return made


def _reads(entries: list[dict]) -> tuple[tuple[int, str, str], ...]:
    """The entries' reads in forward order (by block, then as the block computes them), as `vlenvoys.collect` has them."""
    order = ORDER
    reads = {(layer, entry["owner"], entry["value"]) for entry in entries for layer in entry["layers"]}
    return tuple(sorted(reads, key=lambda read: (read[0], order[read[2]])))


def _one_request(body: dict, path: str) -> None:
    """Refuse what would make a capture's values ambiguous or missing: one prompt, one choice, whole responses."""
    if path not in GENERATING:
        raise CaptureError(f"capture is served on {' and '.join(GENERATING)}, not on {path}")
    if body.get("stream"):
        raise CaptureError("capture returns the values with the whole response: drop stream")
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1) or body.get("use_beam_search"):
        raise CaptureError("capture serves one choice a request: drop n, best_of and use_beam_search")
    prompt = body.get("prompt")
    several = isinstance(prompt, list) and prompt and not all(isinstance(each, int) for each in prompt) and len(prompt) > 1
    if several:
        raise CaptureError("capture serves one prompt a request: send the prompts as requests of their own")
    xargs = body.get("vllm_xargs")
    if xargs is not None and not isinstance(xargs, dict):
        raise CaptureError("vllm_xargs: expected an object")
    if isinstance(xargs, dict) and any(isinstance(key, str) and key.startswith("vlenvoys_collect") for key in xargs):
        raise CaptureError("vllm_xargs' vlenvoys_collect keys are set by the server; capture with the 'capture' field")


class _Collector:
    """A collector installed on the engine for one set of reads, and the requests waiting for its values."""

    def __init__(self, name: str, head_dims: dict[str, int | None]) -> None:
        self.name = name
        self.head_dims = head_dims
        self.users = 0
        #: capture id -> (future of its values, its entries, its completion's tokens or None: values not wanted)
        self.waiting: dict[str, tuple[asyncio.Future, list[dict], int | None]] = {}
        #: The task taking ``waiting``'s values off the engine, while there is one.
        self.taking: asyncio.Task | None = None


class Captures:
    """The server's side of capture: collectors on the engine by set of reads, and each request's values.

    Args:
        engine_client: vLLM's engine client in the API server (``app.state.engine_client``).
        num_layers: The model's block count.
        ranks: The engine's world size (capture serves one rank).
        graphs: Whether the engine replays CUDA graphs of decode steps (no hooks run there).
        held: Where values fetched later wait (``capture_transport: "fetch"``).
    """

    def __init__(self, engine_client: Any, num_layers: int, ranks: int, graphs: bool, held: Held | None = None) -> None:
        self.engine = engine_client
        self.num_layers = num_layers
        self.ranks = ranks
        self.graphs = graphs
        self.held = Held() if held is None else held
        self.collectors: OrderedDict[tuple, _Collector | str] = OrderedDict()
        self.starting = asyncio.Lock()

    async def admit(self, body: dict, path: str, transport: str = "inline") -> tuple[dict, Any]:
        """The body with its ``capture`` turned into ``vllm_xargs`` and a cache salt of its own, and the ticket
        `respond` takes its values by (and hands them over by ``transport``, one of `TRANSPORTS`).

        Raises:
            CaptureError: see `capture_spec` and the module's docstring.
        """
        _one_request(body, path)
        if self.ranks > 1:
            raise CaptureError(f"capture serves a one-rank engine; this one runs on {self.ranks} ranks")
        entries = capture_spec(body["capture"], self.num_layers)
        decoded = [entry["value"] for entry in entries if entry["positions"] in ("generated", "all")]
        if decoded and self.graphs:
            raise CaptureError(
                f"capture: {decoded[0]} at generated positions: this server replays CUDA graphs of decode steps, which "
                "run no hooks; capture the prompt's positions, or serve without --cuda-graphs"
            )
        generated = not self.graphs and any(entry["positions"] != "prompt" and entry["positions"] != "last" for entry in entries)
        reads = _reads(entries)
        collector = await self._collector(reads)
        ticket = uuid.uuid4().hex
        body = {key: value for key, value in body.items() if key != "capture"}
        xargs = body["vllm_xargs"] = {**(body.get("vllm_xargs") or {}), COLLECT_KEY: collector.name, COLLECT_ID_KEY: ticket}
        if generated:
            xargs[COLLECT_GENERATED_KEY] = True
        # A salt of its own, shared with no request (so no cached prefix skips the forward over rows it
        # reads), ending in its steering's where it is steered (`serving.guard` looks for that); vLLM
        # takes 128 characters at most, so the user's salt, needless now, is dropped.
        steered = xargs.get(STEER_KEY)
        body["cache_salt"] = f"capture-{ticket}" + (f"-{salt_of(steered)}" if isinstance(steered, str) else "")
        collector.users += 1
        PENDING.add(ticket)
        return body, (collector, ticket, entries, transport)

    async def _collector(self, reads: tuple) -> _Collector:
        async with self.starting:
            known = self.collectors.get(reads)
            if isinstance(known, str):
                raise CaptureError(known)
            if known is not None:
                self.collectors.move_to_end(reads)
                return known
            name = new_name()
            (answer, *_) = await self.engine.collective_rpc("vlenvoys_collect_start_checked", args=(name, list(reads)))
            if "refused" in answer:
                self.collectors[reads] = answer["refused"]
                raise CaptureError(answer["refused"])
            made = self.collectors[reads] = _Collector(name, answer["head_dims"])
            await self._evict()
            return made

    async def _evict(self) -> None:
        idle = [reads for reads, each in self.collectors.items() if isinstance(each, str) or each.users == 0]
        while len(self.collectors) > MAX_COLLECTORS and idle:
            gone = self.collectors.pop(idle.pop(0))
            if isinstance(gone, _Collector):
                await self.engine.collective_rpc("vlenvoys_collect_stop", args=(gone.name,))

    async def respond(self, ticket: Any, status: int, body: bytes) -> tuple[int, bytes]:
        """The response's status and body with the request's values added (or a 400 naming why it has none).

        Always takes the request's values off the engine, whatever the response: nothing is left behind.
        """
        collector, name, entries, transport = ticket
        answer = json.loads(body) if status == 200 else None
        completed = None if answer is None else (answer.get("usage") or {}).get("completion_tokens")
        try:
            values = await self._taken(collector, name, entries, answer is not None, completed, transport == "fetch")
        finally:
            collector.users -= 1
            PENDING.discard(name)
        if answer is None:
            return status, body
        if isinstance(values, str):
            return 400, _error_body(values)
        values, image = values
        if image is not None:
            try:
                held = self.held.put(image)
            except CaptureError as error:
                return 400, _error_body(str(error))
            # A capture in a file names the server's beacon, by which a client proves it can map the file (`Beacon`).
            beacon = self.held.beacon if image.path is not None else None
            seen = {} if beacon is None else {"beacon": {"path": beacon.path, "token": beacon.token}}
            answer["capture"] = [
                {**entry, "id": held, "url": f"{CAPTURES_PATH}/{held}", **seen} for entry, _ in values
            ]
            return status, json.dumps(answer).encode()
        return status, await asyncio.to_thread(_inline, answer, values)

    async def _taken(
        self, collector: _Collector, name: str, entries: list[dict], wanted: bool, completed: int | None,
        held: bool = False,
    ) -> Any:
        """This request's values (`_values`, laid out in an `Image` where ``held``; None where not ``wanted``: its
        response is not a 200), taken off the engine together with every other request's that waits for the same
        collector's: one take for all of them, not one each. The engine forgets them either way."""
        future = asyncio.get_running_loop().create_future()
        collector.waiting[name] = (future, entries, wanted, completed, held)
        if collector.taking is None:
            # A task of its own, not this request's: a client that goes away cancels its request, not a take
            # that carries other requests' values.
            collector.taking = asyncio.create_task(self._take_waiting(collector))
        return await future

    async def _take_waiting(self, collector: _Collector) -> None:
        """Take the waiting requests' values, in batches, until none waits.

        Before, each request took its own, one at a time, each waiting for the engine between two steps; 256
        capturing requests then ran at 0.30 of plain serving (the gate at 5837283, one H200).
        """
        try:
            while collector.waiting:
                batch, collector.waiting = collector.waiting, {}
                try:
                    (packed, *_) = await self.engine.collective_rpc(
                        "vlenvoys_collect_take", args=(collector.name, list(batch))
                    )
                    # Copied out of the engine's memory off the event loop (the other requests' streams go on), and
                    # before the next take, which tells the worker it may reuse that memory.
                    results = await asyncio.to_thread(
                        _values_of_each, packed, batch, collector.head_dims, self.held.prefix
                    )
                except Exception as error:  # every request of the batch hears of it; the next batch tries again
                    for future, *_ in batch.values():
                        if not future.done():
                            future.set_exception(error)
                    continue
                for name, (future, *_) in batch.items():
                    if not future.done():  # not given up on (its client went away)
                        future.set_result(results[name])
                    elif isinstance(results[name], tuple) and results[name][1] is not None:
                        results[name][1].discard()  # its file, now, not whenever the collector frees it
        finally:
            collector.taking = None


def _values_of_each(packed: dict, batch: dict[str, tuple], head_dims: dict, prefix: str | None = None) -> dict[str, Any]:
    """`_values` of each request in ``batch`` (capture id -> (future, entries, wanted, completion's tokens or
    None, held)), None for those not wanted; held ones in files whose paths start with ``prefix``."""
    taken = received(packed, joined=False)  # `_values` copies each request's pieces into place: none joined first
    at = {name: index for index, name in enumerate(taken["order"])}
    # No torch.set_num_threads(1) here (it was, for these copies): that setting is the whole process's, not this
    # worker thread's, and two takes at once raced on it. The copies that matter are single-threaded by
    # construction instead (`_copy`: numpy, which runs no intra-op threads): two threads copied a few MiB into
    # new pages 2.5 to 3.5 times slower than one (benchmarks/results/serve-capture-cost-cpu.md).
    return {
        name: _values(taken, name, at.get(name), head_dims, entries, completed, held, prefix) if wanted else None
        for name, (_, entries, wanted, completed, held) in batch.items()
    }


def _inline(answer: dict, values: list[tuple[dict, torch.Tensor]]) -> bytes:
    """The response's JSON with each entry's values as base64 in ``data`` (run off the event loop: a response
    may carry up to `MAX_BYTES`)."""
    answer["capture"] = [
        {**entry, "data": base64.b64encode(tensor.view(torch.uint8).numpy().tobytes()).decode("ascii")}
        for entry, tensor in values
    ]
    return json.dumps(answer).encode()


def _values(
    taken: dict, name: str, at: int | None, head_dims: dict, entries: list[dict], completed: int | None,
    held: bool = False, prefix: str | None = None,
) -> tuple[list[tuple[dict, torch.Tensor]], Image | None] | str:
    """Each entry's response entry (less its values) and values, copied out of the engine's blocks, and the
    `Image` they lie in where ``held`` (None otherwise); or why the request has none.

    ``taken``: a take's answer, received (`vlenvoys.collect.rows.received`; each request's rows a tensor or a
    list of pieces); ``at``: the request's place in its ``order``. ``completed``: the response's generated
    tokens (its usage; None where it has none), of which all but the last were fed back.
    """
    if name in taken["missing"]:
        return f"capture: {taken['missing'][name]}"
    if at is None:  # the worker names every request it was asked for, in order or missing: this is a bug
        raise RuntimeError(f"the engine's take neither handed over nor named capture {name}")
    rows = {key: each[at] if isinstance(each[at], list) else [each[at]] for key, each in taken["values"].items()}
    prompt = taken["prompts"][name]
    chosen_of, fed_of, total = [], {}, 0
    for entry in entries:
        read = sum(piece.shape[0] for piece in rows[f"{entry['value']}.{entry['layers'][0]}"])
        # A step scheduled ahead of a stop the engine did not know yet (asynchronous scheduling) read a row past it.
        fed = read - prompt if completed is None else min(read - prompt, max(0, completed - 1))
        if entry["positions"] in ("generated", "all") and completed is not None and fed != completed - 1:
            return f"capture: {entry['value']}: {fed} of the {completed - 1} generated tokens fed back were read"
        length = prompt + fed
        chosen = {
            "prompt": list(range(prompt)), "generated": list(range(prompt, length)), "all": list(range(length)),
            "last": [prompt - 1],
        }.get(entry["positions"]) if isinstance(entry["positions"], str) else entry["positions"]
        outside = [position for position in chosen if not -length <= position < length]
        if outside:
            kept = f"the prompt's {prompt} and {fed} generated" if fed else f"the prompt's {prompt}"
            return f"capture: position {outside[0]} is outside the rows read ({kept}: 0 to {length - 1})"
        chosen = [position % length for position in chosen]
        chosen_of.append(chosen)
        fed_of[entry["value"]] = fed
        # Counted before anything is copied: a long list of positions must not build what is refused.
        row = rows[f"{entry['value']}.{entry['layers'][0]}"][0].shape[1:].numel()
        total += len(entry["layers"]) * len(chosen) * row * DTYPES[entry["dtype"]].itemsize
    if total > MAX_BYTES:
        return (f"capture: {_amount(total)} of values, beyond the {MAX_BYTES >> 20} MiB a response carries; "
                "capture fewer layers or positions")
    layout = {}
    for entry, chosen in zip(entries, chosen_of, strict=True):
        row = tuple(rows[f"{entry['value']}.{entry['layers'][0]}"][0].shape[1:])
        head_dim = head_dims.get(f"{entry['value']}.{entry['layers'][0]}")
        if head_dim is not None:
            row = (*row[:-1], row[-1] // head_dim, head_dim)
        layout[entry["value"]] = (DTYPES[entry["dtype"]], (len(entry["layers"]), len(chosen), *row))
    # Each entry's values are copied once, from the engine's blocks straight into their place (cast on the way):
    # the held capture's file, or the inline response's tensor.
    image = Image(layout, prefix) if held else None
    out = []
    for entry, chosen in zip(entries, chosen_of, strict=True):
        dtype, shape = layout[entry["value"]]
        values = image.tensors[entry["value"]] if image is not None else torch.empty(shape, dtype=dtype)
        span = _span(chosen)
        index = None if span is not None else torch.tensor(chosen, dtype=torch.long)
        for place, layer in enumerate(entry["layers"]):
            _copy_rows(values[place], rows[f"{entry['value']}.{layer}"], span, index)
        out.append(({
            "value": entry["value"], "layers": entry["layers"], "positions": chosen, "prompt_tokens": prompt,
            "generated_rows": fed_of[entry["value"]], "dtype": entry["dtype"], "shape": list(shape),
        }, values))
    return out, image


def _copy_rows(into: torch.Tensor, pieces: list[torch.Tensor], span: tuple[int, int] | None, index: Any) -> None:
    """Copy rows of ``pieces`` (one request's rows, in order) into ``into`` (``[positions, *row]``): those of
    ``span``, piece by piece as they lie, or, where the positions are no span, those ``index`` lists."""
    if span is None:
        at, places = 0, []
        for piece in pieces:  # each position's piece and row there
            places += [(piece, row) for row in range(piece.shape[0])]
            at += piece.shape[0]
        for place, position in enumerate(index.tolist()):
            piece, row = places[position]
            _copy(into[place], piece[row])
        return
    (begin, end), at = span, 0
    for piece in pieces:
        low, high = max(begin, at), min(end, at + piece.shape[0])
        if low < high:
            _copy(into[low - begin : high - begin], piece[low - at : high - at])
        at += piece.shape[0]


#: An integer dtype of each size, to copy any dtype's bits through numpy (which has no bfloat16).
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _copy(into: torch.Tensor, source: torch.Tensor) -> None:
    """``into[...] = source`` (reshaped to ``into``'s shape, cast to its dtype), in this thread alone where it
    can be: numpy copies one dtype's bits, and widens bfloat16 to float32 (its bits shifted 16 up, as torch
    does: the same bits); other casts are torch's (which may use its intra-op threads)."""
    source = source.reshape(into.shape)
    if into.dtype == source.dtype:
        bits = _BITS[into.dtype.itemsize]
        numpy.copyto(into.view(bits).numpy(), source.view(bits).numpy())
    elif (source.dtype, into.dtype) == (torch.bfloat16, torch.float32):
        wide = into.view(torch.int32).numpy().view(numpy.uint32)
        numpy.copyto(wide, source.view(torch.int16).numpy().view(numpy.uint16))
        numpy.left_shift(wide, 16, out=wide)
    else:
        into.copy_(source)


def _span(chosen: list[int]) -> tuple[int, int] | None:
    """``(first, last + 1)`` where ``chosen`` are consecutive ascending positions (a slice reads them), else None."""
    if chosen and chosen[-1] - chosen[0] == len(chosen) - 1 and all(
        later == earlier + 1 for earlier, later in zip(chosen, chosen[1:], strict=False)
    ):
        return chosen[0], chosen[-1] + 1
    return None


def _error_body(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "BadRequestError", "param": "capture", "code": 400}}).encode()
