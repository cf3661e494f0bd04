"""vLLM's worker and model runner with vlenvoys' parts: the family's envoy tree, the batched paths' RPCs and hooks.

vLLM names its worker class by path (``worker_cls``), so one of these is
imported in every worker process: `vlenvoys.worker.cpu.CPUWorker` on vLLM's
CPU engine, `vlenvoys.worker.gpu.GPUWorker` on CUDA/ROCm, each these mixins
over nnsight's. nnsight's runner builds its own envoy tree over the loaded
module with the default envoys; the user's block runs against that tree, so
the family's envoys and names are installed there, right after the model
loads, on the same interleaver.
"""

from __future__ import annotations

from typing import Any

from ..engine.model import StandardizedVLLM
from ..values.family import resolve
from ..values.parallel import KernelFragments
from ..values.reads import unsteerable
from ..wire.requests import EAGER_KEY, SITED_GRAPHS, carries_nnsight_work
from . import collector, sited, steerer
from .collector import step_spans
from .saves import send_back_what_can_be_sent, stop_sending
from .steerer import Steerer, plan_step
from .tracing import (
    SplicingBatcher,
    compile_blocks_once,
    contain_block_exits,
    end_open_iterations,
    instrument_sources,
    refuse_recomputed,
    serve_private_edits,
    track_only_nnsight_work,
)

__all__ = ["StandardRunner", "StandardWorker", "replays_graphs"]


class StandardWorker:
    """Mixin for nnsight's workers: `vlenvoys.worker.collector`'s and `vlenvoys.worker.steerer`'s RPCs, called by
    name with vLLM's ``collective_rpc``."""

    def vlenvoys_collect_start(self, name: str, reads: list) -> str:
        return collector.start(self, name, reads)

    def vlenvoys_collect_start_checked(self, name: str, reads: list) -> dict:
        return collector.start_checked(self, name, reads)

    def vlenvoys_collect_take(self, name: str, requests: list) -> tuple:
        return collector.take(self, name, requests)

    def vlenvoys_collect_stop(self, name: str) -> int:
        return collector.stop(self, name)

    def vlenvoys_steer_failures(self, requests: list) -> dict:
        return steerer.failures(self, requests)

    def vlenvoys_collect_count(self) -> int:
        return collector.count(self)

    def vlenvoys_collect_stats(self) -> dict:
        return collector.stats(self)

    def vlenvoys_sited_stats(self) -> dict | None:
        graphs = getattr(self.model_runner, "vlenvoys_sited_graphs", None)
        return None if graphs is None else graphs.stats()

    def shutdown(self) -> None:
        collector.close_arena(self)  # its files in shared memory go with the worker
        stop_sending(self.model_runner)  # its saves no longer go through an arena, nor keep it alive
        super().shutdown()


class StandardRunner:
    """Mixin for nnsight's runner: rebuilds its envoy tree with the model's family declarations,
    and tells `vlenvoys.worker.collector`'s collectors which rows of each step are whose."""

    def _update_states(self, scheduler_output: Any) -> None:
        from nnsight.modeling.vllm.model_runners.GPUModelRunner import NNsightGPUModelRunner

        requests = self.nnsight_requests
        refuse_recomputed(self, scheduler_output)  # before nnsight scopes its workers over the step
        if requests.requests or requests.templates or any(
            carries_nnsight_work(data.sampling_params) for data in scheduler_output.scheduled_new_reqs
        ):
            super()._update_states(scheduler_output)
            # nnsight's `scope` has just listed the workers this step runs: scheduled, and not finished (or keeping
            # caches, or erred). A trace whose block is done (read at the prefill) leaves the graphs to the rest.
            eager = bool(self.nnsight_model.interleaver.mediators)
            graphs = getattr(self, "vlenvoys_sited_graphs", None)
            if graphs is not None and eager and not any(
                EAGER_KEY in ((self.requests[held].sampling_params.extra_args or {}) if held in self.requests else {})
                for held in scheduler_output.num_scheduled_tokens
            ):
                # A traced decode step replays the graph broken at the declared sites (`vlenvoys.worker.sited`).
                graphs.sited_step, eager = True, False
        else:
            eager = False
            # No block in flight or installed, none arriving: nnsight's bookkeeping (its harvest, its spans of
            # every request, its scope of no workers) would find nothing to do. vLLM's own states only.
            super(NNsightGPUModelRunner, self)._update_states(scheduler_output)
        self.vlenvoys_spans = step_spans(self, scheduler_output)
        plan_step(self, scheduler_output, self.vlenvoys_spans)
        self.vlenvoys_eager_step = eager

    def _determine_batch_execution_and_padding(self, *args: Any, force_eager: bool = False, **kwargs: Any) -> Any:
        # A step that runs a block (a trace's, an installed edit's) runs eagerly: a replayed graph would run none of
        # its reads and edits (#48). Steps of plain, collected and steered requests alone keep their graphs.
        force_eager = force_eager or getattr(self, "vlenvoys_eager_step", False)
        return super()._determine_batch_execution_and_padding(*args, force_eager=force_eager, **kwargs)

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().execute_model(*args, **kwargs)
        finally:
            # A forward outside a step (a warm-up) reads nothing, and eagerly steers nothing.
            self.vlenvoys_spans = []
            self.vlenvoys_eager_step = False
            graphs = getattr(self, "vlenvoys_sited_graphs", None)
            if graphs is not None:
                graphs.sited_step = False
            steerer = getattr(self, "vlenvoys_steerer", None)
            if steerer is not None:
                steerer.active = set()

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        # Registrations vlenvoys.collect installs run only on the requests that name them.
        serve_private_edits(self.nnsight_requests)
        track_only_nnsight_work(self.nnsight_requests)
        compile_blocks_once()
        contain_block_exits()
        send_back_what_can_be_sent(self)
        end_open_iterations(self.model_config.max_model_len)

        backend = type(self.get_model()).__name__.startswith("Transformers")
        installed, name, architecture = resolve(
            self.model_config.hf_config.architectures, backend=backend, config=self.model_config.hf_config
        )
        plain = self.nnsight_model
        interleaver = plain.interleaver
        interleaver.batcher.__class__ = SplicingBatcher
        # The plain tree registered every module; a module already registered
        # would become an alias of the plain envoy instead of getting ours.
        interleaver.envoys.clear()
        # nnsight's sharding rules plus the attention kernel's heads, recorded
        # afresh as our tree is built (a no-op on one rank).
        ranks = self.parallel_config.tensor_parallel_size
        interleaver.fragments = KernelFragments(max(1, ranks // self.model_config.get_total_num_kv_heads()))
        model = StandardizedVLLM(self.get_model(), interleaver=interleaver, architecture=architecture)
        model.tokenizer = plain.tokenizer
        model.family, model.architecture_name = installed, name  # as `vlenvoys.load` sets them on the client's
        instrument_sources(model)
        self.nnsight_model = model
        self.nnsight_persistent_objects = model._remoteable_persistent_objects()
        if replays_graphs(self):
            # Graphs are captured once the engine has its cache, before any request: the
            # steering hooks must be in the forward by then, on every block (`Steerer`).
            if unsteerable(model) is None:
                self.vlenvoys_steerer = Steerer(self, every_block=True)
            self.vlenvoys_sited_graphs = sited.install(self, model)

    def _capture_cudagraphs(self, *args: Any, **kwargs: Any) -> Any:
        # Each FULL batch size captured twice: vLLM's graph, then the one broken at the declared sites (before any
        # request; a capture after vLLM's pass raises). nnsight's capture_model has the interleaver open meanwhile.
        result = super()._capture_cudagraphs(*args, **kwargs)
        graphs = getattr(self, "vlenvoys_sited_graphs", None)
        mode = kwargs.get("cudagraph_runtime_mode", args[1] if len(args) > 1 else None)
        if graphs is None or getattr(mode, "name", None) != "FULL":
            return result
        graphs.capturing = True
        try:
            super()._capture_cudagraphs(*args, **kwargs)
        finally:
            graphs.capturing = False
        breaks = graphs.breaks()
        wrong = {key: count for key, count in breaks.items() if count != len(graphs.locations)}
        if not breaks or wrong:
            raise RuntimeError(
                f"sited CUDA graphs: expected {len(graphs.locations)} breaks (one per declared site) in each graph, "
                f"found {wrong or 'no graph'}; unset {SITED_GRAPHS} to run traced steps eagerly"
            )
        return result


def replays_graphs(runner: Any) -> bool:
    """Whether ``runner``'s engine captures CUDA graphs (`vlenvoys.load` with ``cuda_graphs=True``, on a GPU)."""
    mode = getattr(getattr(runner, "compilation_config", None), "cudagraph_mode", None)
    return mode is not None and mode.name != "NONE"
