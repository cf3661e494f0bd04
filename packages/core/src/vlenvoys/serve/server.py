"""``vlenvoys serve``: vLLM's OpenAI-compatible server on vlenvoys' worker, with per-request steering.

The server is vLLM's own (``/v1/completions``, ``/v1/chat/completions``,
streaming, ``--api-key`` and every engine argument work as on ``vllm serve``),
started in this process with the worker `vlenvoys.load` would use
(`vlenvoys.engine.processes.worker_class`) and one ASGI middleware, `SteeringMiddleware`.

A request may also capture standard values of its prompt (a ``capture``
field, returned in the response's ``capture``, or held for one binary fetch at
``GET /v1/captures/{id}``, or with others at ``GET /v1/captures?ids=a,b``, with
``"capture_transport": "fetch"``): see
`vlenvoys.serve.capture`.

A request's ``steering`` is `vlenvoys.serve.steering`'s, its ``capture`` `vlenvoys.serve.capture`'s.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qs

import torch

from ..engine.loading import PIPELINE_REFUSED, cpu_ranks, engine_defaults, float32_kernels, model_runner
from ..engine.processes import worker_class
from ..values.family import resolve_checkpoint
from ..weights import smollm2_path
from ..wire.requests import COLLECT_ID_KEY, COLLECT_KEY, STEER_KEY
from ..wire.shm import engine_named, sweep
from ..wire.steering import salt_of
from .capture import HELD_BYTES, HELD_SECONDS, PENDING, CaptureGone, Captures, Held, fetch_body, transport_of
from .fields import CAPTURES_PATH, FETCH_TOGETHER, GENERATING, VECTORS_PATH, SteeringError, document
from .steering import VECTORS, rewritten

__all__ = ["MIDDLEWARE", "SteeringMiddleware", "anyio_classes_first", "guard", "main", "parser", "prepare"]


def guard(engine_client: Any) -> None:
    """Refuse, in the API server, every request that reaches the engine with steering but without its cache salt.

    The middleware sees only the paths it serves; vLLM has others that take
    ``extra_args`` straight from the body (``/inference/v1/generate`` under
    ``--enable-scale-out``, ``/v1/responses``' ``vllm_xargs``). A request
    steered there would share cached prefixes with plain requests, so each
    request on its way to the engine core is checked here, whatever its path.

    Raises (for the request, which vLLM answers with an error; the engine goes on):
        VLLMValidationError: ``extra_args`` holding `vlenvoys.wire.requests.STEER_KEY`
            with a cache salt that does not end in the spec's; or naming a
            collector (`vlenvoys.wire.requests.COLLECT_KEY`) other than by a capture of this
            server's (whose values nobody would take, and the engine would keep).
    """
    core = getattr(engine_client, "engine_core", None)
    if core is None or getattr(core, "vlenvoys_guarded", False):
        return
    from vllm.exceptions import VLLMValidationError

    add = core.add_request_async

    async def add_request_async(request: Any) -> Any:
        extra = getattr(request.sampling_params, "extra_args", None) or {}
        if (COLLECT_KEY in extra or COLLECT_ID_KEY in extra) and extra.get(COLLECT_ID_KEY) not in PENDING:
            raise VLLMValidationError(
                f"extra_args[{COLLECT_KEY!r}] is the server's own; capture with the 'capture' field of "
                f"{' or '.join(GENERATING)}",
                parameter="vllm_xargs",
            )
        if STEER_KEY in extra:
            spec, salt = extra[STEER_KEY], request.cache_salt
            if not (isinstance(spec, str) and isinstance(salt, str) and salt.endswith(salt_of(spec))):
                raise VLLMValidationError(
                    f"extra_args[{STEER_KEY!r}] is the server's own; steer with the 'steering' field of {' or '.join(GENERATING)}",
                    parameter="vllm_xargs",
                )
        return await add(request)

    core.add_request_async = add_request_async
    core.vlenvoys_guarded = True


def _error(message: str, param: str | None, status: int = 400) -> Any:
    from starlette.responses import JSONResponse

    kind = "BadRequestError" if status == 400 else "NotFoundError"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status)


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
        # The request fields served here appear in /openapi.json and /docs; the document is built once.
        app.openapi = functools.cache(lambda openapi=app.openapi: document(openapi()))
        config = app.state.vllm_config.model_config
        self.shape = (int(config.get_hidden_size()), int(config.hf_text_config.num_hidden_layers), config.dtype)
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
        if fetching and scope["method"] == "GET":
            return await self._fetched(scope, path.removeprefix(CAPTURES_PATH).removeprefix("/"))(scope, receive, send)
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
        """Run a capturing request and send its response with the values added (`vlenvoys.serve.capture`)."""
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

    def _fetched(self, scope: dict, name: str) -> Any:
        """The answer to a fetch of held captures (`vlenvoys.serve.capture.Held`): ``GET CAPTURES_PATH/{id}``, one
        capture as a safetensors file of its tensors named by value (or a 404 saying why it is not held), or ``GET
        CAPTURES_PATH?ids=a,b``, several in one safetensors file, each tensor named ``{id}/{value}`` and the
        metadata's ``gone`` a JSON object of the ids not held and why. Each capture is served once.

        With ``local=1`` (a client that reads this server's files, which it proves to itself first by the
        server's beacon, `vlenvoys.serve.capture.Beacon`; the request must come from a loopback address, else a
        400, after which the client asks again without it), a capture held in a file is not sent: the metadata's ``files``, a JSON object of id -> path, names its file
        (itself a safetensors file of the capture's tensors named by value), which is the client's to map and
        to remove (counted against ``--capture-held-bytes`` until removed, and removed ``--capture-ttl`` seconds
        on if still there); the tensors of one held in memory
        (no room under `vlenvoys.serve.capture.HELD_FOLDER`) are in the body as above.

        Several in one request: each fetch is a round trip through the HTTP stack, which cost served capture
        more than its values did (`vlenvoys.serve.client.fetch_async` gathers concurrent fetches). The body is
        sent as the held bytes lie, no file built (`vlenvoys.serve.capture.fetch_body`).
        """
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        local = query.get("local", ["0"])[-1]
        if local not in ("0", "1"):
            return _error(f"local: expected 0 or 1, got {local!r}", "local")
        local = local == "1"
        if local and not _loopback(scope):
            return _error("local=1 hands over a file on the server's host: it serves a client there, on a loopback "
                          "address; fetch without it", "local")
        together = not name
        if together:
            ids = [each for field in query.get("ids", []) for each in field.split(",") if each]
            if not ids or len(ids) > FETCH_TOGETHER:
                return _error(
                    f"ids: expected 1 to {FETCH_TOGETHER} capture ids, comma-separated, got {len(ids)}", "ids"
                )
        else:
            ids = [name]
        held = self.captures.held
        images, gone, files = {}, {}, {}
        for each in dict.fromkeys(ids):
            try:
                path, image = held.hand_over(each) if local else (None, held.take(each))
            except CaptureGone as error:
                if not together:
                    return _error(str(error), "id", 404)
                gone[each] = str(error)
                continue
            if path is not None:
                files[each] = path
            else:
                images[each] = image
        metadata = {"gone": json.dumps(gone)} if together else None
        if local:
            metadata = {**(metadata or {}), "files": json.dumps(files)}
        return _parts_response(fetch_body(images, metadata, prefixed=together))

    def _register(self, body: bytes) -> Any:
        try:
            parsed = json.loads(body)
        except ValueError:
            raise SteeringError("expected a JSON object {name, vector}", "name") from None
        if not isinstance(parsed, dict) or set(parsed) != {"name", "vector"}:
            raise SteeringError("expected a JSON object {name, vector}", "name")
        vector = self.vectors.add(parsed["name"], parsed["vector"], self.shape[0])
        return _json(200, {"object": "steering.vector", "name": parsed["name"], "norm": float(vector.norm())})


def _loopback(scope: dict) -> bool:
    """Whether the request came from this host: a loopback address, or a Unix socket (no address)."""
    import ipaddress

    client = scope.get("client")
    if not client:
        return True
    try:
        return ipaddress.ip_address(client[0]).is_loopback
    except ValueError:
        return False


#: The most bytes a fetch answer hands the server's transport at once (it waits for room before the next).
SENT_AT_ONCE = 4 << 20


def _parts_response(parts: list) -> Any:
    """An ASGI app answering ``parts`` (bytes-likes) as one ``application/octet-stream`` body, sent as they lie
    in pieces of at most `SENT_AT_ONCE` bytes: no bytes object of the whole body is built."""
    length = sum(len(part) for part in parts)

    async def answer(scope: dict, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/octet-stream"), (b"content-length", str(length).encode()),
        ]})
        pieces = [part[at : at + SENT_AT_ONCE] for part in parts for at in range(0, len(part), SENT_AT_ONCE)]
        for number, piece in enumerate(pieces):
            await send({"type": "http.response.body", "body": piece, "more_body": number < len(pieces) - 1})
        if not pieces:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    return answer


def _json(status: int, content: dict) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse(content, status_code=status)


# -- starting the server -----------------------------------------------------------------

MIDDLEWARE = f"{__name__}.SteeringMiddleware"


def vllm_cli_args() -> Any:
    """vLLM's module of ``serve``'s arguments (``make_arg_parser``, ``validate_parsed_serve_args``), where this
    vLLM keeps it: ``vllm.entrypoints.common.cli_args`` since 0.33, ``vllm.entrypoints.launchers.cli_args`` in 0.32."""
    try:
        from vllm.entrypoints.common import cli_args
    except ImportError:
        from vllm.entrypoints.launchers import cli_args
    return cli_args


def parser() -> Any:
    """vLLM's ``serve`` argument parser with vlenvoys' options (``--vectors``, ``--cuda-graphs``)."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    made = vllm_cli_args().make_arg_parser(FlexibleArgumentParser(
        prog="vlenvoys serve",
        description="vLLM's OpenAI-compatible server on vlenvoys' worker: every vLLM server argument works, and "
        "requests may carry a 'steering' field (see vlenvoys.serve.steering).",
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


#: The name the built-in model is served under where ``vlenvoys serve`` names no model (and no name).
BUILTIN_NAME = "SmolLM2-135M-Instruct"


def parsed(argv: Sequence[str]) -> Any:
    """``vlenvoys serve``'s arguments, parsed by `parser`; the built-in model where they name none.

    vLLM's own default model is a hub name (fetched); ``vlenvoys serve`` with
    no model serves the built-in SmolLM2-135M-Instruct instead, offline, as
    `vlenvoys.load()` does, under the name `BUILTIN_NAME` unless
    ``--served-model-name`` gives one.
    """
    argv = list(argv)
    made = parser()
    args = made.parse_args(argv)
    # A model named on the command line, or by a --config file (whose keys vLLM's parser reads, not argv): either
    # way args.model is not the parser's default then; argv is scanned too, for one that names the default itself.
    named = getattr(args, "model_tag", None) or args.model != made.get_default("model") or any(
        each == "--model" or each.startswith("--model=") for each in argv
    )
    if not named:
        args.model = str(smollm2_path())
        if not args.served_model_name:
            args.served_model_name = [BUILTIN_NAME]
    return args


def prepare(args: Any) -> None:
    """Check ``args`` and give them vlenvoys' engine settings (where the user chose none).

    Raises:
        ValueError: what this increment does not serve (several API server
            processes, headless, gRPC, data or pipeline parallelism), a ``--worker-cls`` of the user's, ``--cuda-graphs`` with
            ``--enforce-eager`` or another compilation mode.
        UnknownArchitecture: no installed family declares the model's architecture.
        UnsupportedVLLM: the installed vLLM is outside the family's verified range, or runs its V2 model runner
            (`vlenvoys.engine.loading.model_runner`, which chooses V1 where the user chose nothing).
        FileNotFoundError: no checkpoint, or no ``--vectors`` file.
    """
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    if args.headless or getattr(args, "grpc", False):
        raise ValueError("vlenvoys serve runs the HTTP server in this process: --headless and --grpc are not served")
    if args.pipeline_parallel_size > 1:
        raise ValueError(f"--pipeline-parallel-size {args.pipeline_parallel_size}: {PIPELINE_REFUSED}")
    if (args.api_server_count or 1) > 1 or args.data_parallel_size > 1:
        raise ValueError("vlenvoys serve runs one API server process and one engine: drop --api-server-count and "
                         "--data-parallel-size (the named vectors live in that one process)")
    # An architecture declared on vLLM's transformers backend alone runs there, as `vlenvoys.load` runs it.
    chosen_impl = {"model_impl": args.model_impl}
    resolve_checkpoint(args.model, chosen_impl)
    model_runner()
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
    engine_defaults(args.model, chosen)
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
    """``vlenvoys serve [MODEL] [vLLM server arguments] [--vectors FILE] [--cuda-graphs]``: serve until stopped."""
    import uvloop
    from vllm.entrypoints.launchers.api_server.entry import run_server

    try:
        from vllm.entrypoints.common.startup import cli_env_setup
    except ImportError:  # vLLM 0.32
        from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    cli_env_setup()
    anyio_classes_first()
    args = parsed(sys.argv[1:] if argv is None else argv)
    prepare(args)
    vllm_cli_args().validate_parsed_serve_args(args)
    name = f" as {args.served_model_name[0]!r}" if args.served_model_name else ""
    print(f"vlenvoys serve: {args.model}{name} ({args.dtype}) on http://{args.host or '0.0.0.0'}:{args.port}/v1, "
          f"steering on {', '.join(GENERATING)}; {len(VECTORS.named)} named vectors", file=sys.stderr, flush=True)
    with cpu_ranks(args.tensor_parallel_size), float32_kernels(args.dtype), engine_named() as engine:
        try:
            uvloop.run(run_server(args))
        finally:  # what a worker vLLM killed on the way out left in shared memory
            sweep(engine=engine, wait=10.0)
