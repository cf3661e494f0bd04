"""``vlenvoys serve``: vLLM's OpenAI-compatible server on vlenvoys' worker, with per-request steering.

The server is vLLM's own (``/v1/completions``, ``/v1/chat/completions``,
streaming, ``--api-key`` and every engine argument work as on ``vllm serve``),
started in this process with the worker `vlenvoys.load` would use
(`vlenvoys.engine.worker_class`) and one ASGI middleware, `SteeringMiddleware`.

A request steers its generation with a top-level ``steering`` field::

    "steering": [{"value": "layer_output", "layer": 1, "vector": [0.1, ...] or "name",
                  "factor": 4.0, "positions": "all"}]

Each entry adds ``factor * vector`` to the residual stream leaving block
``layer`` (``layer_output``, ``[tokens, hidden_size]`` per request), exactly
as `vlenvoys.generate` with the same `vlenvoys.Steering` does (the same bytes
reach the same hooks on the engine). ``vector`` is ``hidden_size`` numbers or
the name of a vector registered at start (``--vectors FILE.safetensors``) or
through ``POST /v1/steering/vectors``. ``positions``: ``"all"`` (default; every
prompt position and every generated token's), ``"prompt"`` (positions below the
prompt's length), ``"generated"`` (from the prompt's length on: generated token
``k``, counted from 0, sits at ``len(prompt) + k`` and is steered at the step
that feeds it, so the first token sampled is the unsteered one), or a list of
non-negative positions (0 is the prompt's first token). ``factor`` defaults
to 1. ``layer`` may be negative (counted from the end). Entries may steer
several blocks, each with its own vector, factor and positions (at most
`MAX_ENTRIES`, no block twice); entries alike in scaled vector and positions
share one slot of the engine's table.

The middleware checks the field against the model, takes it out of the body
and hands the request's spec to the engine in ``vllm_xargs`` (vLLM's
``SamplingParams.extra_args``; `vlenvoys.steering.KEY`, as JSON text, the
vector as base64 of its float32 bytes), and salts the request's prefix cache
by its steering (``cache_salt``) so steered and plain requests never share a
cached prefix; `guard` refuses a spec set by hand on any path without that
salt. A field the model cannot take is a 400 naming the reason
(OpenAI's error shape, ``param`` ``"steering"``), before the request reaches
the engine; the server goes on serving.

A request may also capture standard values of its prompt (a ``capture``
field, returned in the response's ``capture``, or held for one binary fetch at
``GET /v1/captures/{id}`` with ``"capture_transport": "fetch"``): see
`vlenvoys.capturing`.

A steered row the engine
still finds non-finite (the checks here bound the scaled vector as
`vlenvoys.Steering.encode` does, so only a stream already near the dtype's
range gets there) is left unsteered from then on, as under
`vlenvoys.generate`, but the response does not say so.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import math
import numbers
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["SteeringError", "SteeringMiddleware", "Vectors", "field_entries", "guard", "main", "salt_of", "steering_spec"]

#: Where named vectors are listed (GET) and registered (POST).
VECTORS_PATH = "/v1/steering/vectors"
#: Held captures are fetched at ``GET CAPTURES_PATH/{id}``, or several at ``GET CAPTURES_PATH?ids=a,b`` (`vlenvoys.capturing`).
CAPTURES_PATH = "/v1/captures"
#: Request paths whose ``steering`` field is served.
GENERATING = ("/v1/completions", "/v1/chat/completions")
#: Values a request may steer (others are standard names served later).
STEERABLE = ("layer_output",)
#: The most named vectors the server keeps (each ``hidden_size`` float32 numbers).
MAX_VECTORS = 4096
#: An entry's keys.
ENTRY_KEYS = frozenset({"value", "layer", "vector", "factor", "positions"})
#: The most entries a request's steering may have (each distinct vector takes a slot on the engine).
MAX_ENTRIES = 16
#: The request fields the middleware serves (and takes out of the body before vLLM sees it).
OWN_FIELDS = frozenset({"steering", "capture", "capture_transport"})
class SteeringError(ValueError):
    """A request's ``steering`` (or named vector, or ``capture``) the model cannot take: an HTTP 400 with this message."""

    def __init__(self, message: str, param: str = "steering") -> None:
        super().__init__(message)
        self.param = param


class Vectors:
    """Named steering vectors, each ``[hidden_size]`` float32, registered once and referenced by name."""

    def __init__(self) -> None:
        self.named: dict[str, torch.Tensor] = {}

    def add(self, name: Any, vector: Any, hidden_size: int) -> torch.Tensor:
        """Register ``vector`` (numbers or a tensor) as ``name`` (a later one replaces it).

        Raises:
            SteeringError: a name that is not a non-empty string, a vector of
                another width, non-finite or non-numeric entries, or more than
                `MAX_VECTORS` names.
        """
        if not isinstance(name, str) or not name or len(name) > 200:
            raise SteeringError(f"a vector's name must be a non-empty string of at most 200 characters, got {name!r}", "name")
        tensor = _numbers(vector, hidden_size, f"vector {name!r}", "vector")
        if name not in self.named and len(self.named) >= MAX_VECTORS:
            raise SteeringError(f"{MAX_VECTORS} vectors are registered already, the most this server keeps", "name")
        self.named[name] = tensor
        return tensor

    def load(self, path: str | Path, hidden_size: int) -> list[str]:
        """Register every tensor of a safetensors file under its name; each must be ``[hidden_size]``.

        Raises:
            FileNotFoundError: no such file.
            SteeringError: a tensor of another shape or with non-finite entries.
        """
        from safetensors.torch import load_file

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"--vectors {path}: no such file")
        names = []
        for name, tensor in load_file(str(path)).items():
            if tensor.dim() != 1 or not tensor.is_floating_point():
                raise SteeringError(
                    f"--vectors {path}: {name!r} is a {tensor.dtype} tensor of shape {list(tensor.shape)}, "
                    f"expected float [{hidden_size}]", "vector"
                )
            try:
                self.add(name, tensor, hidden_size)
            except SteeringError as error:
                raise SteeringError(f"--vectors {path}: {error}", error.param) from None
            names.append(name)
        return names

    def get(self, name: str) -> torch.Tensor:
        try:
            return self.named[name]
        except KeyError:
            known = ", ".join(repr(each) for each in sorted(self.named)[:20]) or "none"
            raise SteeringError(f"no vector is registered as {name!r} (registered: {known})", "steering") from None


def _numbers(vector: Any, hidden_size: int, what: str, param: str = "steering") -> torch.Tensor:
    """``vector`` as a float32 ``[hidden_size]`` tensor, refused unless its entries are finite numbers."""
    if isinstance(vector, torch.Tensor):
        tensor = vector.detach().to("cpu", torch.float32).clone()
    else:
        if not isinstance(vector, list) or not all(
            isinstance(each, numbers.Real) and not isinstance(each, bool) for each in vector
        ):
            raise SteeringError(f"{what}: expected a list of {hidden_size} numbers or a registered name", param)
        tensor = torch.tensor(vector, dtype=torch.float32)
    if tuple(tensor.shape) != (hidden_size,):
        raise SteeringError(f"{what}: expected {hidden_size} numbers (the model's hidden_size), got {list(tensor.shape)}", param)
    if not torch.isfinite(tensor).all():
        raise SteeringError(f"{what}: has NaN or infinite entries (or entries too large for float32)", param)
    if not torch.isfinite(tensor.norm()):  # its listing reports the norm; a request would be refused anyway
        raise SteeringError(f"{what}: its norm is beyond float32's range (entries too large to steer with)", param)
    return tensor


def field_entries(
    field: Any, name: str, keys: frozenset[str], most: int, error: type[Exception]
) -> Iterator[tuple[str, dict]]:
    """A request field of one entry or a list of them: each entry, named for errors (``name[i]``).

    Raises:
        error: the field is neither an object nor a non-empty list, it has more than ``most``
            entries, an entry is not an object, or an entry has a key outside ``keys``.
    """
    shape = "{" + ", ".join(sorted(keys)) + "}"
    entries = [field] if isinstance(field, dict) else field
    if not isinstance(entries, list) or not entries:
        raise error(f"{name}: expected an entry {shape} or a non-empty list of them")
    if len(entries) > most:
        raise error(f"{name}: {len(entries)} entries, at most {most} are served")
    for number, entry in enumerate(entries):
        where = f"{name}[{number}]"
        if not isinstance(entry, dict):
            raise error(f"{where}: expected an object {shape}")
        unknown = sorted(set(entry) - keys)
        if unknown:
            raise error(f"{where}: unknown keys {unknown}; an entry has {sorted(keys)}")
        yield where, entry


def steering_spec(field: Any, hidden_size: int, num_layers: int, dtype: torch.dtype, vectors: Vectors) -> dict:
    """A request's ``steering`` field as the spec the engine's `vlenvoys.steering.Steerer` admits.

    Args:
        field: One entry or a list of them (see the module's docstring).
        hidden_size: The served model's stream width.
        num_layers: The served model's block count.
        dtype: The served model's dtype (the vector is scaled in it, as `vlenvoys.Steering.encode` does).
        vectors: The named vectors.

    Returns:
        ``{"layers": [...], "vector": <base64 of float32 bytes of factor * vector
        in the model's dtype>, "positions": None | "prompt" | "generated" | [...]}``,
        the same bytes `vlenvoys.Steering.encode` makes for the same steering;
        a list of such dicts where entries differ in scaled vector or positions
        (entries alike in both are one dict of several blocks).

    Raises:
        SteeringError: an unknown value or key, a layer that does not exist,
            a vector of another width, non-finite, or not registered, a bad
            factor or positions, a block two entries steer, more than
            `MAX_ENTRIES` entries.
    """
    from .steering import Steering

    specs = []
    for where, entry in field_entries(field, "steering", ENTRY_KEYS, MAX_ENTRIES, SteeringError):
        value = entry.get("value", "layer_output")
        if value not in STEERABLE:
            from .oracle import VALUES

            known = {name for _, name in VALUES}
            if value in known:
                raise SteeringError(f"{where}: steering {value!r} is not served yet; served: {', '.join(STEERABLE)}")
            raise SteeringError(f"{where}: unknown value {value!r}; served: {', '.join(STEERABLE)}")
        layer = entry.get("layer")
        if "layer" not in entry:
            raise SteeringError(f"{where}: no layer; an entry steers one block, e.g. \"layer\": 0")
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise SteeringError(f"{where}.layer: expected a block index (an integer), got {layer!r}")
        if not -num_layers <= layer < num_layers:
            raise SteeringError(f"{where}.layer: block {layer} does not exist; the model has blocks 0 to {num_layers - 1}")
        vector = entry.get("vector")
        if vector is None:
            raise SteeringError(f"{where}: no vector; give a list of {hidden_size} numbers or a registered vector's name")
        if isinstance(vector, str):
            try:
                vector = vectors.get(vector)
            except SteeringError as error:
                raise SteeringError(f"{where}.vector: {error}") from None
        else:
            vector = _numbers(vector, hidden_size, f"{where}.vector")
        factor = entry.get("factor", 1.0)
        if not isinstance(factor, numbers.Real) or isinstance(factor, bool) or not math.isfinite(factor):
            raise SteeringError(f"{where}.factor: expected a finite number, got {factor!r}")
        positions = entry.get("positions", "all")
        if positions in ("all", "prompt", "generated"):
            chosen = None
        elif isinstance(positions, list) and all(
            isinstance(each, int) and not isinstance(each, bool) and each >= 0 for each in positions
        ):
            chosen = positions
        else:
            raise SteeringError(
                f"{where}.positions: expected \"all\", \"prompt\", \"generated\" or a list of non-negative token "
                f"positions, got {positions!r}"
            )
        try:
            spec = Steering(layer, vector, float(factor), chosen).encode_for(hidden_size, num_layers, dtype)
        except (ValueError, TypeError, IndexError) as error:
            raise SteeringError(f"{where}: {error}") from None
        if positions == "all":
            spec["positions"] = None
        elif isinstance(positions, str):
            spec["positions"] = positions
        specs.append(spec)
    # Entries of one scaled vector and one positions choice share a slot on the engine (one spec, several blocks).
    groups: dict[tuple, list[int]] = {}
    steered: set[int] = set()
    for number, spec in enumerate(specs):
        twice = sorted(steered & set(spec["layers"]))
        if twice:
            raise SteeringError(f"steering[{number}]: block {twice[0]} is steered by two entries")
        steered.update(spec["layers"])
        groups.setdefault((spec["vector"], json.dumps(spec["positions"])), []).extend(spec["layers"])
    made = [
        {"layers": sorted(layers), "vector": base64.b64encode(vector).decode("ascii"), "positions": json.loads(positions)}
        for (vector, positions), layers in groups.items()
    ]
    return made[0] if len(made) == 1 else made


def rewritten(body: dict, hidden_size: int, num_layers: int, dtype: torch.dtype, vectors: Vectors) -> dict | None:
    """The request body with its ``steering`` turned into ``vllm_xargs`` and a cache salt; None if it has none.

    Raises:
        SteeringError: see `steering_spec`; also ``vllm_xargs`` naming vlenvoys' own key,
            or a field named almost as ``steering`` or ``capture``.
    """
    from .steering import KEY

    for field in body:
        # vLLM ignores fields it does not know: a misspelt steering would generate unsteered without a word.
        for known, verb in (("steering", "steers"), ("capture", "captures")):
            if field not in OWN_FIELDS and isinstance(field, str) and field.lower().startswith(known[:5]):
                raise SteeringError(
                    f"unknown field {field!r}; a request {verb} with the field {known!r}"
                    + (" (and chooses how its values come with 'capture_transport')" if known == "capture" else ""),
                    field,
                )
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and KEY in xargs:
        raise SteeringError(f"vllm_xargs[{KEY!r}] is set by the server; steer with the request's 'steering' field", "vllm_xargs")
    if isinstance(xargs, dict) and any(isinstance(key, str) and key.startswith("vlenvoys_collect") for key in xargs):
        # Refused here, not only by `guard` on the way to the engine: there a streamed request had its 200 already,
        # and got the refusal as an error event inside the stream (found by fuzzing, #46).
        raise SteeringError("vllm_xargs' vlenvoys_collect keys are set by the server; capture with the 'capture' field",
                            "vllm_xargs")
    if "steering" not in body:
        return None
    body = dict(body)
    field = body.pop("steering")
    if field is None or field == []:
        return body
    if body.get("use_beam_search"):
        # vLLM's beam search runs requests of its own, which would go unsteered.
        raise SteeringError("beam search is not steered (use_beam_search); steer sampled or greedy requests", "use_beam_search")
    if xargs is not None and not isinstance(xargs, dict):
        raise SteeringError("vllm_xargs: expected an object", "vllm_xargs")
    spec = steering_spec(field, hidden_size, num_layers, dtype, vectors)
    text = json.dumps(spec, separators=(",", ":"))
    body["vllm_xargs"] = {**(xargs or {}), KEY: text}
    # Salted by its steering, as vlenvoys.generate salts it: a prefix cache shared only with requests steered alike.
    salt = salt_of(text)
    own = body.get("cache_salt")
    body["cache_salt"] = f"{own}-{salt}" if isinstance(own, str) and own else salt
    return body


def salt_of(text: str) -> str:
    """The cache salt of a request whose steering spec is ``text`` (its JSON in ``vllm_xargs``)."""
    return "vlenvoys-steer-" + hashlib.sha256(text.encode()).hexdigest()


def guard(engine_client: Any) -> None:
    """Refuse, in the API server, every request that reaches the engine with steering but without its cache salt.

    The middleware sees only the paths it serves; vLLM has others that take
    ``extra_args`` straight from the body (``/inference/v1/generate`` under
    ``--enable-scale-out``, ``/v1/responses``' ``vllm_xargs``). A request
    steered there would share cached prefixes with plain requests, so each
    request on its way to the engine core is checked here, whatever its path.

    Raises (for the request, which vLLM answers with an error; the engine goes on):
        VLLMValidationError: ``extra_args`` holding `vlenvoys.steering.KEY`
            with a cache salt that does not end in the spec's; or naming a
            collector (`vlenvoys.collector.KEY`) other than by a capture of this
            server's (whose values nobody would take, and the engine would keep).
    """
    core = getattr(engine_client, "engine_core", None)
    if core is None or getattr(core, "vlenvoys_guarded", False):
        return
    from vllm.exceptions import VLLMValidationError

    from . import collector
    from .capturing import PENDING
    from .steering import KEY

    add = core.add_request_async

    async def add_request_async(request: Any) -> Any:
        extra = getattr(request.sampling_params, "extra_args", None) or {}
        if (collector.KEY in extra or collector.ID_KEY in extra) and extra.get(collector.ID_KEY) not in PENDING:
            raise VLLMValidationError(
                f"extra_args[{collector.KEY!r}] is the server's own; capture with the 'capture' field of "
                f"{' or '.join(GENERATING)}",
                parameter="vllm_xargs",
            )
        if KEY in extra:
            spec, salt = extra[KEY], request.cache_salt
            if not (isinstance(spec, str) and isinstance(salt, str) and salt.endswith(salt_of(spec))):
                raise VLLMValidationError(
                    f"extra_args[{KEY!r}] is the server's own; steer with the 'steering' field of {' or '.join(GENERATING)}",
                    parameter="vllm_xargs",
                )
        return await add(request)

    core.add_request_async = add_request_async
    core.vlenvoys_guarded = True


def _error(message: str, param: str | None, status: int = 400) -> Any:
    from starlette.responses import JSONResponse

    kind = "BadRequestError" if status == 400 else "NotFoundError"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status)


#: The server's named vectors (this process's: `prepare` loads ``--vectors`` files into it).
VECTORS = Vectors()


class SteeringMiddleware:
    """ASGI middleware (vLLM's ``--middleware``): serves ``steering`` on generation requests and the vector registry.

    It reads the model's shape from the app's state (``vllm_config``) once
    the server runs. It sits outside vLLM's own middleware (vLLM adds the
    user's last), so where ``--api-key`` is set it answers a request itself
    only when its key is right, and hands any other to vLLM, which refuses it.
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self.vectors = VECTORS
        self.shape: tuple[int, int, torch.dtype] | None = None
        self.guard: Any = None
        self.captures: Any = None

    def _start(self, app: Any) -> None:
        if self.shape is not None:
            return
        guard(app.state.engine_client)
        config = app.state.vllm_config.model_config
        self.shape = (int(config.get_hidden_size()), int(config.hf_text_config.num_hidden_layers), config.dtype)
        from .capturing import HELD_BYTES, HELD_SECONDS, Captures, Held

        from vllm.config import CUDAGraphMode

        vllm_config = app.state.vllm_config
        graphs = not config.enforce_eager and vllm_config.compilation_config.cudagraph_mode != CUDAGraphMode.NONE
        args = app.state.args
        from vllm import envs

        held = Held(getattr(args, "capture_ttl", HELD_SECONDS), getattr(args, "capture_held_bytes", HELD_BYTES))
        self.captures = Captures(
            app.state.engine_client, self.shape[1], vllm_config.parallel_config.world_size, graphs, held
        )
        tokens = [key for key in (args.api_key or [envs.VLLM_API_KEY]) if key]
        if tokens:
            from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

            self.guard = AuthenticationMiddleware(None, tokens)

    def _allowed(self, scope: dict) -> bool:
        from starlette.datastructures import Headers

        return self.guard is None or self.guard.verify_token(Headers(scope=scope))

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self._start(scope["app"])  # before any request reaches the engine, whatever its path
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        fetching = path.startswith(CAPTURES_PATH + "/") or path == CAPTURES_PATH
        if scope.get("method") not in ("POST", "GET") or not path.startswith("/v1/") or (
            scope["method"] == "GET" and path != VECTORS_PATH and not fetching
        ):
            return await self.app(scope, receive, send)
        if not self._allowed(scope):
            return await self.app(scope, receive, send)  # vLLM's authentication answers it
        if path == VECTORS_PATH and scope["method"] == "GET":
            listed = [{"name": name, "norm": float(vector.norm())} for name, vector in sorted(self.vectors.named.items())]
            return await _json(200, {"object": "list", "data": listed, "hidden_size": self.shape[0]})(scope, receive, send)
        if fetching and scope["method"] == "GET" and path == CAPTURES_PATH:
            return await (await self._fetched_together(scope))(scope, receive, send)
        if fetching and scope["method"] == "GET":
            return await (await self._fetched(path.removeprefix(CAPTURES_PATH + "/")))(scope, receive, send)
        body, disconnected = b"", False
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                disconnected = True
                break
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        if disconnected:
            return None
        try:
            if path == VECTORS_PATH:
                return await self._register(body)(scope, receive, send)
            try:
                parsed = json.loads(body) if body else None
            except (ValueError, RecursionError):
                parsed = None  # vLLM answers a body that is not JSON (or nested past Python's recursion limit)
            if isinstance(parsed, dict) and "steering" in parsed and path not in GENERATING:
                raise SteeringError(f"steering is served on {' and '.join(GENERATING)}, not on {path}")
            new = rewritten(parsed, *self.shape, self.vectors) if isinstance(parsed, dict) else None
            ticket, transport = None, "inline"
            if isinstance(parsed, dict) and "capture_transport" in parsed:
                from .capturing import transport_of

                transport = transport_of(parsed["capture_transport"])  # a 400 before the engine, captured or not
                new = dict(parsed if new is None else new)
                del new["capture_transport"]
            if isinstance(parsed, dict) and "capture" in parsed:
                new = dict(parsed if new is None else new)
                if new["capture"] is None or new["capture"] == []:
                    del new["capture"]  # as "steering": null, a request that captures nothing
                else:
                    new, ticket = await self.captures.admit(new, path, transport)
        except SteeringError as error:
            return await _error(str(error), error.param)(scope, receive, send)
        if new is not None:
            body = json.dumps(new).encode()
            headers = [(key, value) for key, value in scope["headers"] if key.lower() != b"content-length"]
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        if ticket is None:
            return await self.app(scope, replay, send)
        return await self._captured(scope, replay, send, ticket)

    async def _captured(self, scope: dict, receive: Any, send: Any, ticket: Any) -> None:
        """Run a capturing request and send its response with the values added (`vlenvoys.capturing`)."""
        start: dict | None = None
        parts: list[bytes] = []

        async def keep(message: dict) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
            elif message["type"] == "http.response.body":
                parts.append(message.get("body", b""))
            else:
                await send(message)

        try:
            await self.app(scope, receive, keep)
        except BaseException:
            await self.captures.respond(ticket, 500, b"")  # its values leave the engine all the same
            raise
        status, body = await self.captures.respond(ticket, start["status"] if start else 500, b"".join(parts))
        if start is None:
            return None
        headers = [(key, value) for key, value in start.get("headers", []) if key.lower() != b"content-length"]
        await send({**start, "status": status, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _fetched(self, name: str) -> Any:
        """A held capture's values as safetensors bytes, once (`capturing.Held.take`); else a 404 saying why."""
        from starlette.responses import Response

        from .capturing import CaptureGone, as_file

        try:
            tensors = self.captures.held.take(name)
        except CaptureGone as error:
            return _error(str(error), "id", 404)
        # Serialized off the event loop: a capture may be tens of MiB, and other requests stream meanwhile.
        return Response(await asyncio.to_thread(as_file, tensors), media_type="application/octet-stream")

    async def _fetched_together(self, scope: dict) -> Any:
        """Several held captures in one safetensors file (``GET CAPTURES_PATH?ids=a,b``): each tensor named
        ``{id}/{value}``, and the metadata's ``gone`` a JSON object of the ids not held and why.

        One request for many: each fetch is a round trip through the HTTP stack, which cost served
        capture more than its values did (`vlenvoys.capturing.fetch_async` gathers concurrent fetches).
        """
        from urllib.parse import parse_qs

        from starlette.responses import Response

        from .capturing import FETCH_TOGETHER, CaptureGone, as_file

        ids = [name for field in parse_qs(scope.get("query_string", b"").decode("latin-1")).get("ids", [])
               for name in field.split(",") if name]
        if not ids or len(ids) > FETCH_TOGETHER:
            return _error(f"ids: expected 1 to {FETCH_TOGETHER} capture ids, comma-separated, got {len(ids)}", "ids")
        tensors, gone = {}, {}
        for name in dict.fromkeys(ids):
            try:
                held = self.captures.held.take(name)
            except CaptureGone as error:
                gone[name] = str(error)
                continue
            tensors.update({f"{name}/{value}": tensor for value, tensor in held.items()})
        body = await asyncio.to_thread(as_file, tensors, {"gone": json.dumps(gone)})
        return Response(body, media_type="application/octet-stream")

    def _register(self, body: bytes) -> Any:
        try:
            parsed = json.loads(body)
        except ValueError:
            raise SteeringError("expected a JSON object {name, vector}", "name") from None
        if not isinstance(parsed, dict) or set(parsed) != {"name", "vector"}:
            raise SteeringError("expected a JSON object {name, vector}", "name")
        vector = self.vectors.add(parsed["name"], parsed["vector"], self.shape[0])
        return _json(200, {"object": "steering.vector", "name": parsed["name"], "norm": float(vector.norm())})


def _json(status: int, content: dict) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse(content, status_code=status)


# -- starting the server -----------------------------------------------------------------

MIDDLEWARE = f"{__name__}.SteeringMiddleware"


def parser() -> Any:
    """vLLM's ``serve`` argument parser with vlenvoys' options (``--vectors``, ``--cuda-graphs``)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from .capturing import HELD_BYTES, HELD_SECONDS

    made = make_arg_parser(FlexibleArgumentParser(
        prog="vlenvoys serve",
        description="vLLM's OpenAI-compatible server on vlenvoys' worker: every vLLM server argument works, and "
        "requests may carry a 'steering' field (see vlenvoys.serving).",
    ))
    group = made.add_argument_group("vlenvoys")
    group.add_argument(
        "--vectors", action="append", default=[], metavar="FILE.safetensors",
        help="Named steering vectors: every tensor of the file ([hidden_size]) under its name. Repeatable.",
    )
    group.add_argument(
        "--capture-ttl", type=float, default=HELD_SECONDS, metavar="SECONDS",
        help="Seconds a capture of 'capture_transport': 'fetch' is held for its one fetch (GET /v1/captures/ID).",
    )
    group.add_argument(
        "--capture-held-bytes", type=int, default=HELD_BYTES, metavar="BYTES",
        help="The most bytes of captured values held for fetching; beyond, the oldest unfetched are dropped.",
    )
    group.add_argument(
        "--cuda-graphs", action="store_true",
        help="On a GPU, replay CUDA graphs of decode steps with the steering hooks in them (vlenvoys.load's "
        "cuda_graphs=True); otherwise the engine runs eagerly.",
    )
    return made


def prepare(args: Any) -> None:
    """Check ``args`` and give them vlenvoys' engine settings (where the user chose none).

    Raises:
        ValueError: what this increment does not serve (several API server
            processes, headless, gRPC, data parallelism), a ``--worker-cls`` of the user's, ``--cuda-graphs`` with
            ``--enforce-eager`` or another compilation mode.
        UnknownArchitecture: no installed family declares the model's architecture.
        FileNotFoundError: no checkpoint, or no ``--vectors`` file.
    """
    from .engine import _engine_defaults, resolve_checkpoint, worker_class

    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    if args.headless or getattr(args, "grpc", False):
        raise ValueError("vlenvoys serve runs the HTTP server in this process: --headless and --grpc are not served")
    if (args.api_server_count or 1) > 1 or args.data_parallel_size > 1:
        raise ValueError("vlenvoys serve runs one API server process and one engine: drop --api-server-count and "
                         "--data-parallel-size (the named vectors live in that one process)")
    # An architecture declared on vLLM's transformers backend alone runs there, as `vlenvoys.load` runs it.
    chosen_impl = {"model_impl": args.model_impl}
    resolve_checkpoint(args.model, chosen_impl)
    args.model_impl = chosen_impl["model_impl"]
    if not (args.capture_ttl > 0 and args.capture_held_bytes > 0):
        raise ValueError(f"--capture-ttl and --capture-held-bytes must be positive, got {args.capture_ttl} and "
                         f"{args.capture_held_bytes}")
    if args.worker_cls not in (None, "auto"):
        raise ValueError(f"--worker-cls {args.worker_cls}: vlenvoys serve runs its own worker")
    if args.vectors:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
        hidden_size = int(config.get_text_config().hidden_size)
        for path in args.vectors:
            VECTORS.load(path, hidden_size)
    args.worker_cls = worker_class()
    chosen: dict = {}
    _engine_defaults(args.model, chosen)
    if args.dtype == "auto":
        args.dtype = chosen["dtype"]
    if "kv_cache_memory_bytes" in chosen and args.kv_cache_memory_bytes is None:
        args.kv_cache_memory_bytes = chosen["kv_cache_memory_bytes"]
    if args.cuda_graphs:
        _graph_settings(args)
    else:
        args.enforce_eager = True  # the hooks must run: no torch.compile, no graphs
    if MIDDLEWARE not in args.middleware:
        args.middleware.append(MIDDLEWARE)


def _graph_settings(args: Any) -> None:
    from vllm.config import CompilationMode
    from vllm.platforms import current_platform

    if args.enforce_eager:
        raise ValueError("--cuda-graphs replays graphs; drop --enforce-eager")
    if not current_platform.is_cuda_alike():
        args.enforce_eager = True  # no graphs to replay: as vlenvoys.load, the same hooks run eagerly
        return
    config = args.compilation_config
    get = config.get if isinstance(config, dict) else lambda name, default=None: getattr(config, name, default)
    mode = get("mode")
    if mode not in (None, CompilationMode.NONE, 0):
        raise ValueError(f"--cuda-graphs captures the eager forward (compilation mode NONE), got mode {mode!r}")
    settings = {"mode": CompilationMode.NONE, "cudagraph_mode": get("cudagraph_mode") or "FULL_DECODE_ONLY"}
    if isinstance(config, dict):
        config.update(settings)
    else:
        from vllm.config import CUDAGraphMode

        config.mode = CompilationMode.NONE
        if config.cudagraph_mode is None:
            config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY


def anyio_classes_first() -> None:
    """Define anyio's typed-attribute classes with nnsight's ``.save`` unmounted (vLLM's streaming needs them,
    and httpx's async transport); `import vlenvoys` calls it.

    nnsight mounts ``.save`` on every object when imported; anyio refuses to
    define a ``TypedAttributeSet`` subclass that then has an unannotated
    attribute ``save`` ("Attribute 'save' is missing its type annotation").
    nnsight imports anyio's own package first, but not ``anyio.streams.file``,
    which a streamed response of vLLM's server imports on its first use: every
    streamed chat completion was a 400 with that message. They are imported here,
    with the mount lifted meanwhile and put back after.
    """
    import importlib
    import importlib.util

    if importlib.util.find_spec("anyio") is None:
        return
    modules = [name for name in ("anyio.streams.file", "anyio.streams.tls", "anyio.abc._sockets") if name not in sys.modules]
    mounted = hasattr(object(), "save")
    if not modules:
        return
    if not mounted:
        for name in modules:
            importlib.import_module(name)
        return
    from nnsight import save
    from nnsight._c import mount, unmount

    unmount("save")
    try:
        for name in modules:
            importlib.import_module(name)
    finally:
        mount(save, "save")


def main(argv: Sequence[str] | None = None) -> None:
    """``vlenvoys serve MODEL [vLLM server arguments] [--vectors FILE] [--cuda-graphs]``: serve until stopped."""
    import uvloop
    from vllm.entrypoints.launchers.api_server.entry import run_server
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    from .engine import _cpu_ranks, _float32_kernels
    from .handover import engine_named, sweep

    cli_env_setup()
    anyio_classes_first()
    args = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    prepare(args)
    validate_parsed_serve_args(args)
    print(f"vlenvoys serve: {args.model} ({args.dtype}) on http://{args.host or '0.0.0.0'}:{args.port}/v1, "
          f"steering on {', '.join(GENERATING)}; {len(VECTORS.named)} named vectors", file=sys.stderr, flush=True)
    with _cpu_ranks(args.tensor_parallel_size), _float32_kernels(args.dtype), engine_named() as engine:
        try:
            uvloop.run(run_server(args))
        finally:  # what a worker vLLM killed on the way out left in shared memory
            sweep(engine=engine, wait=10.0)
