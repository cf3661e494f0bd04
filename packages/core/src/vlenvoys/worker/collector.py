"""Values of many requests read at once: one hook per module per step, each request's rows sliced out.

A trace, or a block installed on the engine, reads a value once per request:
nnsight runs one worker per request per step and hands it that request's rows.
With many short requests in a step, that per-request machinery costs more than
the forward (measured on an H200: `collect` at 0.09 of plain vLLM). A
`Collector` instead puts one torch hook on each module a read needs; the hook
sees the whole step's flat tensor, computes the value once with the value's own
declaration (`Flat.pick`: the same halves summed, the same factor), and keeps
each of its requests' rows, copied off the device as they are read. No nnsight
worker runs for these requests, and nothing is written back: the step's other
requests are untouched.

The client names a collector in a request's ``SamplingParams.extra_args``
(`vlenvoys.wire.requests.COLLECT_KEY`); the worker learns which requests are whose from each step's new
requests, and which rows are whose from the step's spans (the runner's batch
order, as nnsight's own batcher uses). A request's rows may come in several
steps (chunked prefill); they are joined when the client takes them, and a
request that comes back with fewer rows than its prompt (a prefix-cache hit
would skip the forward over the cached tokens) is refused by name, never served
short. A request vLLM preempts and recomputes runs its positions again: the rows
already read are skipped then, never read twice.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from ..values.layouts import unavailable_reason
from ..values.names import KINDS, Read, envoy_of
from ..values.reads import located, unhookable_reads
from ..values.support import envoy_rows
from ..wire.requests import COLLECT_GENERATED_KEY, COLLECT_ID_KEY, COLLECT_KEY
from .arena import Piece, worker_arena

__all__ = [
    "Collector", "capturable", "close_arena", "count", "start", "start_checked", "stats", "step_spans", "stop", "take",
]

#: How many ids taken before their request was admitted a collector remembers (to ignore that request).
FORGOTTEN = 4096

#: Copies' event pairs a worker keeps before it counts those that have passed (`Spent`).
TIMED = 4096

class Spent:
    """Worker side: time its collections took from the forward and the engine, for benchmarks (`stats`).

    ``hooks``: seconds in the hooks (slicing a step's rows, copying them off the
    device, which a CPU engine does there and a GPU queues, making a chunk
    where none is free). ``takes``: seconds answering takes,
    which the engine's process waits for between two steps. ``copies``: on a
    GPU, seconds the copies off the device took on their own stream (beside
    the forward's kernels), timed by CUDA events and counted once both have passed.
    """

    def __init__(self) -> None:
        self.hooks = self.takes = self.copies = 0.0
        self.timed: list[tuple[Any, Any]] = []  # (event before a copy, event after it), not yet counted

    def count_copies(self) -> None:
        """Add the copies whose end has passed on the device to ``copies`` (they pass in order: one stream)."""
        passed = 0
        for begun, ended in self.timed:
            if not ended.query():
                break
            self.copies += begun.elapsed_time(ended) / 1000
            passed += 1
        del self.timed[:passed]

    def seconds(self) -> dict[str, float]:
        self.count_copies()
        return {"hook_seconds": self.hooks, "take_seconds": self.takes, "copy_seconds": self.copies}


def spent(runner: Any) -> Spent:
    """The worker's one `Spent`, kept for its life."""
    if getattr(runner, "vlenvoys_spent", None) is None:
        runner.vlenvoys_spent = Spent()
    return runner.vlenvoys_spent


class Collector:
    """Worker side: the reads of one collect run, served by forward hooks over the whole step."""

    def __init__(self, runner: Any, reads: Sequence[Read], name: str = "collector") -> None:
        model = runner.nnsight_model
        envoys = {envoy.path: envoy for envoy in model.modules()}
        self.runner = runner
        #: request id (the engine's) -> its prompt's length, for the requests that name this collector.
        self.prompts: dict[str, int] = {}
        #: request id -> how many rows it reads at most (its prompt's, and its decode steps' where `COLLECT_GENERATED_KEY`).
        self.limits: dict[str, int] = {}
        #: request id -> why its rows are not served (a decode-step row that came out of place).
        self.broken: dict[str, str] = {}
        #: the caller's request id -> the engine's (vLLM suffixes ids on the way in).
        self.engine_ids: dict[str, str] = {}
        #: caller ids taken before their request came (a server's request aborted early): not admitted then.
        self.forgotten: dict[str, None] = {}
        #: request id -> value key -> where its rows read so far lie, in step order (`vlenvoys.worker.arena.Piece`).
        self.rows: dict[str, dict[str, list[Piece]]] = {}
        #: request id -> value key -> how many rows were read.
        self.seen: dict[str, dict[str, int]] = {}
        self.layouts: dict[str, tuple[Any, Any]] = {}
        #: value key -> (row shape, dtype name), from its first rows.
        self.row_layouts: dict[str, tuple[list[int], str]] = {}
        #: request id -> the CUDA event recorded after the last copy of its rows off the device (GPU engines).
        self.copied: dict[str, Any] = {}
        self.handles: list[Any] = []
        self.name = name
        #: The worker's host memory the rows are copied into, which the client maps (`vlenvoys.worker.arena`).
        self.arena = worker_arena(runner)
        self.spent = spent(runner)
        for read in reads:
            envoy, value = located(model, read)
            key = f"{read[2]}.{read[0]}"
            self.layouts[key] = (envoy, value)
            path, side = value._location(envoy).rsplit(".", 1)
            module = envoys[path]._module
            self.handles.append(self._hook(module, side, key, envoy, value))

    def _hook(self, module: torch.nn.Module, side: str, key: str, envoy: Any, value: Any) -> Any:
        def read(raw: Any) -> None:
            spans = self.spans(key)
            if not spans:
                return
            began = time.perf_counter()
            tensor = value.pick(envoy, raw)
            if value._batch(envoy):  # vLLM's transformers backend: [1, tokens, ...]
                tensor = tensor[0]
            # One copy off the device per module per step, whatever the number of requests:
            # a copy per request costs more than the forward on a GPU.
            first, end = spans[0][1], spans[-1][1] + spans[-1][2]
            if end - first == sum(count for _, _, count in spans):  # one run of rows (collect's requests side by side)
                rows = tensor.narrow(0, first, end - first)
            else:
                rows = torch.cat([tensor.narrow(0, start, count) for _, start, count in spans])
            host, chunk, offset = self.arena.block(rows.shape, rows.dtype, holders=len(spans))
            copied = None
            if self.arena.device_copies:
                copied = self._copy_off_device(host, rows)
            else:
                host.copy_(rows)
            if key not in self.row_layouts:
                self.row_layouts[key] = (list(rows.shape[1:]), str(rows.dtype).removeprefix("torch."))
            row_bytes = rows[0].numel() * rows.element_size()
            for request, _, count in spans:
                self.rows[request].setdefault(key, []).append((chunk, offset, count))
                self.seen[request][key] = self.seen[request].get(key, 0) + count
                offset += count * row_bytes
                if copied is not None:
                    self.copied[request] = copied
            self.spent.hooks += time.perf_counter() - began

        if side == "input":
            return module.register_forward_pre_hook(lambda module, args, kwargs: read((args, kwargs)), with_kwargs=True)
        return module.register_forward_hook(lambda module, args, kwargs, output: read(output), with_kwargs=True)

    def _copy_off_device(self, host: torch.Tensor, rows: torch.Tensor) -> Any:
        """Queue the copy of ``rows`` into ``host`` (pinned) on the worker's copy stream; the event after it.

        On the forward's own stream the copy held every kernel after it until it was done. On a stream of its
        own it overlaps the rest of the forward: the rows are first copied on the device (fast), as the next
        kernels may write over the module's output in place, and the copy stream waits for that; `take` waits
        for the event.
        """
        staged = rows.clone()
        stream = copy_stream(self.runner)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            copying = torch.cuda.Event(enable_timing=True)
            copying.record()
            host.copy_(staged, non_blocking=True)
            copied = torch.cuda.Event(enable_timing=True)
            copied.record()
        staged.record_stream(stream)  # its device memory is not reused before the copy has read it
        self.spent.timed.append((copying, copied))
        if len(self.spent.timed) > TIMED:  # nobody took for a while (a server between requests)
            self.spent.count_copies()
        return copied

    def spans(self, key: str) -> list[tuple[str, int, int]]:
        """This step's rows of this collector's requests not yet read at ``key``: (request id, first row, rows).

        Prompt rows only, unless the request asked for its decode steps' too
        (`COLLECT_GENERATED_KEY`): then a row past the position after the last one read
        (a gap) leaves the request's rows unserved (`broken`). Rows at positions
        read already (a request recomputed after a preemption) are skipped.
        """
        mine = []
        positions = getattr(self.runner, "vlenvoys_positions", {})
        for request, start, count in getattr(self.runner, "vlenvoys_spans", ()):
            if request not in self.prompts or request in self.broken:
                continue
            seen = self.seen[request].get(key, 0)
            position = positions.get(request, seen)
            if position < seen:
                # vLLM preempted the request (its key/value blocks went to others) and now recomputes it from
                # `position`: the rows before `seen` were read already, so this step's first rows are skipped
                # (never read twice; the rows read first are kept).
                skipped = min(count, seen - position)
                start, count = start + skipped, count - skipped
            count = min(count, self.limits[request] - seen)
            if count > 0 and self.limits[request] > self.prompts[request] and position > seen:
                # Rows the engine ran without hooks (decode steps replayed as CUDA graphs): a gap.
                self.broken[request] = (
                    f"{key}: the engine ran position {position} after {seen} rows read (decode steps replayed as "
                    "CUDA graphs run no hooks)"
                )
                continue
            if count > 0:
                mine.append((request, start, count))
        return mine

    def admit(self, request: str, prompt_length: int, caller_id: str | None = None, generated: int = 0) -> None:
        """Read ``request``'s prompt rows from now on, and its first ``generated`` decode steps' rows; the
        caller takes them by ``caller_id`` (`COLLECT_ID_KEY`), or by the id it gave the engine (``request`` less vLLM's suffix)."""
        from nnsight.modeling.vllm.model_runners.GPUModelRunner import Request

        caller_id = Request(request).stem if caller_id is None else caller_id
        if self.forgotten.pop(caller_id, False) is None:
            return  # its caller has gone: nobody would take its rows
        self.prompts[request] = prompt_length
        self.limits[request] = prompt_length + generated
        self.rows[request] = {}
        self.seen[request] = {}
        self.engine_ids[caller_id] = request

    def take(self, requests: Sequence[str]) -> dict[str, Any]:
        """Finished requests' values, handed over (`vlenvoys.wire.shm`): where each request's rows lie.

        Returns ``{"order": [caller ids], "missing": {caller id: why it has no
        values}, "prompts": {caller id: prompt length}, **Arena.handover(...)}``:
        per value key, one list of pieces per id in ``order``.
        """
        began = time.perf_counter()
        try:
            self.spent.count_copies()
            return self._take(requests)
        finally:
            self.spent.takes += time.perf_counter() - began

    def _take(self, requests: Sequence[str]) -> dict[str, Any]:
        # The client maps each handover before it calls again: what it was given before may be reused.
        self.arena.acknowledge(self.name)
        order, missing, dropped, prompts = [], {}, [], {}
        pieces: dict[str, list[list[Piece]]] = {key: [] for key in self.layouts}
        # The copies off the device were queued on the copy stream, each behind the forward that made its rows:
        # a finished request's have mostly landed by now. These waits are for its own copies alone: unlike a
        # synchronize, they do not wait for the step the engine has queued since (asynchronous scheduling).
        engine_ids = [self.engine_ids.pop(caller_id, caller_id) for caller_id in requests]
        for caller_id, request in zip(requests, engine_ids, strict=True):
            if request not in self.prompts:  # not admitted (yet): if it comes later, it is not read
                self.forgotten[caller_id] = None
        while len(self.forgotten) > FORGOTTEN:
            del self.forgotten[next(iter(self.forgotten))]
        events = (self.copied.pop(request, None) for request in engine_ids)
        for event in {id(event): event for event in events if event is not None}.values():
            event.synchronize()
        for caller_id, request in zip(requests, engine_ids, strict=True):
            length, rows = self.prompts.pop(request, None), self.rows.pop(request, None)
            seen, broken = self.seen.pop(request, {}), self.broken.pop(request, None)
            self.limits.pop(request, None)
            if rows is None:
                missing[caller_id] = "the engine has no values of this request (it never ran here)"
                continue
            if broken is not None:
                missing[caller_id] = broken
                dropped.extend(piece for each in rows.values() for piece in each)
                continue
            short = [key for key in self.layouts if seen.get(key, 0) < length]
            if short:
                missing[caller_id] = (
                    f"{short[0]}: {seen.get(short[0], 0)} of the prompt's {length} rows were computed (a prefix-cache "
                    "hit skips the cached tokens' forward); run without prefix caching"
                )
                dropped.extend(piece for each in rows.values() for piece in each)
                continue
            order.append(caller_id)
            prompts[caller_id] = length
            for key in self.layouts:
                pieces[key].append(rows[key])
        self.arena.release(dropped)
        layouts = {key: self.row_layouts[key] for key in self.layouts if key in self.row_layouts}
        handed = self.arena.handover({key: each for key, each in pieces.items() if each}, layouts, owner=self.name)
        return {"order": order, "missing": missing, "prompts": prompts, **handed}

    def close(self) -> None:
        """Remove the hooks; rows never taken are dropped, and what was handed over may be reused."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if self.arena.device_copies:
            copies_done(self.runner)  # no copy may still be writing into a chunk let go
            self.spent.count_copies()
        self.arena.release([piece for values in self.rows.values() for each in values.values() for piece in each])
        self.arena.acknowledge(self.name)  # the client stops after it has mapped every handover
        self.prompts.clear()
        self.limits.clear()
        self.broken.clear()
        self.rows.clear()
        self.seen.clear()
        self.engine_ids.clear()
        self.forgotten.clear()
        self.copied.clear()


def step_spans(runner: Any, scheduler_output: Any) -> list[tuple[str, int, int]]:
    """Worker side, each step: admit new requests that name a collector; this step's (request, first row, rows).

    Rows follow the runner's batch order (``input_batch.req_ids``), as
    nnsight's batcher has them; `vlenvoys.worker.steerer` plans its rows from the same spans.
    """
    tokens = scheduler_output.num_scheduled_tokens
    batch = runner.input_batch
    rows = [(index, request) for index, request in enumerate(batch.req_ids) if request in tokens]
    computed = batch.num_computed_tokens_cpu
    return spans_of_rows(runner, scheduler_output, [request for _, request in rows],
                         [tokens[request] for _, request in rows], [computed[index] for index, _ in rows])


def spans_of_rows(
    runner: Any, scheduler_output: Any, requests: Sequence[str], tokens: Sequence[int], computed: Sequence[int]
) -> list[tuple[str, int, int]]:
    """`step_spans` from the step's rows as the runner orders them: each scheduled request, its token count and
    its tokens computed before this step (V1's condensed batch, or the V2 runner's own `InputBatch`)."""
    collectors = getattr(runner, "vlenvoys_collectors", None)
    if collectors:
        for data in scheduler_output.scheduled_new_reqs:
            extra = getattr(data.sampling_params, "extra_args", None) or {}
            name = extra.get(COLLECT_KEY)
            if name in collectors:
                # The last token sampled is never fed back: max_tokens - 1 decode steps at most.
                generated = 0
                if extra.get(COLLECT_GENERATED_KEY):
                    generated = max(0, (data.sampling_params.max_tokens or 1) - 1)
                collectors[name].admit(data.req_id, len(data.prompt_token_ids), extra.get(COLLECT_ID_KEY), generated)
    spans, start = [], 0
    for request, count in zip(requests, tokens, strict=True):
        spans.append((request, start, int(count)))
        start += int(count)
    if collectors:
        # Where each request's rows of this step start in its sequence (the runner's own positions).
        runner.vlenvoys_positions = {request: int(at) for request, at in zip(requests, computed, strict=True)}
    return spans


# -- the worker's RPCs (`vlenvoys.worker.runner.StandardWorker` calls these with itself) ----------


def copy_stream(runner: Any) -> Any:
    """The worker's CUDA stream for copies of rows off the device (`Collector._copy_off_device`), kept for its life."""
    if getattr(runner, "vlenvoys_copy_stream", None) is None:
        runner.vlenvoys_copy_stream = torch.cuda.Stream(device=runner.device)
    return runner.vlenvoys_copy_stream


def copies_done(runner: Any) -> None:
    """Wait until every copy off the device queued so far has landed in host memory."""
    torch.cuda.current_stream().synchronize()  # what the copy stream waits for
    stream = getattr(runner, "vlenvoys_copy_stream", None)
    if stream is not None:
        stream.synchronize()


def stats(worker: Any) -> dict[str, float]:
    """Since the worker began: its arena's `vlenvoys.worker.arena.Arena.stats` and the time its collections took (`Spent`).

    All zero before its first collection. For benchmarks: where a collection's time goes beside the forward's.
    """
    arena = getattr(worker.model_runner, "vlenvoys_arena", None)
    held = arena.stats() if arena is not None else {"chunks": 0, "bytes": 0, "made_bytes": 0, "made_seconds": 0.0}
    return {**held, **spent(worker.model_runner).seconds()}


def close_arena(worker: Any) -> None:
    """At the worker's shutdown: stop every collector, give every chunk up and remove the files."""
    for name in list(_collectors(worker)):
        stop(worker, name)
    arena = getattr(worker.model_runner, "vlenvoys_arena", None)
    if arena is not None:
        if arena.device_copies:
            copies_done(worker.model_runner)  # no copy may still be writing into a chunk let go
        arena.close()
        worker.model_runner.vlenvoys_arena = None


def _collectors(worker: Any) -> dict[str, Collector]:
    runner = worker.model_runner
    if not hasattr(runner, "vlenvoys_collectors"):
        runner.vlenvoys_collectors = {}
    return runner.vlenvoys_collectors


def start(worker: Any, name: str, reads: list[Read]) -> str:
    """Install a collector named ``name`` for ``reads``."""
    _collectors(worker)[name] = Collector(worker.model_runner, reads, name)
    return name


def start_checked(worker: Any, name: str, reads: list[Read]) -> dict[str, Any]:
    """Install a collector for ``reads`` if the model serves each of them on this path.

    Returns ``{"refused": why}`` (a value the family does not serve, or one no
    hook per module can read), or ``{"head_dims": {key: head_dim or None}}``:
    the width a head-split value's rows are cut by (`vlenvoys serve`, which has
    no envoy tree of its own to learn the layouts from).
    """
    model = worker.model_runner.nnsight_model
    head_dims = {}
    for read in reads:
        envoy, value = located(model, read)
        why = unavailable_reason(envoy, read[2])
        if why is None:
            why = unhookable_reads(model, [read])
            if why is not None:
                return {
                    "refused": f"{why}: capture reads values one hook per module per step; it can read "
                    f"{', '.join(capturable(model))}"
                }
        else:
            return {"refused": f"{read[2]} is not served on {type(envoy).__name__}: {why}"}
        head_dims[f"{read[2]}.{read[0]}"] = value._head_dim(envoy)
    start(worker, name, reads)
    return {"head_dims": head_dims}


def capturable(model: Any) -> list[str]:
    """The values of ``model``'s blocks this path reads (served by the family, one hook per module), by name."""
    block, names = model.layers[0], []
    for owner, kind in KINDS.items():
        envoy = envoy_of(block, owner)
        # support's rows of a loaded block: the values its family serves there (block 0's stand for every block)
        names += [
            row.value for row in envoy_rows(kind, type(envoy), envoy)
            if row.available and unhookable_reads(model, [(0, owner, row.value)]) is None
        ]
    return names


def take(worker: Any, name: str, requests: list[str]) -> dict[str, Any]:
    """Hand over (and forget) finished requests' values (`Collector.take`); the client reads them with `received`."""
    return _collectors(worker)[name].take(requests)


def stop(worker: Any, name: str) -> int:
    """Remove the collector's hooks and whatever it still holds; returns how many collectors remain."""
    collectors = _collectors(worker)
    collector = collectors.pop(name, None)
    if collector is not None:
        collector.close()
    return len(collectors)


def count(worker: Any) -> int:
    """How many collectors are installed (for tests: none after a run)."""
    return len(_collectors(worker))


