"""vlenvoys' parts on vLLM's V2 model runner, for its CPU and CUDA workers (``VLENVOYS_MODEL_RUNNER=v2``, and on a
vLLM without V1; issue #50).

vLLM's V2 runner (``vllm.v1.worker.gpu.model_runner``, and its CPU subclass
``vllm.v1.worker.cpu.model_runner``) has none of the V1 seams nnsight's runner
overrides (``_update_states``, ``_sample``, ``input_batch``, ``requests``,
logits in ``execute_model_state``): those overrides would be dead code there,
without an error. Its own seams, each overridden here forwarding ``*args,
**kwargs`` to ``super()`` once (notes/vllm-v2-runner.md §4):

- ``finish_requests``: nnsight harvests the finished requests' registered blocks;
- ``add_requests``: each new request's nnsight work (``extra_args``) is taken;
  a known id sent again as new is a resume after a preemption, its block ended;
- ``prepare_inputs``: the step's rows, in V2's own (sorted) batch order, scope
  each block to its request's tokens;
- ``execute_model``: the forward runs with the interleaver open;
- ``sample_tokens`` / ``sample``: the logits (one row per request, handed to the
  sampler, whose class is swapped for one that serves them) and the sampled ids.

`vlenvoys.worker.v2.cpu` puts these mixins over vLLM's V2 CPU runner, `vlenvoys.worker.v2.gpu` over the CUDA
one (its superclass, with the same seams).

nnsight's plain-Python parts are reused as they are: its ``Requests`` and the runner's methods that never call
``super()`` (collect, finish erred requests, register). Its module imports vLLM's V1 runner, which vLLM 0.34
removed; on 0.32 and 0.33 it imports.
"""

from __future__ import annotations

import types
from typing import Any

from .. import v1_stand_in

v1_stand_in.install()  # before nnsight's runner module, which imports vLLM's V1 runner (gone in 0.34)

from nnsight.modeling.vllm.batching import VLLMBatcher  # noqa: E402
from nnsight.modeling.vllm.fragments import VLLMFragments  # noqa: E402
from nnsight.modeling.vllm.interleaver import VLLMInterleaver  # noqa: E402
from nnsight.modeling.vllm.model_runners.GPUModelRunner import NNsightGPUModelRunner, Requests  # noqa: E402
from nnsight.modeling.vllm.workers.GPUWorker import NNsightGPUWorker  # noqa: E402
from nnsight.tracing.tracer import _local, _saves, inc  # noqa: E402

from ..collector import spans_of_rows  # noqa: E402
from ..steerer import plan_step  # noqa: E402
from ..tracing import end_preempted_blocks  # noqa: E402

__all__ = ["NNsightV2Runner", "V2Steps", "V2WorkerCalls", "end_resumed_blocks", "runs_a_block"]


class NNsightV2Runner:
    """nnsight's runner, on the V2 runner's seams: its envoy tree, its requests, the interleaver around the forward."""

    # nnsight's methods that never reach vLLM (plain Python over ``self.nnsight_requests``/``nnsight_model``).
    collect_nnsight = NNsightGPUModelRunner.collect_nnsight
    _finish_erred = NNsightGPUModelRunner._finish_erred
    _still_running = NNsightGPUModelRunner._still_running
    nnsight_register = NNsightGPUModelRunner.nnsight_register
    nnsight_clear_registered = NNsightGPUModelRunner.nnsight_clear_registered
    nnsight_request_count = NNsightGPUModelRunner.nnsight_request_count

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        from nnsight.modeling.vllm import VLLM
        from vllm.tokenizers import cached_tokenizer_from_config

        super().load_model(*args, **kwargs)
        # The tree over the loaded module, as nnsight's runner builds it (`StandardRunner.load_model` rebuilds it
        # with the family's envoys on the same interleaver).
        taps = self.vllm_config.additional_config.get("nnsight_taps", ())
        model = VLLM(self.get_model(), interleaver=VLLMInterleaver(taps, fragments=VLLMFragments()))
        model.tokenizer = cached_tokenizer_from_config(self.model_config)
        interleaver = model.interleaver
        interleaver.batcher = VLLMBatcher(None)
        interleaver.defer_exceptions = True  # a block's error ends its own request, not the engine
        self.nnsight_model = model
        self.nnsight_requests = Requests()
        self.nnsight_persistent_objects = model._remoteable_persistent_objects()
        sampler = getattr(self, "sampler", None)
        if sampler is not None:
            # The logits reach a block where the sampler takes them (V2 computes them inside `sample`). A class
            # swap, not a wrapper: vLLM's own isinstance checks on its sampler still hold.
            sampler.__class__ = _serving(type(sampler))
            sampler.vlenvoys_runner = self

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("dummy_run"):  # a warm-up or profile run: no request, no block
            return super().execute_model(*args, **kwargs)
        # A block's `.save()` needs a trace scope on the forward's thread (see nnsight's runner).
        if not getattr(_local, "depth", 0):
            inc()
        if not self.nnsight_requests.requests:
            _saves().clear()  # nothing in flight: no pending save can matter
        interleaver = self.nnsight_model.interleaver
        interleaver.mediators = []  # the step's workers are scoped in `prepare_inputs`
        with interleaver:
            output = super().execute_model(*args, **kwargs)
            # What follows the forward (logits, samples) is one row per request.
            self.nnsight_requests.unflatten(self.nnsight_model)
        return output

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        # V2 computes the logits here (in `sample`), not in the forward: the interleaver is open around it, for
        # the still-running blocks only, each on its request's row.
        with self._still_running():
            output = super().sample_tokens(*args, **kwargs)
        self.nnsight_requests.record_saves()
        return output

    def sample(self, *args: Any, **kwargs: Any) -> Any:
        sampler_output, *rest = super().sample(*args, **kwargs)
        model = self.nnsight_model
        if model.interleaver.mediators:
            sampler_output.sampled_token_ids = type(model).samples.provide(model, sampler_output.sampled_token_ids)
        self._finish_erred(sampler_output)  # rows follow the step's batch order, as the blocks' rows do
        return (sampler_output, *rest)

    def finish_requests(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> None:
        finished = getattr(scheduler_output, "finished_req_ids", None)
        if finished:
            self.nnsight_requests.harvest(set(finished))
            live = getattr(self, "vlenvoys_live", None)
            if live:
                live.difference_update(finished)
        super().finish_requests(scheduler_output, *args, **kwargs)

    def add_requests(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> None:
        # Under V2 a request resumed after a preemption (or a streamed prompt's next part) comes back as new, with
        # the id it had: its collector, steering and block are not admitted twice.
        live = self.__dict__.setdefault("vlenvoys_live", set())
        new = scheduler_output.scheduled_new_reqs
        resumed = [data for data in new if data.req_id in live]
        self.vlenvoys_resumed = frozenset(data.req_id for data in resumed)
        live.update(data.req_id for data in new)
        super().add_requests(scheduler_output, *args, **kwargs)
        if resumed:
            end_resumed_blocks(self.nnsight_requests, resumed)
        self.nnsight_requests.add(new, self.nnsight_persistent_objects)


class V2Steps:
    """vlenvoys' per-step work on the V2 runner: each block scoped to its rows, the collectors' and steerer's spans."""

    def prepare_inputs(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        batch = super().prepare_inputs(scheduler_output, *args, **kwargs)
        # V2's rows: decodes first, then by scheduled tokens (not the order requests came in).
        req_ids = list(batch.req_ids)
        tokens = [int(count) for count in batch.num_scheduled_tokens[: len(req_ids)]]
        computed = batch.num_computed_tokens_np[: len(req_ids)]
        requests = self.nnsight_requests
        if requests.requests or requests.templates:
            spans = list(zip(req_ids, tokens, strict=True))
            # The user's prompt, as V1's state has it: a resumed request's prefill (its prompt and the tokens it
            # generated, recomputed in chunks) is no prompt split by chunked prefill.
            prompts = self.req_states.prompt_len.np[batch.idx_mapping_np[: len(req_ids)]]
            states = {
                request: types.SimpleNamespace(num_computed_tokens=int(computed[row]),
                                               num_prompt_tokens=int(prompts[row]))
                for row, request in enumerate(req_ids)
            }
            requests.refuse_chunked(spans, states)
            requests.scope(self.nnsight_model, spans)
            if self.nnsight_model.interleaver.mediators and batch.num_tokens_after_padding != batch.num_tokens:
                raise RuntimeError(
                    f"vlenvoys' V2 runner: a traced step was padded from {batch.num_tokens} to "
                    f"{batch.num_tokens_after_padding} tokens, and its blocks' rows would be misread; run the engine "
                    "eagerly (enforce_eager=True)"
                )
        self.vlenvoys_batch = dict(zip(req_ids, (int(at) for at in computed), strict=True))
        step = scheduler_output
        resumed = getattr(self, "vlenvoys_resumed", frozenset())
        if resumed:  # known to the collectors and the steerer already (`add_requests`)
            step = types.SimpleNamespace(
                finished_req_ids=scheduler_output.finished_req_ids,
                scheduled_new_reqs=[data for data in scheduler_output.scheduled_new_reqs if data.req_id not in resumed],
            )
        self.vlenvoys_spans = spans_of_rows(self, step, req_ids, tokens, computed)
        plan_step(self, step, self.vlenvoys_spans)
        return batch

    def vlenvoys_request_state(self, request: str) -> Any:
        """``request``'s prompt length and its tokens computed before this step
        (`vlenvoys.worker.steerer.request_state`)."""
        states = self.req_states
        index = states.req_id_to_index[request]
        computed = self.vlenvoys_batch.get(request)
        return types.SimpleNamespace(
            num_prompt_tokens=int(states.prompt_len.np[index]),
            num_computed_tokens=int(states.num_computed_tokens_np[index]) if computed is None else computed,
        )


def _serving(sampler_class: type) -> type:
    """A subclass of the runner's sampler class whose call hands the logits to the step's blocks first."""

    class Serving(sampler_class):
        def __call__(self, logits: Any, *args: Any, **kwargs: Any) -> Any:
            runner = self.vlenvoys_runner
            model = runner.nnsight_model
            if model.interleaver.mediators:
                served = type(model).logits.provide(model, logits)
                # The sampler may scale its logits in place: a block's read is a view of these.
                logits = served.clone() if served is logits else served
            return super().__call__(logits, *args, **kwargs)

    Serving.__name__ = Serving.__qualname__ = f"Serving{sampler_class.__name__}"
    return Serving


def runs_a_block(requests: Any, scheduled: Any) -> bool:
    """Whether nnsight's ``Requests.scope`` will run a block on a step of the ``scheduled`` request ids: a traced or
    registered worker of one of them not yet started, still running, holding open caches, or erred (the workers
    `scope` keeps). Asked before the step's inputs are built, where the runner picks a CUDA graph or none."""
    if not requests.requests:
        return False
    for request_id in scheduled:
        tracked = requests.requests.get(request_id)
        if tracked is None:
            continue
        for mediator in tracked.workers():
            done = mediator.worker is not None and not mediator.alive
            if not done or mediator.caches or mediator.exception is not None:
                return True
    return False


def end_resumed_blocks(requests: Any, resumed: list) -> None:
    """End, with `vlenvoys.Preempted`, the running blocks of requests the V2 scheduler sends again as new.

    Under V2 a request resumed after a preemption comes back in ``scheduled_new_reqs`` with its id and its prompt
    plus every token sampled so far, to be recomputed: a block would see those positions again as extra steps,
    without its earlier edits in the cache (as `vlenvoys.worker.tracing.refuse_recomputed` says for V1).
    """
    for data in resumed:
        tracked = requests.requests.get(data.req_id)
        if tracked is not None:
            end_preempted_blocks(tracked, len(data.prefill_token_ids), data.num_computed_tokens)


class V2WorkerCalls:
    """nnsight's worker RPCs (collect, count, register), plain calls into the runner, for a worker over V2."""

    collect_nnsight = NNsightGPUWorker.collect_nnsight
    nnsight_request_count = NNsightGPUWorker.nnsight_request_count
    nnsight_register = NNsightGPUWorker.nnsight_register
    nnsight_clear_registered = NNsightGPUWorker.nnsight_clear_registered

    #: The vLLM runner class the worker instruments (set by each engine's worker).
    vlenvoys_v2_runner: type
    #: Its instrumented subclass.
    vlenvoys_v2_instrumented: type

    def init_device(self) -> None:
        super().init_device()
        runner = self.model_runner
        expected = self.vlenvoys_v2_runner
        if type(runner) is not expected:
            raise NotImplementedError(
                f"VLENVOYS_MODEL_RUNNER=v2 instruments vLLM's V2 {expected.__module__}.{expected.__name__}, but this "
                f"worker built {type(runner).__module__}.{type(runner).__name__}; set VLLM_USE_V2_MODEL_RUNNER=1 "
                "(vlenvoys.load does) or unset VLENVOYS_MODEL_RUNNER"
            )
        runner.__class__ = self.vlenvoys_v2_instrumented
