"""The synchronous engine's step, asking the workers for a finished request's saves only when it can have some.

nnsight's engine (``NNsightLLMEngine``) asks the workers for the saves of every
request that finishes, traced or not: one call into the engine core per step
that finishes any, and a wait there for the device (``collect_nnsight`` ends in
``torch.cuda.synchronize``). On an H200, that call was a quarter of the engine
core's time in a plain prefill of 512 short prompts, and it held both plain
requests and `vlenvoys.collect` below plain vLLM's speed.

A finished request can have saves or an error only when it carried a block (a
trace's ``nnsight_mediator``), named edits (``nnsight_edits``: a name nothing is
installed under is its error), or when some edit is installed on the engine
(nnsight runs one on every request that names none). The others get an empty
entry without the call (``output.saves == {}``, ``nnsight_error`` None; under
nnsight's engine such an output has either that or, when the worker has already
forgotten the request, no ``saves`` at all); their workers hold nothing and
forget them off the scheduler's finished set (nnsight's ``Requests.harvest``).

A trace's requests (those carrying a block) are collected together, in one
call after the step that finishes the last request in flight, not one call per
step that finishes some: each call waits for the device and holds the engine
core's next step, and on an H100 the calls of a trace of 64 invokes took a
quarter of its time (benchmarks/results/trace-cost-5b257ef-h100.md). The
synchronous engine has one caller at a time, so the blocks in flight are that
trace's, and vLLM's ``generate`` hands its outputs back only once all have
finished. A caller stepping the engine itself finds a block's saves on its
output once no block is in flight. The saves of the whole trace then go in
one message, under the size limits of one (`vlenvoys.worker.saves`).
"""

from __future__ import annotations

import contextlib
import pickle
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from nnsight.modeling.vllm.engines.engine import NNsightLLMEngine, attach, merge_collected
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.llm_engine import LLMEngine

from ..wire.requests import carries_nnsight_work
from .processes import interrupts_held

__all__ = ["StandardLLMEngine", "abandoned_on_error", "clean_up"]


def _nothing() -> dict:
    """nnsight's entry of a finished request that saved nothing and raised nothing (fresh: outputs own theirs)."""
    return {"saves": {}, "error": None, "registered": {}, "sequences": {}}


class StandardLLMEngine(NNsightLLMEngine):
    """nnsight's synchronous engine; `step` collects saves only of the finished requests that can have some.

    `install` turns an engine built by nnsight into one of these, bound to the
    client's list of installed edits (nnsight's ``VLLM._installed_edits``).
    """

    #: The client's installed edits: while any is installed, every finished request is collected.
    vlenvoys_edits: list = []
    #: External ids of requests in flight that carry nnsight work (`carries_nnsight_work`).
    vlenvoys_carrying: set[str]
    #: Those of them that carry a trace's block: collected when nothing is left in flight.
    vlenvoys_blocks: set[str]
    #: Finished requests with a block, waiting for that collection (id -> output).
    vlenvoys_waiting: dict[str, Any]

    @classmethod
    def install(cls, engine: LLMEngine, edits: list) -> None:
        engine.__class__ = cls
        engine.vlenvoys_edits = edits
        engine.vlenvoys_carrying = set()
        engine.vlenvoys_blocks = set()
        engine.vlenvoys_waiting = {}

    def add_request(self, request_id: str, prompt: Any, params: Any, *args: Any, **kwargs: Any) -> str:
        if isinstance(prompt, EngineCoreRequest):  # vLLM then takes the id and params off the request
            request_id, params = prompt.request_id, prompt.params
        added = super().add_request(request_id, prompt, params, *args, **kwargs)
        if carries_nnsight_work(params):
            self.vlenvoys_carrying.add(request_id)
            if "nnsight_mediator" in (getattr(params, "extra_args", None) or {}):
                self.vlenvoys_blocks.add(request_id)
        return added

    def abort_request(self, request_ids: list[str], internal: bool = False) -> None:
        super().abort_request(request_ids, internal)
        self.vlenvoys_carrying.difference_update(request_ids)
        self.vlenvoys_blocks.difference_update(request_ids)

    def step(self) -> Any:
        outputs = LLMEngine.step(self)
        finished = {output.request_id: output for output in outputs if output.finished}
        if not finished and not self.vlenvoys_waiting:
            return outputs
        asking = {
            request_id: output
            for request_id, output in finished.items()
            if self.vlenvoys_edits or request_id in self.vlenvoys_carrying
        }
        self.vlenvoys_carrying.difference_update(finished)
        # A block's request waits for the other blocks in flight (see above); the step that finishes the last of
        # them (or the last request of any kind: an id vLLM aborted internally stays listed) asks for all at once.
        waiting = {request_id: asking.pop(request_id) for request_id in list(asking) if request_id in self.vlenvoys_blocks}
        self.vlenvoys_blocks.difference_update(finished)
        self.vlenvoys_waiting.update(waiting)
        flushed = {}
        if self.vlenvoys_waiting and (not self.vlenvoys_blocks or not self.output_processor.has_unfinished_requests()):
            flushed = dict(self.vlenvoys_waiting)
        calls = {**asking, **flushed}
        collected = {}
        if calls:
            # As nnsight's step does: the outputs go pickled (the call is msgpack-encoded), for `tracer.result`.
            ids = list(calls)
            collected = merge_collected(self.engine_core.collective_rpc("collect_nnsight", args=(ids, ids, pickle.dumps(calls))))
        if flushed:  # only now: an interrupt or error in the call leaves them for `abandoned_on_error` to wind up
            self.vlenvoys_waiting = {}
        for output in outputs:
            # This step's block outputs are handed their entries below, once their trace's call is made.
            if not output.finished or output.request_id in waiting:
                continue
            if output.request_id not in asking:
                attach(output, _nothing())
            elif (entry := collected.get(output.request_id)) is not None:
                attach(output, entry)
        for output in flushed.values():
            if (entry := collected.get(output.request_id)) is not None:
                attach(output, entry)
        return outputs


@contextlib.contextmanager
def abandoned_on_error(model: Any) -> Iterator[None]:
    """Around a synchronous call that adds requests and steps the engine: on any error, abort what it left.

    An error or an interrupt (Ctrl-C) between vLLM's adding a call's requests
    and their last step leaves them in the engine, which the next call then
    steps to the end as its own: a trace of 900-token requests interrupted at
    once ran all 900 steps inside the next trace, and its blocks' state and
    saved values stayed on the worker. The synchronous engine has one caller
    at a time, so whatever is in flight when the error reaches here is the
    call's: it is aborted, and the blocks of those requests are wound up by
    name and their saves loaded and dropped (which frees the worker's shared
    memory they sit in). The error goes on up.
    """
    try:
        yield
    except BaseException:
        engine = model.vllm_entrypoint.llm_engine if model.vllm_entrypoint is not None else None
        states = getattr(getattr(engine, "output_processor", None), "request_states", None) or {}
        left = sorted({state.external_req_id for state in states.values()})
        waiting = list(getattr(engine, "vlenvoys_waiting", None) or ())  # finished, their blocks not yet collected
        if left or waiting:
            edits, ours = getattr(engine, "vlenvoys_edits", None), getattr(engine, "vlenvoys_carrying", set())
            carrying = [request for request in left if edits or request in ours] + waiting
            engine.vlenvoys_waiting = {}

            def abort() -> None:
                if left:
                    engine.abort_request(left)
                if carrying:
                    merge_collected(engine.collective_rpc("collect_nnsight", args=(carrying, carrying)))

            clean_up(model, abort, quietly=True)
        raise


def clean_up(model: Any, cleanup: Callable[[], Any], quietly: bool = False) -> None:
    """Run ``cleanup`` (calls to the engine), but stop waiting for it if vLLM's engine process exits.

    A Ctrl-C in a terminal reaches vLLM's processes too, and vLLM's synchronous
    client waits forever for an answer from an engine that has exited; with
    the engine gone there is nothing left to clean up. ``quietly`` (while an
    error is on its way up, the one worth seeing) turns an error of
    ``cleanup`` into a warning; otherwise it is raised here.

    A Ctrl-C while it runs is held until it is done, then raised as
    KeyboardInterrupt: stopping it half way left requests on the engine.
    """
    with interrupts_held("vlenvoys: interrupted again; stopping as soon as the engine's requests are wound up") as heard:
        _clean_up_now(model, cleanup, quietly)
    if heard:  # the interrupt held while winding up
        raise KeyboardInterrupt


def _clean_up_now(model: Any, cleanup: Callable[[], Any], quietly: bool) -> None:
    resources = getattr(model.vllm_entrypoint.llm_engine.engine_core, "resources", None)
    done, errors = threading.Event(), []

    def run() -> None:
        try:
            cleanup()
        except BaseException as error:
            errors.append(error)
        finally:
            done.set()

    if resources is None:  # an in-process engine: it cannot exit under us
        run()
    else:
        thread = threading.Thread(target=run, name="vlenvoys-collect-cleanup", daemon=True)
        thread.start()
    while not done.wait(0.1):
        if resources.engine_dead:
            return
    if resources is not None:
        thread.join()  # done: nothing calls the engine once the caller goes on
    if resources is not None and resources.engine_dead:
        return  # it failed because the engine is gone
    if errors and quietly:
        warnings.warn(f"collect could not clean up after the error below: {errors[0]!r}", RuntimeWarning, stacklevel=3)
    elif errors:
        raise errors[0]
