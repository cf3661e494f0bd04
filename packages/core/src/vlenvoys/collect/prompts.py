"""Collect standard values of many prompts at the engine's own speed.

A trace ships its block to the engine on every request it makes, so reading
the same values of a thousand prompts serializes and deserializes the same
block a thousand times. `collect` submits the prompts as plain vLLM requests
and reads their values on the engine in one of two ways. Values that are one
tensor at a module (the streams, contributions, heads, neurons) take the fast
path, `vlenvoys.worker.collector`: one hook per module per step reads every request's
rows at once, and no nnsight worker runs per request. The others (the
patterns, values inside a forward, tensor-parallel engines) take the general
path: a block installed on the engine once (nnsight's registration,
``model.edit``) that each request asks for by name and runs over its own rows,
its values taken off its output. Both serve the values a trace reads, through
the same declarations.

The engine is shared, and nnsight runs a named registration on every request
that names no edits, other tenants' included. vlenvoys' workers run one named
with `PRIVATE` only on the requests that name it (`vlenvoys.worker.tracing.serve_private_edits`), so
nobody else's request carries this block, its cost or its saves.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch
from nnsight.intervention.interleaver import Mediator
from nnsight.modeling.vllm.engines.engine import merge_collected

from ..engine.handover import InThread, one_thread_beside_a_cpu_engine
from ..engine.requests import check_engine, checked_prompts, salted, tokenized_together
from ..engine.stepping import clean_up
from ..errors import Unavailable, reraise
from ..values.envoys import block_index
from ..values.layouts import unmark
from ..values.names import KINDS, OWNERS, VALUES, Read, envoy_of, nearest
from ..values.reads import unhookable_reads
from ..values.support import support
from ..wire.requests import COLLECT_KEY, PRIVATE
from . import rows

__all__ = ["SAVED", "checked_reads", "collect", "progress_bar", "registered", "scheduled_at_once", "stream"]

#: The block's saved variable: one name no other registration is likely to save under.
SAVED = "vlenvoys_collected"



def collect(
    model: Any,
    prompts: Sequence[str | Sequence[int]],
    values: str | Sequence[str],
    layers: int | Sequence[int],
    *,
    batch_size: int | None = None,
    progress: bool | Callable[[int], Any] | None = True,
) -> dict[str, list[torch.Tensor]]:
    """Read block values of every prompt, with one block installed on the engine.

    Each prompt is one vLLM request of one generated token (greedy), so the
    values are the prefill's: every position of the prompt. The block reads
    ``model.layers[layer].<value>`` (``.self_attn.<value>``, ``.mlp.<value>``
    for the sublayers' values) exactly as a trace does, and it is installed
    only for the run: it is cleared when this returns or raises (also on
    KeyboardInterrupt), and requests still in flight are aborted. Nobody
    else's request runs it; a registration someone installed without a name
    runs on these requests too (nnsight's rule), and an edit it makes shows in
    the values.

    Args:
        model: A model from `vlenvoys.load` on the synchronous engine.
        prompts: Strings, or lists of token ids, one per request.
        values: A block value name (``"layer_output"``, ``"attention_output"``,
            ``"mlp_neurons"``, ...; see `vlenvoys.values.names.VALUES`) or several.
        layers: A block index or several; negative indices count from the end.
        batch_size: How many requests are in flight at once (default: as
            many as the engine schedules in one step, its ``max_num_seqs``);
            the engine batches those into its steps as it would a plain
            ``generate``. On the fast path the values of every ``batch_size``
            finished requests are taken from the engine at once. Fewer in
            flight than the engine can schedule leave its steps short while
            the client refills them (measured on an H200: 0.49 s for 512
            prompts with 256 in flight, 0.38 s with all of them). The values
            come back whatever the number in flight, so more holds no more
            memory.
        progress: Show a progress bar (tqdm's, prompts finished; on by
            default, ``False`` or None for none). A callable, called with the number of prompts finished
            after each engine step that finished some, is still taken, with a
            DeprecationWarning.

    Returns:
        ``"{value}.{layer}"`` (the layer as a non-negative index) -> one
        CPU tensor per prompt (copied off the engine's device as it is read,
        so a GPU engine holds none of a run's values), in prompt order, each
        that prompt's private copy in the value's layout: ``[1, tokens, hidden_size]`` for the streams and
        contributions, ``[1, tokens, heads, head_dim]`` for the heads,
        ``[1, tokens, intermediate_size]`` for the neurons, ``[1, heads,
        tokens, tokens]`` for the pattern.

    Raises:
        TypeError: ``prompts`` is one string, a prompt is neither a string
            nor a list of int token ids, ``layers`` are not ints,
            ``batch_size`` is neither None nor an int, or ``progress`` is neither a bool nor callable.
        ValueError: an empty prompt, an unknown value name, a block that does
            not exist (`NoSuchBlock`, an IndexError too), ``batch_size`` below 1, or
            a prompt vLLM refuses (longer than the engine's ``max_model_len``), named by its index.
        Unavailable: a value this model cannot serve (``vlenvoys.support``).
        NotImplementedError: the engine runs in ``mode="async"``.
        RuntimeError: the engine has been shut down, or a request came back
            without values.
    """
    check_engine(model)  # before either path touches the engine
    prompts = checked_prompts(prompts)
    reads = checked_reads(model, [values] if isinstance(values, str) else list(values), layers)
    if batch_size is None:
        batch_size = scheduled_at_once(model)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool):
        raise TypeError(f"batch_size must be an int or None, got {batch_size!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if progress is None:  # the default before progress bars (#49): no bar, as then
        progress = False
    if not isinstance(progress, bool) and callable(progress):
        warnings.warn(
            "collect(progress=callable) is deprecated: pass progress=True for a progress bar",
            DeprecationWarning,
            stacklevel=2,
        )
        counted, bar = progress, None
    elif isinstance(progress, bool):
        bar = progress_bar(len(prompts), "prompt") if progress and prompts else None
        counted = bar.update if bar is not None else None
    else:
        raise TypeError(f"progress must be True or False (a progress bar), got {progress!r}")
    results: dict[str, list[torch.Tensor]] = {f"{value}.{layer}": [] for layer, _, value in reads}
    if not prompts:
        return results
    runs: list[dict] = [{}] * len(prompts)

    def keep(index: int, values: dict) -> None:
        runs[index] = values

    try:
        stream(model, prompts, reads, keep, batch_size=batch_size, progress=counted, kept=True)
    finally:
        if bar is not None:
            bar.close()
    for saved in runs:
        for key, tensors in results.items():
            tensors.append(saved[key])
    return results


def stream(
    model: Any,
    prompts: Iterable[str | list[int]],
    reads: list[Read],
    deliver: Callable[[int, dict[str, torch.Tensor]], Any],
    *,
    batch_size: int,
    progress: Callable[[int], Any] | None = None,
    kept: bool = False,
    unread: bool = False,
    together: bool = False,
) -> None:
    """`collect` without keeping anything: ``deliver(index, values)`` as each prompt's values arrive.

    ``prompts`` (checked prompts, possibly a generator) are drawn as the engine
    has room for them, up to 64 ahead (their texts tokenized together), and each prompt's values go to ``deliver`` when
    they leave the engine, in the order requests finish (not prompt order), so
    neither side holds more than ``batch_size`` prompts' values at once.
    ``values`` is ``{"{value}.{layer}": [1, tokens, ...] CPU tensor}``: on the
    fast path, views of the engine's memory that ``deliver`` should copy what
    it keeps from (the engine reuses that memory once the views are gone).
    ``kept``: the caller keeps every prompt's values for the run, as they
    come (`collect`): the views then share one mapping per file for the run.
    ``unread``: on the fast path each value comes as `vlenvoys.engine.handover.Rows`
    (``[tokens, ...]`` rows not yet read, which ``deliver`` reads into its own
    memory with `vlenvoys.engine.handover.read_rows`), tensors elsewhere.
    ``together``: ``deliver`` is called once per batch of values taken
    together, with a list of ``(index, values)``.
    On the fast path ``deliver`` runs on a thread of its own (`_Takes`), one
    batch at a time, in the order the batches were taken.
    Raises what `collect` raises; an error of ``deliver`` aborts the requests in flight.
    """
    if not together:
        each = deliver

        def deliver(batch: list[tuple[int, dict]]) -> None:
            for index, values in batch:
                each(index, values)

    with one_thread_beside_a_cpu_engine():
        if unhookable_reads(model, reads) is None and _ranks(model) == 1:
            _batched(model, prompts, reads, batch_size, progress, deliver, kept, unread)
        else:
            _registered(model, prompts, reads, batch_size, progress, deliver)


def progress_bar(total: int | None, unit: str, **options: Any) -> Any:
    """A tqdm progress bar (``tqdm.auto``'s: a widget in a notebook) of ``total`` items named ``unit``, described
    "collecting"."""
    from tqdm.auto import tqdm

    return tqdm(total=total, unit=unit, desc="collecting", **options)


def scheduled_at_once(model: Any) -> int:
    """How many requests the engine's scheduler runs in one step (vLLM's ``max_num_seqs``)."""
    config = model.vllm_entrypoint.llm_engine.vllm_config.scheduler_config
    return int(getattr(config, "max_num_seqs", None) or 256)


def _ranks(model: Any) -> int:
    return int(model.vllm_entrypoint.llm_engine.vllm_config.parallel_config.tensor_parallel_size)


def _registered(model: Any, prompts: Iterable, reads: list[Read], batch_size: int, progress: Any, deliver: Callable) -> None:
    """The general path: a block installed with nnsight's registration, one nnsight worker per request."""
    with registered(model, reads) as name:
        params = _params({"nnsight_edits": [name]})
        _run(model, prompts, params, batch_size, progress, lambda finished: deliver([(index, _values_of(output, index)) for output, index in finished]))


def _batched(
    model: Any, prompts: Iterable, reads: list[Read], batch_size: int, progress: Any, deliver: Callable, kept: bool, unread: bool = False
) -> None:
    """The fast path: one hook per module per step on the worker, no nnsight worker per request (`vlenvoys.worker.collector`)."""
    engine = model.vllm_entrypoint.llm_engine
    name = rows.new_name()
    engine.collective_rpc("vlenvoys_collect_start", args=(name, reads))

    # Kept values: one mapping per file for the run (one descriptor each, however many takes name it;
    # nobody writes into the values before collect returns them). Streamed values: a mapping per take,
    # gone with the take's views, so the worker reuses its memory; one kept for the run would hold
    # every file it maps, and the worker would make new ones: both sides would grow with the corpus
    # (measured on an H200: 12.4 GiB at 1e6 tokens of a 1B model's stream, 3.0 at 1e4).
    run_maps: dict | None = {} if kept else None

    def values(packed: dict, finished: list) -> list[tuple[int, dict]]:
        if unread:
            taken = rows.unread(model, reads, packed)
        else:
            taken = rows.split(model, reads, rows.received(packed, run_maps))
        batch = []
        for output, index in finished:
            got = taken[output.request_id]
            if isinstance(got, str):
                raise RuntimeError(f"prompt {index}: {got}")
            batch.append((index, got))
        return batch

    takes = _Takes(model, name, values, deliver)
    try:
        # Taken in batches: the engine answers a take between two steps, and each answer is packed for
        # every request it names (measured on an H200: a take per step held collect to 0.6 of plain prefill).
        _run(model, prompts, _params({COLLECT_KEY: name}), batch_size, progress, takes.send, take_every=batch_size)
        takes.close()
    except BaseException:
        takes.stop()  # what the engine already handed over still reaches ``deliver``
        raise
    finally:
        clean_up(model, lambda: engine.collective_rpc("vlenvoys_collect_stop", args=(name,)), quietly=True)


class _Takes:
    """Takes of finished requests' values: sent by the thread that drives the engine, answered on a thread of their own.

    The engine answers a take between two steps, so waiting for the answer
    would hold the driving thread for up to a step, the engine left without
    new requests meanwhile. So `send` only sends the take (on the driving
    thread, the one that uses the engine's socket) and returns; a thread waits
    for each answer in turn and hands its values to ``deliver``. At most
    `WAITING` takes wait for that thread (`send` blocks beyond): the values
    the engine holds for the client stay bounded. After an error the rest is
    dropped, and `send` and `close` raise it.

    A take is sent only once the last answer's files are mapped (``values``
    has run; ``deliver`` may still run): the worker takes each take as word
    that the client maps every earlier handover, and may reuse memory no
    mapping holds (`vlenvoys.wire.shm`). An answer comes between two steps and
    a take is due only after a batch of requests has finished, so this wait
    is rarely a wait.
    """

    #: Takes sent and not yet delivered before `send` waits.
    WAITING = 2

    def __init__(self, model: Any, name: str, values: Callable[[dict, list], list], deliver: Callable[[list], Any]) -> None:
        self.engine = model.vllm_entrypoint.llm_engine
        self.name, self.values, self.deliver = name, values, deliver
        self.mapped = threading.Event()  # set once the last take's answer is mapped (or failed)
        self.mapped.set()
        self.answered = InThread(self._answered, self.WAITING, "vlenvoys-takes")

    def send(self, finished: list) -> None:
        """Ask the engine for ``finished``'s values (``(output, prompt index)`` pairs); they go to ``deliver`` later."""
        self.answered.raise_error()
        while not self.mapped.wait(0.05):
            self.answered.raise_error()  # a failed take drops the rest: its event may never be set
        self.mapped.clear()
        self.answered(_sent(self.engine, "vlenvoys_collect_take", (self.name, [output.request_id for output, _ in finished])), finished)

    def _answered(self, answer: Future, finished: list) -> None:
        try:
            (packed, *_) = _answer(self.engine, answer)
            values = self.values(packed, finished)
        finally:
            self.mapped.set()
        self.deliver(values)

    def stop(self) -> None:
        """Deliver the takes already sent, then end the thread."""
        self.answered.stop()

    def close(self) -> None:
        """`stop`, then raise the error a take or ``deliver`` met, if any."""
        self.answered.close()


def _sent(engine: Any, method: str, args: tuple) -> Future:
    """``engine.collective_rpc(method, args=args)`` sent without waiting: the future of its answer.

    Sent as vLLM's multiprocess client sends a call (its ``call_utility``, less
    the wait), on the calling thread, so the engine's socket is used by one
    thread as before. An engine in this process answers at once.
    """
    core = engine.engine_core
    results, send = getattr(core, "utility_results", None), getattr(core, "_send_input", None)
    if results is None or send is None:
        answer: Future = Future()
        answer.set_result(engine.collective_rpc(method, args=args))
        return answer
    from vllm.v1.engine import EngineCoreRequestType

    call = uuid.uuid1().int >> 64
    answer = results[call] = Future()
    send(EngineCoreRequestType.UTILITY, (0, call, "collective_rpc", (method, None, args, None)))
    return answer


def _answer(engine: Any, answer: Future) -> Any:
    """The answer of a call `_sent` sent; RuntimeError if vLLM's engine process exits first."""
    resources = getattr(engine.engine_core, "resources", None)
    while True:
        try:
            return answer.result(timeout=0.1)
        except FutureTimeout:
            if resources is not None and resources.engine_dead:
                raise RuntimeError("vLLM's engine process exited before it answered a take of collected values") from None


def _params(extra_args: dict) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    # Not detokenized: nobody reads the one token's text (vLLM's detokenizer was 2 % of the client's time
    # in an activation dataset's collection on an H200).
    params = SamplingParams(
        temperature=0.0, max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY, extra_args=extra_args, detokenize=False
    )
    # A prefix-cached token runs no forward, so its rows would be missing from the values.
    if hasattr(params, "skip_reading_prefix_cache"):
        params.skip_reading_prefix_cache = True
    # Each request gets vLLM's shallow copy of these, not a deep one (65 us a request on the CPU, a fifth of an
    # activation dataset's client time on an H200): vLLM updates a copy in place only with the model's own stop
    # tokens, the same for every request, and nothing here is changed after.
    if hasattr(params, "skip_clone"):
        params.skip_clone = True
    return params


@contextlib.contextmanager
def registered(model: Any, reads: Sequence[Read]) -> Iterator[str]:
    """Install the block that saves ``reads`` for requests naming it, for the ``with`` body.

    Yields the registration's name: a request runs the block when its
    ``SamplingParams.extra_args["nnsight_edits"]`` lists it, and saves
    ``{"{value}.{layer}": tensor}`` under `SAVED` on its output
    (``output.saves[SAVED]``). The block is cleared on exit, however the body
    ends. ``reads`` must be in forward order (`collect` orders them).
    """
    check_engine(model)
    name = f"{PRIVATE}collect-{uuid.uuid4().hex}"
    edit = _install(model, list(reads), name)
    try:
        yield name
    except BaseException:
        clean_up(model, edit.clear, quietly=True)
        raise
    clean_up(model, edit.clear)


def _install(model: Any, reads: list[Read], name: str) -> Any:
    # Its own function: the block's captured locals (model, reads, name) go to the engine with it.
    # nnsight warns that a registration on a prefix-caching engine may see short prompts; this one
    # runs only on collect's own requests, each salted out of the cache (`vlenvoys.engine.requests.salted`).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This engine was built with prefix caching on")
        return _register(model, reads, name)


def _register(model: Any, reads: list[Read], name: str) -> Any:
    with model.edit(name=name) as (tracer, edit):
        vlenvoys_collected = dict().save()
        for layer, owner, value in reads:
            envoy = envoy_of(model.layers[layer], owner)
            # To the host on the engine: a run's values never pile up in GPU memory,
            # and they come back as CPU tensors wherever the engine runs.
            vlenvoys_collected[f"{value}.{layer}"] = _read_only(envoy, value).cpu()
    return edit


def _read_only(envoy: Any, name: str) -> torch.Tensor:
    """``getattr(envoy, name)`` inside a block, without handing the value back to the model.

    A standard value read in a block is handed back when the block moves on
    (one more exchange with the model per value, and a splice of the request's
    rows into the step). `collect` edits nothing, so it reads through the
    value's own declaration (the same tensor a trace reads) and hands nothing back.
    """
    value = getattr(type(envoy), name)
    value._check_available(envoy)
    served = value._read(envoy, Mediator.value(value._location(envoy)))
    unmark(served)  # nothing is handed back, so no edit to watch for
    return served


def _run(
    model: Any,
    prompts: Iterable,
    params: Any,
    batch_size: int,
    progress: Callable[[int], Any] | None,
    take: Callable[[list], Any],
    take_every: int = 1,
) -> None:
    """Drive the engine with ``batch_size`` requests in flight, handing the finished ones to ``take``.

    ``take`` gets finished ``(output, prompt index)`` pairs and sees their values delivered: once
    ``take_every`` have finished (or none are left in flight), each engine step's with the default.
    """
    from vllm.exceptions import VLLMClientError
    from vllm.inputs import TokensPrompt

    engine = model.vllm_entrypoint.llm_engine
    run = uuid.uuid4().hex[:12]
    in_flight: dict[str, int] = {}
    upcoming = enumerate(_tokenized_ahead(engine, prompts))
    drawn_all = False

    def submit() -> None:
        nonlocal drawn_all
        while not drawn_all and len(in_flight) < batch_size:
            following, prompt = next(upcoming, (None, None))
            if following is None:
                drawn_all = True
                return
            request_id = f"vlenvoys-collect.{run}.{following}"
            prompt = salted(TokensPrompt(prompt_token_ids=prompt) if isinstance(prompt, list) else prompt, "collect", request_id)
            try:
                engine.add_request(request_id, prompt, params)
            except VLLMClientError as error:
                raise ValueError(f"prompt {following}: {error}") from error
            in_flight[request_id] = following

    pending: list = []  # finished, values not yet taken
    try:
        submit()
        while in_flight:
            if not engine.has_unfinished_requests():
                raise RuntimeError(f"{len(in_flight)} collect requests left the engine without finishing")
            finished = []
            for output in engine.step():
                if not output.finished or output.request_id not in in_flight:
                    continue  # not ours (the synchronous engine has one caller at a time)
                finished.append((output, in_flight.pop(output.request_id)))
            pending.extend(finished)  # kept before the refill, which may raise (the source's error, an interrupt)
            # Refill first: the engine works on the next step while these values come over.
            submit()
            if pending and (len(pending) >= take_every or not in_flight):
                take(pending)
                pending = []
            if finished and progress is not None:
                progress(len(finished))
    except BaseException:
        if pending:
            # Finished before the interrupt or error: their values wait on the worker, and are taken (a dataset's
            # whole shards are then written). Without this a Ctrl-C lost up to a take's worth of finished requests
            # (`take_every`): on the CPU engine, a minute of an activation dataset's windows.
            # Whatever it raises (the take's own error again, a second Ctrl-C), the rest is still aborted and the
            # first error goes up.
            with contextlib.suppress(BaseException):
                take(pending)
        unfinished = list(in_flight)

        def abort() -> None:
            engine.abort_request(unfinished)
            # An aborted request's output never comes back to be collected, so its
            # block's state stays on the worker unless it is wound up by name; what it
            # saved is loaded and dropped, which frees the worker's shared memory it is in.
            merge_collected(engine.collective_rpc("collect_nnsight", args=(unfinished, unfinished)))

        if unfinished:
            clean_up(model, abort, quietly=True)
        raise


def _tokenized_ahead(engine: Any, prompts: Iterable, chunk: int = 64) -> Iterator:
    """``prompts`` as they come, the texts of each ``chunk`` tokenized in one call (`tokenized_together`)."""
    upcoming = iter(prompts)
    while batch := list(itertools.islice(upcoming, chunk)):
        yield from tokenized_together(engine, batch)


def _values_of(output: Any, index: int) -> dict[str, torch.Tensor]:
    """The block's values on one finished request's output, or the error it came back with."""
    values = (getattr(output, "saves", None) or {}).get(SAVED)
    if values is not None:
        return values
    from nnsight.intervention.errors import raise_deferred

    try:
        raise_deferred(getattr(output, "nnsight_error", None))
    except RuntimeError as error:
        reraise(error)
        raise
    raise RuntimeError(f"prompt {index} came back without collected values (request {output.request_id})")


def checked_reads(model: Any, values: list[str], layers: int | Sequence[int]) -> list[Read]:
    """The block's reads in forward order (by block, then as the block computes them), checked."""
    if not values:
        raise ValueError("no values to collect")
    served = support(model)
    for value in values:
        if value not in OWNERS:  # the names this model serves: a dense model's list has no routing
            here = [name for name in OWNERS if served[KINDS[OWNERS[name]], name].available]
            close = nearest(value)
            raise ValueError(
                f"{value!r} is not a block value; {f'did you mean {close!r}? ' if close in here else ''}"
                f"choose from this model's: {', '.join(here)}"
            )
    count = len(model.layers)
    indices = [layers] if isinstance(layers, int) else list(layers) if isinstance(layers, (list, tuple, range)) else None
    if indices is None or not all(isinstance(layer, int) and not isinstance(layer, bool) for layer in indices):
        raise TypeError(f"layers must be a block index or a list of them, got {layers!r}")
    if not indices:
        raise ValueError("no layers to collect")
    blocks = sorted({block_index(layer, count, noun="layer") for layer in indices})
    for value in values:
        row = served[KINDS[OWNERS[value]], value]
        if not row.available:
            envoy = envoy_of(model.layers[0], OWNERS[value])
            raise Unavailable(value, type(envoy).__name__, row.note)
    ordered = [(owner, name) for owner, name in VALUES if name in values]
    return [(layer, owner, name) for layer in blocks for owner, name in ordered]


