"""A served capture's values in the HTTP client: decoded from the response, or fetched (`vlenvoys.capturing`'s).

What the server answers is `vlenvoys.serve.capture`'s; this is what a client
of it runs (in any process, with no engine): `decode` an inline entry, `fetch`
(or `fetch_async`) a response's values whichever way they came.

A fetched body is read into one buffer and its tensors view it; on the
server's host (by default where its address is a loopback one) a fetch asks
for each capture's file instead (``local=1``), maps it and removes it: the
values then cross no socket and are copied by neither side.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import struct
import weakref
from typing import Any

import torch

from .capture import DTYPES, CaptureGone
from .fields import CAPTURES_PATH, FETCH_TOGETHER

__all__ = ["decode", "fetch", "fetch_async"]


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
        local: Whether this client runs on the server's host: the server then
            hands over the file each capture lies in, under ``/dev/shm``, which
            is mapped here (no copy of the values through HTTP) and removed.
            Default: where ``base_url``'s host is a loopback address
            (``localhost``, ``127.0.0.1``, ``::1``).

    Returns:
        Each entry's values, ``[layers, positions, *row]`` of its ``shape``, in
        its ``dtype`` (``torch.float32``, ``bfloat16`` or ``float16``), in the
        model's own units (no scaling).

    Raises:
        CaptureGone: the server holds no such capture (a 404: fetched already,
            expired after ``--capture-ttl``, dropped for newer ones beyond
            ``--capture-held-bytes``, or unknown), with its reason; or, with
            ``local``, its file is not there (not on this host).
        httpx.HTTPStatusError: another refusal (a 401 for a wrong ``api_key``).
        httpx.HTTPError: the server could not be reached.
        KeyError: ``answer`` has no ``capture`` list, or an entry lacks a key.
        ValueError: values of another shape or dtype than the entry says.
    """
    import contextlib

    import httpx

    entries = _entries_of(answer)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    params = {"local": "1"} if _local(base_url, local) else {}
    got = {}
    with contextlib.nullcontext(client) if client is not None else httpx.Client(timeout=timeout) as http:
        for url in _urls(entries):
            with http.stream("GET", _root(base_url) + url, params=params, headers=headers) as response:
                if response.status_code != 200:
                    response.read()
                    _body(response)
                name = url.rsplit("/", 1)[-1]
                got[url] = _held(_captures(_filled(response, response.iter_bytes()), [name], False)[name])
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
    local = _local(base_url, local)
    if client is None:
        async with httpx.AsyncClient(timeout=timeout) as http:
            together = Together(http, _root(base_url), headers, local)
            files = await asyncio.gather(*(together.take(url.rsplit("/", 1)[-1]) for url in urls))
    else:
        together = _together(client, _root(base_url), headers, local)
        files = await asyncio.gather(*(together.take(url.rsplit("/", 1)[-1]) for url in urls))
    return _tensors(entries, dict(zip(urls, files, strict=True)))


class Together:
    """The fetches of one ``httpx.AsyncClient`` from one server, gathered: a capture asked for while the
    client's fetches are on their way waits for the next one, which asks for every capture waiting then."""

    #: Fetches on their way at once.
    PARALLEL = 4

    def __init__(self, client: Any, root: str, headers: dict[str, str], local: bool = False) -> None:
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
                params = {"ids": ",".join(names), **({"local": "1"} if self.local else {})}
                try:
                    async with self.client.stream("GET", f"{self.root}{CAPTURES_PATH}", params=params,
                                                  headers=self.headers) as response:
                        if response.status_code != 200:
                            await response.aread()
                            _body(response)
                        chunks = [chunk async for chunk in response.aiter_bytes()]
                    each = _captures(_filled(response, chunks), names, True)
                except Exception as error:  # every capture of this fetch hears of it
                    each = dict.fromkeys(names, error)
                for name, future in batch.items():
                    if future.done():
                        _held(each[name], drop=True)
                        continue
                    try:
                        future.set_result(_held(each[name]))
                    except Exception as error:  # its caller's to hear (the file gone, unreadable)
                        future.set_exception(error)
        finally:
            self.sending -= 1


#: httpx.AsyncClient -> {(server, headers, local): its `Together`}; forgotten with the client.
_TOGETHER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _together(client: Any, root: str, headers: dict[str, str], local: bool = False) -> Together:
    servers = _TOGETHER.setdefault(client, {})
    key = (root, tuple(sorted(headers.items())), local)
    if key not in servers:
        servers[key] = Together(client, root, headers, local)
    return servers[key]


def _local(base_url: str, local: bool | None) -> bool:
    """``local``, or by default whether ``base_url``'s host is a loopback address."""
    if local is not None:
        return local
    import ipaddress
    from urllib.parse import urlsplit

    host = urlsplit(base_url if "//" in base_url else f"//{base_url}").hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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


def _held(each: Any, drop: bool = False) -> dict[str, torch.Tensor]:
    """One capture of `_captures`: its tensors; mapped from its file (which is removed); or its error raised.
    ``drop``: nobody wants it: its file is removed unread."""
    if isinstance(each, BaseException):
        if drop:
            return {}
        raise each
    if not isinstance(each, str):
        return each
    import mmap

    try:
        if drop:
            return {}
        try:
            with open(each, "rb") as handle:
                mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)  # private: writes stay here
        except FileNotFoundError:
            raise CaptureGone(
                f"the server handed over the capture's file {each}, which is not on this host (fetch with "
                "local=False), or was removed (--capture-ttl seconds after it was handed over)"
            ) from None
        return _parsed(mapping)[1]
    finally:
        with contextlib.suppress(OSError):
            os.unlink(each)


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
