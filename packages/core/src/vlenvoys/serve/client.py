"""A served capture's values in the HTTP client: decoded from the response, or fetched (`vlenvoys.capturing`'s).

What the server answers is `vlenvoys.serve.capture`'s; this is what a client
of it runs (in any process, with no engine): `decode` an inline entry, `fetch`
(or `fetch_async`) a response's values whichever way they came.
"""

from __future__ import annotations

import asyncio
import base64
import json
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
          client: Any = None) -> list[torch.Tensor]:
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

    Returns:
        Each entry's values, ``[layers, positions, *row]`` of its ``shape``, in
        its ``dtype`` (``torch.float32``, ``bfloat16`` or ``float16``), in the
        model's own units (no scaling).

    Raises:
        CaptureGone: the server holds no such capture (a 404: fetched already,
            expired after ``--capture-ttl``, dropped for newer ones beyond
            ``--capture-held-bytes``, or unknown), with its reason.
        httpx.HTTPStatusError: another refusal (a 401 for a wrong ``api_key``).
        httpx.HTTPError: the server could not be reached.
        KeyError: ``answer`` has no ``capture`` list, or an entry lacks a key.
        ValueError: values of another shape or dtype than the entry says.
    """
    import contextlib

    import httpx

    entries = _entries_of(answer)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with contextlib.nullcontext(client) if client is not None else httpx.Client(timeout=timeout) as http:
        got = {url: _file(_body(http.get(_root(base_url) + url, headers=headers))) for url in _urls(entries)}
    return _tensors(entries, got)


async def fetch_async(base_url: str, answer: Any, *, api_key: str | None = None, timeout: float = 60.0,
                      client: Any = None) -> list[torch.Tensor]:
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
    if client is None:
        async with httpx.AsyncClient(timeout=timeout) as http:
            answers = await asyncio.gather(*(http.get(_root(base_url) + url, headers=headers) for url in urls))
        return _tensors(entries, {url: _file(_body(each)) for url, each in zip(urls, answers, strict=True)})
    together = _together(client, _root(base_url), headers)
    files = await asyncio.gather(*(together.take(url.rsplit("/", 1)[-1]) for url in urls))
    return _tensors(entries, dict(zip(urls, files, strict=True)))


class Together:
    """The fetches of one ``httpx.AsyncClient`` from one server, gathered: a capture asked for while the
    client's fetches are on their way waits for the next one, which asks for every capture waiting then."""

    #: Fetches on their way at once.
    PARALLEL = 4

    def __init__(self, client: Any, root: str, headers: dict[str, str]) -> None:
        self.client, self.root, self.headers = client, root, headers
        #: capture id -> the future of its tensors, not asked for yet.
        self.waiting: dict[str, asyncio.Future] = {}
        self.sending = 0

    async def take(self, name: str) -> dict[str, torch.Tensor]:
        """The tensors of capture ``name`` (``{value: tensor}``), fetched with whatever else is waiting."""
        future = self.waiting.get(name)
        if future is None:
            future = self.waiting[name] = asyncio.get_running_loop().create_future()
        if self.sending < self.PARALLEL:
            self.sending += 1
            asyncio.get_running_loop().create_task(self._send())
        return await asyncio.shield(future)  # a caller that gives up leaves the others' fetch alone

    async def _send(self) -> None:
        try:
            while self.waiting:
                names = list(self.waiting)[:FETCH_TOGETHER]
                batch = {name: self.waiting.pop(name) for name in names}
                try:
                    response = await self.client.get(f"{self.root}{CAPTURES_PATH}", params={"ids": ",".join(names)},
                                                      headers=self.headers)
                    each = _files_of(_body(response), names)
                except Exception as error:  # every capture of this fetch hears of it
                    each = dict.fromkeys(names, error)
                for name, future in batch.items():
                    if future.done():
                        continue
                    if isinstance(each[name], BaseException):
                        future.set_exception(each[name])
                    else:
                        future.set_result(each[name])
        finally:
            self.sending -= 1


#: httpx.AsyncClient -> {(server, headers): its `Together`}; forgotten with the client.
_TOGETHER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _together(client: Any, root: str, headers: dict[str, str]) -> Together:
    servers = _TOGETHER.setdefault(client, {})
    key = (root, tuple(sorted(headers.items())))
    if key not in servers:
        servers[key] = Together(client, root, headers)
    return servers[key]


def _file(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(data)


def _files_of(data: bytes, names: list[str]) -> dict[str, dict[str, torch.Tensor] | CaptureGone]:
    """A fetch of several captures (``GET /v1/captures?ids=``) split: each id's tensors, or why it has none."""
    (size,) = struct.unpack("<Q", data[:8])
    gone = json.loads(json.loads(data[8 : 8 + size]).get("__metadata__", {}).get("gone", "{}"))
    files: dict[str, Any] = {name: {} for name in names}
    for key, tensor in _file(data).items():
        name, _, value = key.partition("/")
        files[name][value] = tensor
    for name, why in gone.items():
        files[name] = CaptureGone(why)
    return files


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
