"""How the worker runs nnsight's traced requests beside the batched paths: nnsight's runner, adjusted.

Each function here is installed once per worker by `vlenvoys.worker.runner.StandardRunner.load_model`:
a family's values read inside a forward are instrumented, plain requests are not tracked, a block's
source is compiled once, an open-ended ``tracer.iter[:]`` is bounded, a block's unchanged rows are not
copied back, `vlenvoys.collect`'s private edits run only on its own requests, and a block vLLM would
recompute after a preemption is ended.
"""

from __future__ import annotations

from typing import Any

import torch
from nnsight.modeling.vllm.batching import VLLMBatcher

from ..errors import BlockExit, Preempted
from ..values.envoys import StandardEnvoy
from ..values.support import values_of
from ..wire.requests import PRIVATE, carries_nnsight_work

__all__ = [
    "SplicingBatcher", "compile_blocks_once", "end_open_iterations", "instrument_sources", "refuse_recomputed",
    "serve_private_edits", "track_only_nnsight_work",
]


def instrument_sources(model: Any) -> None:
    """Source-instrument every block whose values are read at operations inside its forward.

    A value with no module boundary (GPT-2's stream after the attention add)
    is an operation of the block's forward; nnsight serves those once the
    module's forward is rewritten, which is done here, once, where the model
    runs.
    """
    from nnsight.intervention.source import install_source

    for envoy in model.modules():
        if not isinstance(envoy, StandardEnvoy):
            continue
        for name, value in values_of(type(envoy)):
            if envoy.unavailable(name) is None and value.located_key(envoy).startswith("source."):
                install_source(envoy)
                break


def track_only_nnsight_work(requests: Any) -> None:
    """Worker side: nnsight's runner tracks a request only where it can have nnsight work.

    nnsight's ``Requests.add`` makes an entry for every new request, traced or
    not, and each step walks all of them twice (``scope``, ``record_saves``)
    until they finish: with hundreds of plain, collected or steered requests in
    flight that is Python work on every step of the engine core, which is the
    bottleneck of a decode step that replays a CUDA graph. A request that
    carries no block and names no edits, while no edit is installed, has
    nothing for nnsight to run or keep, and its entry would be dropped
    unread when it finishes; it is not made. ``requests`` is the runner's
    ``nnsight_requests``; its ``add`` is wrapped.
    """
    add = requests.add

    def add_tracked(new_requests: list, persistent_objects: dict) -> None:
        if not requests.templates:
            new_requests = [data for data in new_requests if carries_nnsight_work(data.sampling_params)]
        add(new_requests, persistent_objects)

    requests.add = add_tracked


#: How many distinct sources `compile_blocks_once` keeps compiled (then it starts over).
COMPILED_SOURCES = 512


def compile_blocks_once() -> None:
    """Worker side: a traced block's source, and each function it ships by source, is compiled once.

    nnsight sends a block (and every function of the user's it calls) as source
    and compiles it again for every request: 64 invokes of one trace compiled
    the same block 64 times, a tenth of the engine core's time in a trace on an
    H200. The compiled code is kept by its source text (the code object is
    immutable; each request still gets its own function and globals), and the
    source is registered once in ``linecache`` under a name of its own, so a
    block's traceback and source introspection read as before.
    """
    import linecache
    import types

    from nnsight.intervention import serialization
    from nnsight.intervention.interleaver import Mediator

    if getattr(serialization._load_function, "vlenvoys", False):
        return
    load = serialization._load_function
    functions: dict[tuple, types.CodeType] = {}
    blocks: dict[str, tuple[types.CodeType, str]] = {}

    def load_function(source, name, defaults, kwdefaults, annotations, origin_filename, origin_line):
        key = (source, name, origin_filename, origin_line)
        code = functions.get(key)
        if code is None:
            made = load(source, name, defaults, kwdefaults, annotations, origin_filename, origin_line)
            if len(functions) >= COMPILED_SOURCES:
                functions.clear()
            functions[key] = made.__code__
            return made
        # As nnsight's own builds it: empty globals, which its pickle fills after this returns.
        made = types.FunctionType(code, {"__builtins__": serialization.__builtins__}, name, defaults, None)
        if kwdefaults:
            made.__kwdefaults__ = kwdefaults
        if annotations:
            made.__annotations__ = annotations
        return made

    def setstate(self: Mediator, state: dict) -> None:
        source, glbls, lcls = state["reduced"]
        if source not in blocks:
            if len(blocks) >= COMPILED_SOURCES:
                blocks.clear()
            filename = f"<edit-{len(blocks)}-{abs(hash(source)):x}>"
            linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
            blocks[source] = (compile(source, filename, "exec"), filename)
        self.__init__(blocks[source][0], glbls, lcls, copy=state["copy"])
        self.presaved = state["presaved"]

    load_function.vlenvoys = True
    load_function.__module__, load_function.__qualname__ = load.__module__, load.__qualname__  # pickles as nnsight's
    serialization._load_function = load_function
    Mediator.__setstate__ = setstate


def contain_block_exits() -> None:
    """Worker side: ``sys.exit()`` or ``raise KeyboardInterrupt`` in a traced block ends that block's request with
    `vlenvoys.errors.BlockExit`, as its other errors do; raised out of the worker's greenlet, either would pass
    nnsight's deferral of a block's errors (it catches ``Exception``) and end the engine."""
    from nnsight.intervention.interleaver import Mediator

    run = Mediator._run
    if getattr(run, "vlenvoys", False):
        return

    def contained(self: Mediator) -> None:
        try:
            run(self)
        except (SystemExit, KeyboardInterrupt) as stopped:
            said = f": {stopped}" if str(stopped) else ""
            raise BlockExit(f"the trace's block raised {type(stopped).__name__}{said}; its request ended there, and "
                            "the engine goes on") from None

    contained.vlenvoys = True
    Mediator._run = contained


#: The most steps an open-ended ``tracer.iter[:]`` hands out in a worker (`end_open_iterations`).
_OPEN_STEPS: dict[str, int] = {"limit": 0}


def end_open_iterations(limit: int) -> None:
    """Worker side: an open-ended ``tracer.iter[:]`` hands out at most ``limit`` steps (the engine's longest sequence).

    Such a loop ends when its block parks on a step the model never runs; a
    block that reads nothing of the model (``with tracer.iter[:] as step:
    saved.append(step)``) never parks, so the loop ran forever inside the
    engine's step and every request in the engine hung with it. No request
    runs more steps than ``limit``, so ending the loop there, as the model
    stopping ends it, takes nothing from a block that does read the model.
    """
    from nnsight.intervention.iterator import Iterations

    _OPEN_STEPS["limit"] = limit
    if getattr(Iterations._indices, "vlenvoys", False):
        return
    indices = Iterations._indices

    def bounded(self: Iterations) -> Any:
        for step in indices(self):
            if self.stop is None and self.steps is None and step >= _OPEN_STEPS["limit"]:
                return
            yield step

    bounded.vlenvoys = True
    Iterations._indices = bounded


class SplicingBatcher(VLLMBatcher):
    """nnsight's vLLM batcher, without the copy when a block hands back its own rows unchanged.

    Every standard value read in a block is handed back when the block moves
    on (an unedited one as the model's own tensors), and nnsight splices each
    request's rows back into the step by concatenating the whole step's tensor: with many requests in a step that
    is one full copy per request and value. A block that hands back the very
    view it was served, edited in place or not, left the step's tensor
    holding its rows already, so the step's tensor is handed on as it is.
    """

    def _widen_tensor(self, full: torch.Tensor, group: list, edited: torch.Tensor) -> torch.Tensor:
        dim = self._token_dim(full)
        if dim is not None and isinstance(edited, torch.Tensor) and _is_span(full, dim, group, edited):
            return full
        return super()._widen_tensor(full, group, edited)


def _is_span(full: torch.Tensor, dim: int, group: list, edited: torch.Tensor) -> bool:
    """Whether ``edited`` is exactly ``full``'s rows of ``group`` (the same memory, not a copy)."""
    start, size = group
    span = full.narrow(dim, start, size)
    return (
        edited.data_ptr() == span.data_ptr()
        and edited.shape == span.shape
        and edited.stride() == span.stride()
        and edited.dtype == span.dtype
        and edited.device == span.device
    )


def refuse_recomputed(runner: Any, scheduler_output: Any) -> None:
    """End, with `vlenvoys.Preempted`, the blocks of requests vLLM resumes after a preemption by recomputing them.

    A preempted request comes back with its cache blocks gone and runs its
    tokens again from position 0 (or from a cached prefix) in new steps.
    nnsight hands such a step to the request's block as one more visit: a
    ``tracer.iter[:]`` loop got extra steps of many rows (measured: 153 steps
    for 150 tokens), and whatever the block wrote at the earlier positions is
    not in the recomputed cache, so the values after it differ from an
    unpressured run's. A block still running (a trace's, or an installed
    edit's copy) is ended instead, its request's error naming why; a block that
    finished before the preemption keeps its values (it sees nothing more).
    `vlenvoys.collect`'s and `generate`'s hooks need no refusal: they skip rows
    already read, and steer every recomputed position again.
    """
    cached = scheduler_output.scheduled_cached_reqs
    resumed = getattr(cached, "resumed_req_ids", None)
    requests = runner.nnsight_requests
    if not resumed or not requests.requests:
        return
    for index, request_id in enumerate(cached.req_ids):
        tracked, state = requests.requests.get(request_id), runner.requests.get(request_id)
        if request_id not in resumed or tracked is None or state is None:
            continue
        # Tokens fed before the preemption: the prompt and every sampled token but the last.
        fed = state.num_prompt_tokens + max(len(state.output_token_ids) - 1, 0)
        start = cached.num_computed_tokens[index]
        if start < fed:
            end_preempted_blocks(tracked, fed, start)


def end_preempted_blocks(tracked: Any, fed: int, start: int) -> None:
    """End ``tracked``'s running blocks with `vlenvoys.Preempted`: vLLM recomputes its ``fed`` tokens from
    position ``start`` (`refuse_recomputed` on V1, `vlenvoys.worker.v2.end_resumed_blocks` on V2)."""
    from greenlet import GreenletExit, getcurrent
    from nnsight.intervention.errors import capture_exception

    running = [
        mediator for mediator in tracked.workers()
        if mediator.exception is None and (mediator.alive or getattr(mediator, "caches", None))
    ]
    if not running:
        return
    error = Preempted(
        f"vLLM preempted this request (its key/value cache went to other requests) and recomputes its {fed} "
        f"tokens from position {start}: a block would see those positions again as extra steps, without its "
        "earlier edits in the cache. Give the engine more key/value cache (kv_cache_memory_bytes, "
        "gpu_memory_utilization) or run fewer requests at once (max_num_seqs, fewer invokes)"
    )
    for mediator in running:
        if mediator.alive:  # unwound (its finally blocks run); GreenletExit passes any `except Exception`
            mediator.worker.parent = getcurrent()
            try:
                mediator.worker.throw(GreenletExit)
            except BaseException:  # noqa: S110 - what the block raised on its way out: the request has its error
                pass
        mediator.caches = []
        # Erred as a block that raised: nnsight keeps its row, ends the request early, reports the error.
        mediator.exception = error
    if tracked.error is None:
        tracked.error = capture_exception(error)


def serve_private_edits(requests: Any) -> None:
    """Worker side: run a registration named `PRIVATE`... only on requests that name it.

    nnsight gives every new request a copy of each registration unless the
    request lists the edits it wants, so a named one still runs on every
    request that lists none: another tenant's plain ``generate`` would run
    `collect`'s block and carry its saves home. ``requests`` is the runner's
    ``nnsight_requests`` (nnsight's ``Requests``); its ``add`` is wrapped to drop
    a private registration's copy from each new request that did not ask for it
    by name, before any block starts. Other registrations keep nnsight's rule.
    Its ``refuse_chunked`` is wrapped to refuse, by name, a request whose copy of
    such a registration would see its prompt split by chunked prefill.
    """
    add = requests.add

    def add_private(new_requests: list, persistent_objects: dict) -> None:
        add(new_requests, persistent_objects)
        private = [(rid, name) for rid, name in requests.names.items() if name and name.startswith(PRIVATE)]
        if not private:
            return
        for data in new_requests:
            request = requests.requests.get(data.req_id)
            wanted = (getattr(data.sampling_params, "extra_args", None) or {}).get("nnsight_edits") or ()
            for registration_id, name in private:
                if request is not None and name not in wanted:
                    request.copies.pop(registration_id, None)

    requests.add = add_private
    refuse = requests.refuse_chunked

    def refuse_chunked(spans: list, states: dict) -> None:
        # nnsight refuses a trace's prompt split across steps by chunked prefill, not a registration's copy: collect's
        # block (values no hook reads) read the first chunk's rows and ended, its values short (measured: 32 rows of
        # 201, in steps of 32). Refused the same way, by name.
        refuse(spans, states)
        for request_id, scheduled in spans:
            request, state = requests.requests.get(request_id), states.get(request_id)
            if request is None or state is None or request.error is not None:
                continue
            if state.num_computed_tokens + scheduled >= state.num_prompt_tokens:
                continue
            if any((requests.names.get(key) or "").startswith(PRIVATE) for key in request.copies):
                from nnsight.intervention.errors import capture_exception

                request.error = capture_exception(RuntimeError(
                    f"this request's {state.num_prompt_tokens}-token prompt was split across steps by chunked prefill "
                    f"({scheduled} tokens this step), so collect's block could not read it whole; load without "
                    "enable_chunked_prefill=True, or raise max_num_batched_tokens (and long_prefill_token_threshold) "
                    "past the prompt length"
                ))
                request.copies = {}

    requests.refuse_chunked = refuse_chunked
