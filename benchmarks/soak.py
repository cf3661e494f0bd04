"""A soak of `vlenvoys serve` (#46): thousands of mixed requests on one served engine, each checked against the same
request run alone, with the server's and the client's memory sampled over time.

    python benchmarks/soak.py                       # 2,000 requests, 32 in flight, 8 rounds, tiny Llama
    python benchmarks/soak.py --requests 300 --rounds 4 --no-traces

One ``vlenvoys serve`` is started (the tiny random Llama of `vlenvoys_testing.tiny_model` by default; ``--model 1b``
is benchmarks/bench.py's random Llama of a 1B shape in bfloat16, for a GPU; ``--model PATH`` any checkpoint). A pool
of distinct requests of four kinds is built (`make_pool`): plain, steered (named and inline vectors, at several
blocks and positions), capturing with the values fetched (``"capture_transport": "fetch"``, then
`vlenvoys.capturing.fetch_async`) and capturing inline (base64 in the JSON); some capturing requests are steered
too. Every request is greedy with ``ignore_eos``, a few tokens, and asks for its tokens' ids and log-probabilities.
Each pool request is first run alone, one at a time: its reference. Then ``--requests`` requests drawn from the pool
go out ``--concurrency`` at a time with the async openai client, in ``--rounds`` rounds, and every response is
compared with its reference: the same tokens, and on the CPU engine log-probabilities and captured values bit for
bit (`torch.equal`; the CPU engine's kernels do not depend on a step's batch); on a GPU, whose kernels tile by the
step's shape, within `vlenvoys_testing.conformance.TOLERANCE` relative (``BF16_TOLERANCE`` for a bfloat16 model; captures
returned in bfloat16 or float16 at least 1e-2). A request that raised, timed out or was refused is lost.

Traces through the Python API cannot run on the served engine: a trace's block reaches an engine only from the
Python process that loaded it (`vlenvoys.load`), and the served engine belongs to the server's process, which takes
HTTP requests and runs no trace sent from outside. So, with ``--traces`` (the default), the soak loads a second
engine of the same checkpoint in its own process and, while each round's HTTP requests are in flight, runs traces
on it, one for every two requests answered (``--traces-a-request``): reads of every block's stream and the logits
over a few steps, the same with ``model.steer`` at a block, and `vlenvoys.generate` of two prompts, one steered.
Each is compared with its run alone, as the served requests are.

Memory is sampled every ``--every`` seconds in a thread, and at the end of each round after a second's settling:
the server's process tree (the HTTP process and its engine's), the soak's own process, and the soak's other
children (the traces' engine), each as resident memory (RSS) and as its private part (RSS less shared and
file-backed pages). Private memory must level off: each private series may grow by at most ``--bound`` MiB (16)
from the end of the middle round to the end of the last, over the second half of the requests: 16 KB a request
over 1,000 (an earlier soak, #46, saw the server grow by some 10 MB every round without levelling). The slope over
those rounds is reported in MiB per 1,000 requests. Two bounded fillings are kept out of the verdict:

- The engines' shared memory (`vlenvoys.engine.handover`): captured rows and a trace's saves are written into 64 MiB chunks
  front to back, so an engine's RSS grows by what was written until a chunk is full and another one is reused
  (about 8 MiB per 250 capturing requests here; with 4 MiB chunks a capturing soak used two, in turn); the client maps
  the chunks its traces' saves are in, so its RSS grows alike. Shared pages count in RSS, not in private memory.
- oneDNN's primitive cache in the CPU engine (vLLM's matrix products): every step of a new shape (tokens in the
  batch) adds primitives, up to 1,024. Capturing requests compute their whole prompts (a cache salt of their own),
  so a soak meets many shapes: measured in the engine's worker (glibc's ``mallinfo2``) over 4,000 inline capturing
  requests, its allocated heap grew from 221 to 468 MiB over the first ~2,000 and then stayed there; with the cache
  off it stayed at 221 MiB. The soak therefore starts both engines with ``ONEDNN_PRIMITIVE_CACHE_CAPACITY=0``
  (``--onednn-cache``; ``default`` keeps oneDNN's 1,024), so that a leak is not hidden behind the cache's filling.

Writes ``benchmarks/results/soak-<commit>-<device>.json`` (every sample, every round, the verdict) and its memory
curve as ``.png`` (``--out`` elsewhere), prints a table, and exits non-zero when a request was lost, a response
differed from its reference, or memory did not level off. CI runs a short version on the session's server:
packages/family-llama/tests/test_llama_soak.py, which loads this file by its path.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import gc
import json
import math
import os
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "benchmarks"))  # bench.py and workloads.py beside this file; appended, so that
# its datasets.py does not hide Hugging Face's `datasets` from whoever imports this file
from workloads import card_name, checkout  # noqa: E402 - found through the line above

KINDS = ("plain", "steered", "fetched", "inline")
#: Values a capture reads, each with one row per token (the tiny Llama serves them all).
CAPTURED = ("layer_output", "layer_input", "attention_queries", "mlp_output", "layer_mid")
STEER_POSITIONS = ("all", "prompt", "generated")
CAPTURE_POSITIONS = ("prompt", "all", "last", "generated")
#: Named vectors the server must hold (its ``--vectors`` file): the CI server's, and this script's.
VECTORS = ("up", "down")
#: How the plot names a ``--model``.
MODELS = {"tiny": "the tiny random Llama", "1b": "a random Llama of a 1B shape"}
#: Default bound on a series' growth over the second half of the rounds, MiB (see the module's docstring).
BOUND_MIB = 16.0
MIB = 1 << 20
WORDS = (
    "once upon a time there was a small village at the edge of a great forest where the baker opened his shop "
    "every morning and children ran to school while the old clock in the tower struck eight and the river ran "
    "past the market under a pale sky"
).split()


# -- the requests -----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Request:
    """One pool request: its name, kind (`KINDS`), prompt, tokens to generate, and fields beside the usual ones."""

    name: str
    kind: str
    prompt: str
    tokens: int
    body: dict


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a response gave: generated token ids, their log-probabilities, captured values (one tensor an entry)."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    captures: tuple[torch.Tensor, ...] = ()


def texts(count: int, seed: int = 0, low: int = 3, high: int = 24) -> list[str]:
    """``count`` distinct prompts of ``low``..``high`` words, the same for the same arguments everywhere."""
    draw = random.Random(seed)
    made: list[str] = []
    while len(made) < count:
        start, length = draw.randrange(len(WORDS)), draw.randint(low, high)
        text = " ".join(WORDS[(start + i) % len(WORDS)] for i in range(length)).capitalize()
        if text not in made:
            made.append(text)
    return made


def vector(seed: int, hidden: int, scale: float = 3.0) -> list[float]:
    return (scale * torch.randn(hidden, generator=torch.Generator().manual_seed(seed))).tolist()


def make_pool(per_kind: int, hidden: int, layers: int, seed: int = 0) -> list[Request]:
    """``per_kind`` distinct requests of each kind in `KINDS` for a model of ``hidden`` width and ``layers`` blocks.

    Steering draws a named vector (`VECTORS`) or an inline one, a block, a factor and positions; a capture draws one
    or two values (`CAPTURED`), one or two blocks, positions and dtype. A fetched capture stays under 50 KB, so that
    the CI server's 1 MiB held for fetching (``--capture-held-bytes``) never drops one before its fetch.
    """
    draw = random.Random(seed)
    prompts = texts(len(KINDS) * per_kind, seed)

    def steering() -> list[dict]:
        entries = []
        for layer in sorted(draw.sample(range(layers), draw.choice((1, 2)))):
            name = draw.choice((*VECTORS, None))
            entries.append({"layer": layer, "vector": name or vector(draw.randrange(1 << 30), hidden),
                            "factor": draw.choice((-2.0, -0.5, 1.0, 2.5)), "positions": draw.choice(STEER_POSITIONS)})
        return entries

    def capture(small: bool) -> list[dict]:
        values = draw.sample(CAPTURED, 1 if small else draw.choice((1, 2)))
        return [{"value": value, "layers": sorted(draw.sample(range(layers), 1 if small else draw.choice((1, 2)))),
                 "positions": draw.choice(CAPTURE_POSITIONS), "dtype": draw.choice(("float32", "bfloat16"))}
                for value in values]

    pool = []
    for number in range(per_kind):
        for kind in KINDS:
            body: dict[str, Any] = {}
            if kind == "steered":
                body["steering"] = steering()
            elif kind in ("fetched", "inline"):
                body["capture"] = capture(small=kind == "fetched")
                if kind == "fetched":
                    body["capture_transport"] = "fetch"
                if draw.random() < 0.3:  # a steered request captures its steered run
                    body["steering"] = steering()
            pool.append(Request(f"{kind}-{number}", kind, prompts[len(pool)], draw.randint(2, 8), body))
    return pool


async def send(client: Any, http: Any, url: str, model: str, request: Request, api_key: str | None) -> Outcome:
    """``request`` on the server at ``url`` (``client``: an ``AsyncOpenAI``, ``http``: an ``httpx.AsyncClient``)."""
    from vlenvoys.capturing import fetch_async

    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True, **request.body}
    answer = await client.completions.create(model=model, prompt=request.prompt, max_tokens=request.tokens,
                                             temperature=0.0, logprobs=1, extra_body=extra)
    logprobs = answer.choices[0].logprobs
    tokens = tuple(int(token.removeprefix("token_id:")) for token in logprobs.tokens)
    captures = tuple(await fetch_async(url, answer, api_key=api_key, client=http)) if "capture" in request.body else ()
    return Outcome(tokens, tuple(logprobs.token_logprobs), captures)


# -- comparing ----------------------------------------------------------------------------------------------------


def difference(got: Any, want: Any, exact: bool, tolerance: float = 0.0, where: str = "") -> str | None:
    """Where ``got`` differs from ``want``, or None: integers and shapes exactly; floats and tensors bit for bit where
    ``exact``, else within ``tolerance`` relative (``|a - b| / max(1, |b|)``; 1e-2 at least for half-precision
    tensors). Outcomes, tuples, lists and dicts are compared item by item."""
    if dataclasses.is_dataclass(want):  # by field, not dataclasses.asdict, which would copy every tensor
        got, want = (({field.name: getattr(each, field.name) for field in dataclasses.fields(each)}
                      if dataclasses.is_dataclass(each) else each) for each in (got, want))
    if isinstance(want, dict):
        if not isinstance(got, dict) or got.keys() != want.keys():
            return f"{where or 'value'}: keys {sorted(got) if isinstance(got, dict) else type(got)} != {sorted(want)}"
        return next((found for key in want if (found := difference(
            got[key], want[key], exact, tolerance, f"{where}.{key}".lstrip(".")))), None)
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return f"{where}: {len(got) if isinstance(got, (list, tuple)) else type(got)} items, wanted {len(want)}"
        return next((found for number, (one, other) in enumerate(zip(got, want, strict=True))
                     if (found := difference(one, other, exact, tolerance, f"{where}[{number}]"))), None)
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
            found = f"{got.dtype} {list(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
            return f"{where}: {found}, wanted {want.dtype} {list(want.shape)}"
        if torch.equal(got, want):
            return None
        apart = float(((got.double() - want.double()).abs() / want.double().abs().clamp_min(1.0)).max())
        bound = max(tolerance, 1e-2) if want.dtype in (torch.bfloat16, torch.float16) else tolerance
        return None if not exact and apart <= bound else f"{where}: values {apart:.3g} apart (relative)"
    if isinstance(want, float):
        if got == want:
            return None
        apart = abs(got - want) / max(1.0, abs(want)) if isinstance(got, float) else math.inf
        return None if not exact and apart <= tolerance else f"{where}: {got!r} != {want!r}"
    return None if got == want else f"{where}: {got!r} != {want!r}"


# -- memory -------------------------------------------------------------------------------------------------------


class Memory:
    """Resident memory of the server's process tree and of this process (and its other children), sampled every
    ``every`` seconds in a thread from construction until `stop`: `samples` holds ``(seconds, {series: bytes})``."""

    def __init__(self, server_pid: int, every: float = 0.5) -> None:
        import psutil

        self.server, self.me = psutil.Process(server_pid), psutil.Process()
        self.started = time.monotonic()
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._sample, args=(every,), name="soak-memory", daemon=True)
        self.thread.start()

    def now(self) -> dict[str, int]:
        """Each series' bytes now: ``server``, ``client`` and, where this process has other children, ``client
        children``, each as resident memory (RSS) and as its private part (``... private``: RSS less pages shared
        with other processes or backed by files, i.e. the anonymous memory a leak grows)."""
        import psutil

        def rss(processes) -> tuple[int, int]:
            total = private = 0
            for process in processes:
                try:
                    info = process.memory_info()
                except psutil.Error:  # it ended meanwhile
                    continue
                total += info.rss
                private += info.rss - getattr(info, "shared", 0)  # Linux: shared = RssFile + RssShmem
            return total, private

        def tree(process) -> list:
            try:
                return [process, *process.children(recursive=True)]
            except psutil.Error:
                return [process]

        server = tree(self.server)
        ours = {process.pid for process in server}
        # The server is one of this process' children too (it started it): counted as the server only.
        children = [process for process in tree(self.me)[1:] if process.pid not in ours]
        series = {"server": server, "client": [self.me], **({"client children": children} if children else {})}
        out = {}
        for name, processes in series.items():
            out[name], out[f"{name} private"] = rss(processes)
        return out

    def sample(self) -> tuple[float, dict[str, int]]:
        taken = (round(time.monotonic() - self.started, 3), self.now())
        self.samples.append(taken)
        return taken

    def _sample(self, every: float) -> None:
        while not self.stopping.wait(every):
            self.sample()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()


def levelled(rounds: list[dict], bound_mib: float) -> dict[str, dict]:
    """Per series: MiB at the soak's start and at its end, growth over the second half of the rounds (end of the
    middle round to end of the last), the least-squares slope there in MiB per 1,000 requests, and, for the private
    series (`judged`), whether the growth is within ``bound_mib`` (None for the others). ``rounds[0]`` is the state
    before the first round, each later one a round's end."""
    middle = (len(rounds) - 1) // 2
    verdict = {}
    for series in (name for name in rounds[-1]["memory"] if all(name in each["memory"] for each in rounds)):
        half = [(each["requests_so_far"], each["memory"][series] / MIB) for each in rounds[middle:]]
        xs, ys = [x for x, _ in half], [y for _, y in half]
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        spread = sum((x - mean_x) ** 2 for x in xs)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in half) / spread * 1000 if spread else 0.0
        growth = ys[-1] - ys[0]
        verdict[series] = {"start_mib": round(rounds[0]["memory"][series] / MIB, 1), "end_mib": round(ys[-1], 1),
                           "peak_mib": round(max(each["memory"][series] for each in rounds) / MIB, 1),
                           "second_half_growth_mib": round(growth, 2),
                           "second_half_slope_mib_per_1000": round(slope, 2),
                           "bound_mib": bound_mib if judged(series) else None,
                           "levelled": growth <= bound_mib if judged(series) else None}
    return verdict


def judged(series: str) -> bool:
    """Whether memory must level off in ``series``: private memory, where a leak lands. Total RSS also counts the
    shared-memory chunks of the engine's capture arena (`vlenvoys.engine.handover`), which fill front to back, 64 MiB each,
    before they are reused: reported and plotted, not judged."""
    return series.endswith(" private")


def levels_off(verdict: dict[str, dict]) -> bool:
    return all(each["levelled"] for each in verdict.values() if each["levelled"] is not None)


# -- traces through the Python API ------------------------------------------------------------------------------


def traced(model: Any, prompt: str, layers: int, steps: int, steer: tuple | None) -> list[list[torch.Tensor]]:
    """Each of ``steps`` steps' ``layer_output`` of every block, then its logits; ``model.steer(*steer)`` at each step,
    at its block before that block's read (a trace reads and writes in the order the model computes).

    A function of its own, not a method: the block's locals go to the engine's process, which could not import a
    `Traces` of this file when it is loaded by its path (the CI test's).
    """
    steered = steer[0] if steer is not None else -1
    with model.trace(prompt, temperature=0.0, max_tokens=steps, ignore_eos=True) as tracer:
        got = list().save()
        for _ in tracer.iter[0:steps]:
            step = []
            for layer in range(layers):
                if layer == steered:
                    model.steer(*steer)
                step.append(model.layers[layer].layer_output)
            step.append(model.logits)
            got.append(step)
    return [[value.cpu() for value in step] for step in got]


class Traces:
    """Python-API work on an in-process engine (``model``, from `vlenvoys.load`) of the served checkpoint: for each
    of ``prompts``, a trace reading every block's stream and the logits over ``steps`` steps, the same steered at a
    block, and `vlenvoys.generate` of it beside the next prompt, steered. `alone` runs each once for its reference;
    `one` runs a drawn one and compares."""

    def __init__(self, model: Any, prompts: list[str], hidden: int, layers: int, steps: int = 3, seed: int = 0) -> None:
        self.model, self.layers, self.steps = model, layers, steps
        draw = random.Random(seed)
        self.jobs: dict[str, Callable[[], Any]] = {}
        for number, prompt in enumerate(prompts):
            steer = (draw.randrange(layers), torch.tensor(vector(1000 + number, hidden)), draw.choice((-1.5, 2.0)))
            other = prompts[(number + 1) % len(prompts)]
            self.jobs[f"trace-{number}"] = lambda prompt=prompt: self.traced(prompt, None)
            self.jobs[f"trace-steered-{number}"] = lambda prompt=prompt, steer=steer: self.traced(prompt, steer)
            self.jobs[f"generate-steered-{number}"] = lambda prompt=prompt, other=other, steer=steer: self.generated(
                [prompt, other], steer)
        self.wanted: dict[str, Any] = {}

    def traced(self, prompt: str, steer: tuple | None) -> list[list[torch.Tensor]]:
        return traced(self.model, prompt, self.layers, self.steps, steer)

    def generated(self, prompts: list[str], steer: tuple) -> list[list[tuple[int, float]]]:
        """`vlenvoys.generate` of ``prompts`` in one call, the first steered: each one's (token, log-probability)."""
        import vlenvoys
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=self.steps, ignore_eos=True, logprobs=1)
        layer, direction, factor = steer
        outputs = vlenvoys.generate(self.model, prompts, params, progress=False,
                                    steering=[vlenvoys.Steering(layer, direction, factor), None])
        return [[(token, step[token].logprob) for token, step in zip(each.token_ids, each.logprobs, strict=True)]
                for each in (done.outputs[0] for done in outputs)]

    def alone(self) -> None:
        for name, job in self.jobs.items():
            self.wanted[name] = job()

    def one(self, name: str) -> Any:
        return self.jobs[name]()


# -- the soak -----------------------------------------------------------------------------------------------------


class Soak:
    """Requests of ``pool`` on the server at ``url`` (serving ``model``), from an event loop in a thread of its own,
    so that the main thread can run ``traces`` meanwhile. `references` runs each pool request (and trace) alone;
    `run` sends the drawn requests in rounds. Use as a context manager (the loop and its clients are closed after).

    ``exact``: compare bit for bit (the CPU engine), else within ``tolerance`` (see `difference`).
    """

    def __init__(self, url: str, model: str, pool: list[Request], *, api_key: str | None = None, concurrency: int = 32,
                 timeout: float = 120.0, memory: Memory | None = None, traces: Traces | None = None,
                 exact: bool = True, tolerance: float = 0.0, traces_a_request: float = 0.5, settle: float = 1.0,
                 log: Callable[[str], None] = print):
        self.url, self.model, self.pool, self.api_key = url, model, {request.name: request for request in pool}, api_key
        self.concurrency, self.timeout, self.memory, self.traces = concurrency, timeout, memory, traces
        self.exact, self.tolerance, self.settle, self.log = exact, tolerance, settle, log
        self.traces_a_request = traces_a_request
        self.wanted: dict[str, Outcome] = {}
        #: Requests of the round under way answered so far (the trace thread keeps pace with it).
        self.answered = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="soak-client", daemon=True)
        self.thread.start()
        self.clients = self.wait(self._open())

    def __enter__(self) -> Soak:
        return self

    def __exit__(self, *exc: object) -> None:
        self.wait(self._close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()

    def submit(self, coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def wait(self, coroutine) -> Any:
        return self.submit(coroutine).result()

    async def _open(self) -> tuple:
        import httpx
        from openai import AsyncOpenAI

        # vLLM's server closes a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE), and httpx kept one for 5 s
        # too: a request sent on it as the server closed it was lost ("Server disconnected without sending a
        # response", once in CI while traces held the client's thread). Idle connections go well before that.
        limits = httpx.Limits(max_connections=self.concurrency + 4, keepalive_expiry=1.0)
        client = AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "EMPTY", max_retries=0,
                             timeout=self.timeout, http_client=httpx.AsyncClient(timeout=self.timeout, limits=limits))
        return client, httpx.AsyncClient(timeout=self.timeout, limits=limits)

    async def _close(self) -> None:
        client, http = self.clients
        await client.close()
        await http.aclose()

    async def _send(self, request: Request) -> Outcome:
        client, http = self.clients
        return await asyncio.wait_for(send(client, http, self.url, self.model, request, self.api_key), self.timeout)

    def references(self) -> None:
        """Each pool request alone, one at a time, then each trace: what every later run must give."""
        for name, request in self.pool.items():
            self.wanted[name] = self.wait(self._send(request))
        if self.traces is not None:
            self.traces.alone()

    async def _round(self, names: list[str]) -> dict:
        """``names`` sent ``concurrency`` at a time, each compared with its reference as it comes back."""
        lost: list[str] = []
        differing: list[str] = []
        waiting = iter(names)
        tokens = 0

        async def worker() -> None:
            nonlocal tokens
            for name in waiting:  # shared: each worker takes the next name when its request is answered
                try:
                    got = await self._send(self.pool[name])
                except Exception as error:  # noqa: BLE001 - any failure is a lost request, counted and named
                    lost.append(f"{name}: {type(error).__name__}: {str(error)[:300]}")
                    continue
                finally:
                    self.answered += 1
                tokens += len(got.tokens)
                found = difference(got, self.wanted[name], self.exact, self.tolerance)
                if found:
                    differing.append(f"{name}: {found}")

        await asyncio.gather(*(worker() for _ in range(self.concurrency)))
        return {"lost": lost, "differing": differing, "tokens": tokens}

    def _traces_while(self, busy: concurrent.futures.Future, draw: random.Random) -> tuple[int, list[str]]:
        """Traces in this thread while ``busy`` (a round) runs, ``traces_a_request`` for each request answered so
        far: how many ran, and which differed. Paced by the requests, not back to back: this thread's Python work
        shares the interpreter with the client's event loop, and unpaced traces once held a round of 50 requests
        to 58 s (3,553 traces) where another took 4 s (2 traces)."""
        ran, differing = 0, []
        names = sorted(self.traces.jobs) if self.traces is not None else []
        while names and not busy.done():
            if ran >= self.answered * self.traces_a_request:
                time.sleep(0.01)
                continue
            name = draw.choice(names)
            try:
                found = difference(self.traces.one(name), self.traces.wanted[name], self.exact, self.tolerance)
            except Exception as error:  # noqa: BLE001 - a failed trace is a difference, named
                found = f"{type(error).__name__}: {str(error)[:300]}"
            ran += 1
            if found:
                differing.append(f"{name}: {found}")
        return ran, differing

    def _settled(self) -> dict[str, int]:
        gc.collect()
        time.sleep(self.settle)
        return self.memory.sample()[1] if self.memory is not None else {}

    def run(self, requests: int, rounds: int, seed: int = 0) -> dict:
        """``requests`` drawn from the pool (seeded), in ``rounds`` rounds of about equal size.

        Returns ``{"rounds": [...], "lost": [...], "differing": [...], "requests": n, "traces": n}``; ``rounds[0]``
        is the state before the first round (memory only), each later entry a round's figures and its end's memory.
        """
        if not self.wanted:
            self.references()
        draw = random.Random(seed)
        names = sorted(self.pool)
        drawn = [draw.choice(names) for _ in range(requests)]
        edges = [requests * number // rounds for number in range(rounds + 1)]
        state = [{"round": 0, "requests_so_far": 0, "seconds_at": self._time(), "memory": self._settled()}]
        lost, differing, traces = [], [], 0
        for number in range(1, rounds + 1):
            began = time.monotonic()
            self.answered = 0
            busy = self.submit(self._round(drawn[edges[number - 1]:edges[number]]))
            ran, traced_differing = self._traces_while(busy, draw)
            done = busy.result()
            seconds = time.monotonic() - began
            lost += done["lost"]
            differing += done["differing"] + traced_differing
            traces += ran
            state.append({"round": number, "requests": edges[number] - edges[number - 1],
                          "requests_so_far": edges[number], "lost": len(done["lost"]),
                          "differing": len(done["differing"]), "traces": ran, "traces_differing": len(traced_differing),
                          "tokens": done["tokens"], "seconds": round(seconds, 2), "seconds_at": self._time(),
                          "memory": self._settled()})
            self.log(row_line(state[-1]))
        return {"rounds": state, "lost": lost, "differing": differing, "requests": requests, "traces": traces}

    def _time(self) -> float:
        return round(time.monotonic() - self.memory.started, 3) if self.memory is not None else 0.0


def row_line(entry: dict) -> str:
    memory = ", ".join(f"{series} {amount / MIB:.1f} MiB" for series, amount in entry["memory"].items())
    return (f"round {entry['round']}: {entry['requests']} requests in {entry['seconds']:.1f} s, {entry['lost']} lost, "
            f"{entry['differing']} differing, {entry['traces']} traces ({entry['traces_differing']} differing); "
            f"{memory}")


# -- the report ---------------------------------------------------------------------------------------------------


def plot(result: dict, path: Path) -> None:
    """Memory over time as MiB above each series' value at the soak's start (so that one scale shows tens of MiB on
    top of gigabytes): the server's above, the client's below; solid RSS, dashed private; round ends marked."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    # The soak's own span: not the references before it, nor the engines' shutdown after it.
    begin, end = result["rounds"][0]["seconds_at"], result["rounds"][-1]["seconds_at"]
    samples = [(at, values) for at, values in result["samples"] if begin <= at <= end]
    first = result["rounds"][0]["memory"]
    figure, (top, bottom) = pyplot.subplots(2, 1, sharex=True, figsize=(10, 7))
    seconds = [at - begin for at, _ in samples]
    for axes, names in ((top, ["server"]), (bottom, ["client", "client children"])):
        for number, name in enumerate(names):
            for series, style in ((name, "-"), (f"{name} private", "--")):
                if series not in first:
                    continue
                axes.plot(seconds, [(values.get(series, math.nan) - first[series]) / MIB for _, values in samples],
                          ls=style, lw=1.2, color=f"C{number}",
                          label=f"{series}{'' if style == '--' else ' RSS'} (start {first[series] / MIB:,.0f} MiB)")
        for entry in result["rounds"]:
            axes.axvline(entry["seconds_at"] - begin, color="grey", lw=0.6, ls=":")
        axes.axhline(0, color="black", lw=0.5)
        axes.set_ylabel("MiB above the start")
        axes.legend(loc="best", fontsize=8)
        axes.grid(alpha=0.3)
    for entry in result["rounds"]:
        top.annotate("start" if entry["round"] == 0 else f"r{entry['round']}", (entry["seconds_at"] - begin, 1.0),
                     xycoords=("data", "axes fraction"), xytext=(2, -10), textcoords="offset points", fontsize=8,
                     color="grey")
    top.set_title("server: the HTTP process and its engine's processes", fontsize=10)
    bottom.set_title("client: the soak's process (children: its in-process engine, for the traces)", fontsize=10)
    bottom.set_xlabel("seconds since the first round began (dotted: the end of each round)")
    verdict = result["memory"]
    judged_lines = ", ".join(f"{name} {each['second_half_growth_mib']:+.1f} MiB" for name, each in verdict.items()
                             if each["levelled"] is not None)
    model = MODELS.get(result["model"], result["model"])
    figure.suptitle(f"vlenvoys serve soak: {result['requests']:,} requests ({len(result['lost'])} lost, "
                    f"{len(result['differing'])} differing), {result['traces']:,} traces; {model} on "
                    f"{result['device']} at {result['commit']}\nsecond half: {judged_lines} (bound "
                    f"{result['bound_mib']:g} MiB each)", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)


def table(result: dict) -> str:
    from tabulate import tabulate

    series = list(result["rounds"][-1]["memory"])
    rows = [[entry["round"] or "start", *(entry.get(key, "") for key in ("requests", "lost", "differing", "traces",
                                                                           "seconds")),
             *(f"{entry['memory'][name] / MIB:.1f}" for name in series)] for entry in result["rounds"]]
    rounds = tabulate(rows, headers=["round", "requests", "lost", "differing", "traces", "seconds",
                                     *(f"{name} MiB" for name in series)])
    verdict = tabulate([[name, each["start_mib"], each["end_mib"], each["peak_mib"], each["second_half_growth_mib"],
                         each["second_half_slope_mib_per_1000"], each["bound_mib"] or "",
                         {True: "yes", False: "NO", None: "(not judged)"}[each["levelled"]]]
                        for name, each in result["memory"].items()],
                       headers=["memory", "start MiB", "end MiB", "peak MiB", "2nd-half growth", "MiB/1000 req",
                                "bound", "levels off"])
    return f"{rounds}\n\n{verdict}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="'tiny' (the tiny random Llama, default), '1b' (bench.py's "
                        "random Llama of a 1B shape in bfloat16, for a GPU) or a checkpoint folder")
    parser.add_argument("--requests", type=int, default=2000, help="requests drawn from the pool (default 2000)")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight (default 32)")
    parser.add_argument("--rounds", type=int, default=8, help="rounds the requests are sent in (default 8)")
    parser.add_argument("--pool", type=int, default=12, help="distinct requests of each kind (default 12)")
    parser.add_argument("--traces", action=argparse.BooleanOptionalAction, default=True,
                        help="traces on an in-process engine of the same checkpoint meanwhile (default on)")
    parser.add_argument("--traces-a-request", type=float, default=0.5, help="traces run for each request answered "
                        "(default 0.5)")
    parser.add_argument("--bound", type=float, default=BOUND_MIB, help=f"MiB a series may grow over the second half "
                        f"of the rounds (default {BOUND_MIB:g})")
    parser.add_argument("--onednn-cache", default="0", help="oneDNN's primitive cache capacity on the CPU "
                        "(ONEDNN_PRIMITIVE_CACHE_CAPACITY) for both engines: 0 (default) caches none, so that its "
                        "filling does not hide a leak; 'default' leaves oneDNN's 1024 (see the module's docstring)")
    parser.add_argument("--every", type=float, default=0.5, help="seconds between memory samples (default 0.5)")
    parser.add_argument("--seed", type=int, default=0, help="draws the pool and the requests (default 0)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="folder of the JSON and PNG")
    options = parser.parse_args()
    if options.rounds < 2:
        parser.error("--rounds: at least 2 (memory is judged over the second half of the rounds)")

    if options.onednn_cache != "default":
        # Read by oneDNN when an engine's process loads it: set before the server and the traces' engine start.
        os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(int(options.onednn_cache))
    import functools

    import tqdm
    import vlenvoys  # noqa: F401 - defines anyio's classes before the openai client's (vlenvoys.serve.server.anyio_classes_first)

    # vLLM draws two progress bars for every trace (model.trace takes no use_tqdm), which would bury the rounds'
    # lines: drawn into nothing (not disabled: vLLM divides by a disabled bar's elapsed time, 0).
    tqdm.tqdm.__init__ = functools.partialmethod(tqdm.tqdm.__init__, file=open(os.devnull, "w"))  # noqa: SIM115
    from safetensors.torch import save_file
    from transformers import AutoConfig
    from vlenvoys_testing import server, tiny_model
    from vlenvoys_testing.conformance import BF16_TOLERANCE, TOLERANCE

    cuda = torch.cuda.is_available()
    folder = Path(tempfile.mkdtemp(prefix="vlenvoys-soak-"))
    if options.model == "tiny":
        path = tiny_model("LlamaForCausalLM", folder / "tiny-llama")
    elif options.model == "1b":
        from bench import cuda_checkpoint

        path = cuda_checkpoint("1b")
    else:
        path = Path(options.model)
    config = AutoConfig.from_pretrained(path).get_text_config()
    hidden, layers = config.hidden_size, config.num_hidden_layers
    dtype = str(getattr(config, "torch_dtype", None) or getattr(config, "dtype", "float32")).removeprefix("torch.")
    tolerance = 0.0 if not cuda else BF16_TOLERANCE if dtype in ("bfloat16", "float16") else TOLERANCE
    # Named as the CI server's vectors are (`VECTORS`): a vector and its opposite.
    save_file({"up": torch.tensor(vector(0, hidden)), "down": -torch.tensor(vector(0, hidden))},
              str(folder / "vectors.safetensors"))
    key = "soak-key"
    arguments = ["--api-key", key, "--max-model-len", "256", "--served-model-name", "soak", "--enforce-eager",
                 "--vectors", str(folder / "vectors.safetensors"),
                 # On a GPU the in-process engine of --traces shares the device.
                 *(["--gpu-memory-utilization", "0.4", "--kv-cache-memory-bytes", str(4 << 30)] if cuda else [])]
    pool = make_pool(options.pool, hidden, layers, options.seed)
    commit, device = checkout(), card_name()
    print(f"soak of {options.requests} requests ({len(pool)} distinct), {options.concurrency} in flight, "
          f"{options.rounds} rounds, on {path} ({dtype}, {device}) at {commit}", flush=True)
    with server(path, folder / "server.log", *arguments, started_within=600) as started:
        memory = Memory(started["pid"], options.every)
        with _engine(path, options.traces) as model:
            traces = Traces(model, texts(4, options.seed + 1), hidden, layers, seed=options.seed) if model else None
            with Soak(started["url"], "soak", pool, api_key=key, concurrency=options.concurrency, memory=memory,
                      traces=traces, exact=not cuda, tolerance=tolerance,
                      traces_a_request=options.traces_a_request) as soak:
                began = time.monotonic()
                soak.references()
                print(f"references: {len(pool)} requests and {len(traces.jobs) if traces else 0} traces alone in "
                      f"{time.monotonic() - began:.1f} s", flush=True)
                done = soak.run(options.requests, options.rounds, options.seed)
        memory.stop()
    result = {"commit": commit, "device": torch.cuda.get_device_name() if cuda else "CPU", "model": options.model,
              "dtype": dtype, "concurrency": options.concurrency, "pool": len(pool), "exact": not cuda,
              "tolerance": tolerance, "onednn_cache": options.onednn_cache, "bound_mib": options.bound, **done,
              "memory": levelled(done["rounds"], options.bound),
              "samples": [[at, values] for at, values in memory.samples]}
    failed = bool(done["lost"] or done["differing"]) or not levels_off(result["memory"])
    result["passed"] = not failed
    options.out.mkdir(parents=True, exist_ok=True)
    stem = options.out / f"soak-{commit}-{device}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, stem.with_suffix(".png"))
    print(f"\n{table(result)}\n")
    for line in (done["lost"] + done["differing"])[:20]:
        print(f"  {line}")
    print(f"{done['requests']} requests: {len(done['lost'])} lost, {len(done['differing'])} differing from alone; "
          f"{done['traces']} traces; private memory {'levels off' if levels_off(result['memory']) else 'GROWS'}. "
          f"Wrote {stem}.json and .png", flush=True)
    return 1 if failed else 0


def _engine(path: Path, wanted: bool):
    """The in-process engine for traces (`vlenvoys_testing.oracle.engine`: small KV cache, a small GPU share), or None."""
    import contextlib

    if not wanted:
        return contextlib.nullcontext(None)
    from vlenvoys_testing.oracle import engine

    return engine(str(path))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
