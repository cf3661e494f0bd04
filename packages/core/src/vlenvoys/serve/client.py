"""A served capture's values in the HTTP client: decoded from the response, or fetched (`vlenvoys.capturing`'s).

What the server answers is `vlenvoys.serve.capture`'s; this is what a client
of it runs (in any process, with no engine): `decode` an inline entry, `fetch`
(or `fetch_async`) a response's values whichever way they came.

A fetched body is read into one buffer and its tensors view it. A client
that can read the server's files asks for each capture's file instead
(``local=1``), maps it and removes it: the values then cross no socket and are
copied by neither side. It knows it can by the server's beacon
(`vlenvoys.serve.capture.Beacon`), which each held capture's entry names: it
opens that file and finds the token the entry says, or fetches the bytes (an
address of the server's is no proof: a tunnel's or a port mapping's is
loopback on another host). It opens only files named as that server's
capture files directly under `HELD_FOLDER`, not through a link, owned by the
beacon's owner, and removes only those.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import stat
import struct
import weakref
from typing import Any, NamedTuple

import torch

from .capture import BEACON_FILE, CAPTURE_FILE, DTYPES, HELD_FOLDER, CaptureGone
from .fields import CAPTURES_PATH, FETCH_TOGETHER

__all__ = ["NotLocal", "decode", "fetch", "fetch_async"]


def decode(entry: dict) -> torch.Tensor:
    """One entry of a response's ``capture`` as a tensor of its ``shape`` (``[layers, positions, *row]``) and ``dtype``.

    Raises:
        KeyError: not an entry of a response's ``capture``.
        ValueError: ``data`` of another size than ``shape`` and ``dtype`` give.
    """
    data = bytearray(base64.b64decode(entry["data"]))
    dtype = DTYPES[entry["dtype"]]
    size = torch.Size(entry["shape"]).numel() * dtype.itemsize
    if len(data) != size:
        raise ValueError(f"capture {entry['value']!r}: {len(data)} bytes of data, {size} for {entry['shape']} {entry['dtype']}")
    return torch.frombuffer(data, dtype=dtype).view(entry["shape"]) if size else torch.empty(entry["shape"], dtype=dtype)


def fetch(base_url: str, answer: Any, *, api_key: str | None = None, timeout: float = 60.0,
          client: Any = None, local: bool | None = None) -> list[torch.Tensor]:
    """A response's captured values as tensors, one per ``capture`` entry in order, as `decode` gives them.

    Entries of ``"capture_transport": "fetch"`` are fetched from the server
    (``GET /v1/captures/{id}``, once per response: the server then forgets
    them); inline entries (with ``data``) are decoded here, no request made.

    Args:
        base_url: The server's address, ``http://host:port``, with or without
            the ``/v1`` the openai client's ``base_url`` ends in.
        answer: The response: the openai client's completion or chat
            completion, its JSON as a dict, or its ``capture`` list.
        api_key: The server's ``--api-key``, if it has one.
        timeout: Seconds for each fetch (httpx's timeout).
        client: An ``httpx.Client`` to fetch with (kept open); default one of its own.
        local: Whether to ask for each capture's file, under ``/dev/shm``,
            which is mapped here (no copy of the values through HTTP) and
            removed. Default: where this client can read the server's files,
            which it checks first (the server's beacon, named by the entries)
            and remembers per server; ``True`` checks the same and raises where
            it cannot (nothing fetched); ``False`` fetches the bytes. A server
            that refuses ``local=1`` (a 400: not a loopback client) is asked
            again without it.

    Returns:
        Each entry's values, ``[layers, positions, *row]`` of its ``shape``, in
        its ``dtype`` (``torch.float32``, ``bfloat16`` or ``float16``), in the
        model's own units (no scaling).

    Raises:
        CaptureGone: the server holds no such capture (a 404: fetched already,
            expired after ``--capture-ttl``, dropped for newer ones beyond
            ``--capture-held-bytes``, or unknown), with its reason; or its file
            handed over was removed before it was opened (``--capture-ttl``).
        NotLocal: ``local=True`` where this client cannot read the server's
            files (nothing was fetched); or a file handed over that is not the
            server's capture file (left alone).
        httpx.HTTPStatusError: another refusal (a 401 for a wrong ``api_key``).
        httpx.HTTPError: the server could not be reached.
        KeyError: ``answer`` has no ``capture`` list, or an entry lacks a key.
        ValueError: values of another shape or dtype than the entry says.
    """
    import contextlib

    import httpx

    entries = _entries_of(answer)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    here = _here(entries, local)
    got = {}
    with contextlib.nullcontext(client) if client is not None else httpx.Client(timeout=timeout) as http:
        here = _unrefused(http, _root(base_url), here)
        for url in _urls(entries):
            while True:
                params = {"local": "1"} if here is not None else {}
                with http.stream("GET", _root(base_url) + url, params=params, headers=headers) as response:
                    if response.status_code == 400 and here is not None:  # refused before any capture was taken
                        response.read()
                        here = _refused(http, _root(base_url), here)
                        continue
                    if response.status_code != 200:
                        response.read()
                        _body(response)
                    name = url.rsplit("/", 1)[-1]
                    got[url] = _held(_captures(_filled(response, response.iter_bytes()), [name], False)[name], here)
                break
    return _tensors(entries, got)


async def fetch_async(base_url: str, answer: Any, *, api_key: str | None = None, timeout: float = 60.0,
                      client: Any = None, local: bool | None = None) -> list[torch.Tensor]:
    """`fetch` for asyncio: the same arguments, results and errors, ``client`` an ``httpx.AsyncClient``.

    Calls that share a ``client`` are fetched together: the captures asked
    for while a fetch is on its way go in the next one
    (``GET /v1/captures?ids=...``, up to `FETCH_TOGETHER` a request). Each
    fetch is a round trip through the server's HTTP stack: measured on an H200
    (12d802a), 256 responses fetched one request each took longer than
    serving them.
    """
    import httpx

    entries = _entries_of(answer)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    urls = _urls(entries)
    local = _here(entries, local)
    if client is None:
        async with httpx.AsyncClient(timeout=timeout) as http:
            together = Together(http, _root(base_url), headers, local)
            files = await asyncio.gather(*(together.take(url.rsplit("/", 1)[-1]) for url in urls))
    else:
        together = _together(client, _root(base_url), headers, _unrefused(client, _root(base_url), local))
        files = await asyncio.gather(*(together.take(url.rsplit("/", 1)[-1]) for url in urls))
    return _tensors(entries, dict(zip(urls, files, strict=True)))


class Together:
    """The fetches of one ``httpx.AsyncClient`` from one server, gathered: a capture asked for while the
    client's fetches are on their way waits for the next one, which asks for every capture waiting then."""

    #: Fetches on their way at once.
    PARALLEL = 4

    def __init__(self, client: Any, root: str, headers: dict[str, str], local: Here | None = None) -> None:
        self.client, self.root, self.headers, self.local = client, root, headers, local
        #: capture id -> the future of its tensors, not asked for yet.
        self.waiting: dict[str, asyncio.Future] = {}
        self.sending = 0
        #: The `_send` tasks on their way, referenced until done (the event loop keeps only a weak reference).
        self.tasks: set[asyncio.Task] = set()

    async def take(self, name: str) -> dict[str, torch.Tensor]:
        """The tensors of capture ``name`` (``{value: tensor}``), fetched with whatever else is waiting."""
        future = self.waiting.get(name)
        if future is None:
            future = self.waiting[name] = asyncio.get_running_loop().create_future()
        if self.sending < self.PARALLEL:
            self.sending += 1
            task = asyncio.get_running_loop().create_task(self._send())
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        return await asyncio.shield(future)  # a caller that gives up leaves the others' fetch alone

    async def _send(self) -> None:
        try:
            while self.waiting:
                names = list(self.waiting)[:FETCH_TOGETHER]
                batch = {name: self.waiting.pop(name) for name in names}
                here = self.local
                try:
                    while True:
                        params = {"ids": ",".join(names), **({"local": "1"} if here is not None else {})}
                        async with self.client.stream("GET", f"{self.root}{CAPTURES_PATH}", params=params,
                                                      headers=self.headers) as response:
                            if response.status_code == 400 and here is not None:  # refused, nothing taken: again
                                await response.aread()
                                here = self.local = _refused(self.client, self.root, here)
                                continue
                            if response.status_code != 200:
                                await response.aread()
                                _body(response)
                            chunks = [chunk async for chunk in response.aiter_bytes()]
                        break
                    each = _captures(_filled(response, chunks), names, True)
                except Exception as error:  # every capture of this fetch hears of it
                    each = dict.fromkeys(names, error)
                for name, future in batch.items():
                    if future.done():
                        with contextlib.suppress(Exception):
                            _held(each[name], here, drop=True)
                        continue
                    try:
                        future.set_result(_held(each[name], here))
                    except Exception as error:  # its caller's to hear (the file gone, unreadable)
                        future.set_exception(error)
        finally:
            self.sending -= 1


#: httpx.AsyncClient -> {(server, headers, local): its `Together`}; forgotten with the client.
_TOGETHER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _together(client: Any, root: str, headers: dict[str, str], local: Here | None = None) -> Together:
    servers = _TOGETHER.setdefault(client, {})
    key = (root, tuple(sorted(headers.items())), local)
    if key not in servers:
        servers[key] = Together(client, root, headers, local)
    return servers[key]


class NotLocal(OSError):
    """This client cannot read the server's files (``local=True``), or the server handed over a path that is not
    its capture file (left alone)."""


class Here(NamedTuple):
    """A server whose files this client can read, by its beacon (`vlenvoys.serve.capture.Beacon`)."""

    #: The beacon's path and token (as the entries name them).
    path: str
    token: str
    #: The server's name in its files' names (``serve-<hex>``), and its user id (the beacon's owner).
    owner: str
    uid: int


#: Each server's beacon read, (path, token) -> its `Here`, or why this client cannot read its files.
_BEACONS: dict[tuple[str, str], Here | str] = {}


def _here(entries: list[dict], local: bool | None) -> Here | None:
    """The server whose captures ``entries`` are, where this client reads its files and fetches with ``local=1``;
    None: fetch the bytes (``local=False``, no beacon named: captures held in memory, or a beacon not read).

    Raises:
        NotLocal: ``local=True`` and the beacon is not read here.
    """
    if local is False:
        return None
    beacon = next((entry["beacon"] for entry in entries if "data" not in entry and "beacon" in entry), None)
    if not isinstance(beacon, dict) or not isinstance(beacon.get("path"), str) or not isinstance(beacon.get("token"), str):
        return None  # nothing held in a file: bytes whatever local says
    key = (beacon["path"], beacon["token"])
    if key not in _BEACONS:
        _BEACONS[key] = _read_beacon(*key)
    found = _BEACONS[key]
    if isinstance(found, Here):
        return found
    if local:
        raise NotLocal(f"local=True: this client cannot read the server's capture files: {found}; fetch with "
                       "local=None (the default) or False for the bytes")
    return None


def _read_beacon(path: str, token: str) -> Here | str:
    """The server of the beacon at ``path``, where it holds ``token``; else why not (a message)."""
    match = BEACON_FILE.match(os.path.basename(path))
    if os.path.dirname(path) != HELD_FOLDER or match is None:
        return f"its beacon {path!r} is not a server's beacon under {HELD_FOLDER}"
    try:
        handle = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as error:
        return f"its beacon {path} is not readable here ({error.strerror}: another host's /dev/shm, or another user's)"
    try:
        status = os.fstat(handle)
        read = os.read(handle, 256)
    except OSError as error:
        return f"its beacon {path} is not readable here ({error.strerror})"
    finally:
        os.close(handle)
    if not stat.S_ISREG(status.st_mode) or read != token.encode():
        return f"the file at {path} is not the server's beacon (another token: another host's /dev/shm)"
    return Here(path, token, match.group(1), status.st_uid)


#: httpx client -> the (server address, beacon) pairs whose server refused it ``local=1``; forgotten with the client.
_REFUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _refused(client: Any, root: str, here: Here) -> None:
    """A server that refused ``local=1`` to ``client`` at ``root`` (a 400: it sees no loopback address; a port
    mapping's): remembered for that client and address, whose fetches of it are bytes from now on."""
    _REFUSED.setdefault(client, set()).add((root, here.path, here.token))
    return None


def _unrefused(client: Any, root: str, here: Here | None) -> Here | None:
    """``here``, or None where its server refused ``client`` at ``root`` a ``local=1`` already."""
    if here is None or (root, here.path, here.token) in _REFUSED.get(client, ()):
        return None
    return here


def _filled(response: Any, chunks: Any) -> bytearray:
    """A response's body, read into one bytearray (its size known from its header: no join, no copy after)."""
    length = response.headers.get("content-length")
    if length is None or "content-encoding" in response.headers:
        return bytearray(b"".join(chunks))
    body, at = bytearray(int(length)), 0
    for chunk in chunks:
        body[at : at + len(chunk)] = chunk
        at += len(chunk)
    if at != len(body):
        raise ValueError(f"a capture's fetch: {at} bytes of the {len(body)} its content-length says")
    return body


#: safetensors' dtype names, of the dtypes a capture may be in.
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _parsed(buffer: Any) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """A safetensors file in ``buffer`` (writable: a bytearray, or a private mapping) as its metadata and
    tensors, each viewing ``buffer`` (no copy) where it is aligned to its dtype's size, copied where not."""
    (size,) = struct.unpack("<Q", buffer[:8])
    header = json.loads(bytes(buffer[8 : 8 + size]))
    metadata = header.pop("__metadata__", None) or {}
    start, tensors = 8 + size, {}
    for name, entry in header.items():
        dtype = _DTYPES[entry["dtype"]]
        begin, end = (start + at for at in entry["data_offsets"])
        count = (end - begin) // dtype.itemsize
        if count == 0:
            tensors[name] = torch.empty(entry["shape"], dtype=dtype)
        elif begin % dtype.itemsize:
            tensors[name] = torch.frombuffer(bytearray(buffer[begin:end]), dtype=dtype).view(entry["shape"])
        else:
            tensors[name] = torch.frombuffer(buffer, dtype=dtype, count=count, offset=begin).view(entry["shape"])
    return metadata, tensors


def _captures(body: bytearray, names: list[str], prefixed: bool) -> dict[str, Any]:
    """A fetch's answer split: each id's tensors (``{value: tensor}``), the path of its file to map (a ``str``,
    ``local=1``), or why it has none (`CaptureGone`). ``prefixed``: tensors named ``{id}/{value}`` (several ids)."""
    metadata, tensors = _parsed(body)
    files: dict[str, Any] = {name: {} for name in names}
    for key, tensor in tensors.items():
        name, _, value = key.partition("/") if prefixed else (names[0], "", key)
        files[name][value] = tensor
    for name, why in json.loads(metadata.get("gone", "{}")).items():
        files[name] = CaptureGone(why)
    files.update(json.loads(metadata.get("files", "{}")))
    return files


def _held(each: Any, here: Here | None, drop: bool = False) -> dict[str, torch.Tensor]:
    """One capture of `_captures`: its tensors; mapped from its file (which is removed); or its error raised.
    ``drop``: nobody wants it: its file is removed unread. ``here``: the server whose file it is."""
    if isinstance(each, BaseException):
        if drop:
            return {}
        raise each
    if not isinstance(each, str):
        return each
    import mmap

    handle = _opened(each, here)  # raises, the file left alone, where it is not the server's capture file
    try:
        if drop:
            return {}
        mapping = mmap.mmap(handle, 0, access=mmap.ACCESS_COPY)  # private: writes stay here
        return _parsed(mapping)[1]
    finally:
        os.close(handle)
        with contextlib.suppress(OSError):
            os.unlink(each)


def _opened(path: str, here: Here | None) -> int:
    """The file at ``path``, opened, where it is a capture file of the server ``here`` names: directly under
    `HELD_FOLDER`, named as its capture files, no link, a plain file of its owner.

    Raises:
        NotLocal: it is not (the path is left alone).
        CaptureGone: no such file (removed ``--capture-ttl`` seconds after it was handed over).
    """
    match = CAPTURE_FILE.match(os.path.basename(path))
    if here is None or os.path.dirname(path) != HELD_FOLDER or match is None or match.group(1) != here.owner:
        raise NotLocal(f"the server handed over {path!r}, which is not one of its capture files under {HELD_FOLDER} "
                       "(left alone)")
    try:
        handle = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise CaptureGone(
            f"the server handed over the capture's file {path}, which was removed (--capture-ttl seconds after it "
            "was handed over) before it was read"
        ) from None
    except OSError as error:
        raise NotLocal(f"the server handed over {path}, which is not readable here ({error.strerror}; left alone)") from None
    status = os.fstat(handle)
    if not stat.S_ISREG(status.st_mode) or status.st_uid != here.uid:
        os.close(handle)
        raise NotLocal(f"the server handed over {path}, which is not a file of the server's user (left alone)")
    return handle


def _entries_of(answer: Any) -> list[dict]:
    if isinstance(answer, list):
        return answer
    extra = answer if isinstance(answer, dict) else getattr(answer, "model_extra", None) or {}  # the openai client's
    entries = extra.get("capture")
    if not isinstance(entries, list):
        raise KeyError("capture: the response has no 'capture' list (did its request carry a 'capture' field?)")
    return entries


def _urls(entries: list[dict]) -> list[str]:
    """Each held capture's path, once (a response's entries share one)."""
    return list(dict.fromkeys(entry["url"] for entry in entries if "data" not in entry))


def _root(base_url: str) -> str:
    return base_url.rstrip("/").removesuffix("/v1")


def _body(response: Any) -> bytes:
    if response.status_code == 404:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text
        raise CaptureGone(message)
    if response.status_code == 401:
        import httpx

        given = "the api_key given was refused" if "authorization" in response.request.headers else "no api_key was given"
        raise httpx.HTTPStatusError(
            f"401 Unauthorized fetching {response.request.url}: the server was started with --api-key and {given}; "
            "pass its key as fetch(..., api_key=KEY)", request=response.request, response=response,
        )
    response.raise_for_status()
    return response.content


def _tensors(entries: list[dict], files: dict[str, dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    out = []
    for entry in entries:
        if "data" in entry:
            out.append(decode(entry))
            continue
        tensor = files[entry["url"]].get(entry["value"])
        dtype = DTYPES[entry["dtype"]]
        if tensor is None or tensor.dtype != dtype or list(tensor.shape) != list(entry["shape"]):
            found = "nothing" if tensor is None else f"{tensor.dtype} {list(tensor.shape)}"
            raise ValueError(
                f"capture {entry['value']!r}: fetched {found}, the entry says {entry['dtype']} {entry['shape']}"
            )
        out.append(tensor)
    return out
