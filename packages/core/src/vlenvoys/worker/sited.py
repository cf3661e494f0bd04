"""Traces inside CUDA graphs: a second set of FULL decode graphs, broken only at the declared sites (#48).

An engine loaded with ``cuda_graphs=True`` replays FULL graphs of its decode
steps, which run no Python. Until now a step that runs a trace's block ran
eagerly instead. With sited graphs (opt in: ``VLENVOYS_SITED_GRAPHS=1`` in
the engine's environment, while this path is measured), the runner captures,
beside vLLM's own graphs and before any request, one more FULL graph per
batch size through vLLM's breakable capture, which ends a graph segment
wherever Python asks (`BreakableCUDAGraphCapture.add_eager`). The one place
that asks is the interleaver's handoff at a declared site: replaying such a
graph runs the graph's kernels up to a site, nnsight's handoff there (a
trace's read, or its edit copied back in place), and on. Attention and
everything else between sites stays inside the graph: captured in FULL mode,
vLLM's own breaks do not break (``eager_break_during_capture``).

Steps carrying a trace's block replay the sited graphs; others replay vLLM's.
Rows of requests without a block run the same kernels either way.

Not yet served on a sited step (review of this prototype, to do before it is on by default): what waits at a
location that is not a site, which the sites check lets through today: ``model.input_ids`` (the embedding's
input), ``skip_layer`` (the block's input), ``tracer.cache()`` (every module). Such a step ran eagerly before;
replayed, the block finds nothing there. Nor does vLLM's estimate of graph memory count the second set
(``profile_cudagraph_memory``): set ``kv_cache_memory_bytes`` on such an engine.

A break must never raise: an exception escaping one would end the replay half
way, with every later layer of every request in the batch left unrun. nnsight's
handoff already defers a block's errors to its request
(``interleaver.defer_exceptions``); what else escapes is kept and raised after
the replay (`SitedGraphs.__call__`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..values.layouts import Located, unavailable_reason
from ..values.names import OWNERS
from ..values.reads import located
from ..wire.requests import SITES_KEY, sited_graphs_asked

__all__ = ["install", "site_locations"]


def site_locations(model: Any, sites: Mapping[str, Any]) -> frozenset[str] | None:
    """The handoff locations (``model.layers.3.output``) of declared ``sites`` ({value name: blocks}) on ``model``'s
    tree, or None where some site's value has no one location (a value derived from several: such an engine keeps
    running traced steps eagerly). A value this model lacks (a router's logits on a dense model) has none: a read of
    it raises in the block before it waits anywhere."""
    found = set()
    for name, blocks in sites.items():
        for block in blocks:
            envoy, value = located(model, (block, OWNERS[name], name))
            if not isinstance(value, Located):
                return None
            if unavailable_reason(envoy, name) is None:
                found.add(value._location(envoy))
    return frozenset(found)


def _weak(value: Any) -> Any:
    """Weak references to the CUDA tensors of a handoff's value: a strong one would pin the capture's memory, and a
    replay would then hand the warm-up's tensors to the break instead of the step's."""
    from vllm.utils.torch_utils import weak_ref_tensor

    if isinstance(value, torch.Tensor):
        return weak_ref_tensor(value) if value.is_cuda else value
    if isinstance(value, (tuple, list)):
        return type(value)(_weak(item) for item in value)
    if isinstance(value, dict):
        return {key: _weak(item) for key, item in value.items()}
    return value


def _copy_into(live: Any, edited: Any) -> None:
    """Land an edited value in the graph's memory, which the next segment reads (a break's return is discarded)."""
    if edited is live:
        return
    if isinstance(live, torch.Tensor):
        live.copy_(edited)
    elif isinstance(live, (tuple, list)):
        for live_item, edited_item in zip(live, edited, strict=True):
            _copy_into(live_item, edited_item)
    elif isinstance(live, dict):
        for key, live_item in live.items():
            _copy_into(live_item, edited[key])


class _Break:
    """What a sited graph runs at one site on every replay: the handoff of the rows this step has, then any edit
    copied back. Returns at once when nothing is interleaving (a step whose block has already ended)."""

    __slots__ = ("interleaver", "location", "live", "graphs")

    def __init__(self, interleaver: Any, location: str, live: Any, graphs: SitedGraphs) -> None:
        self.interleaver, self.location, self.live, self.graphs = interleaver, location, live, graphs

    def __call__(self) -> None:
        interleaver = self.interleaver
        if not interleaver.interleaving or self.graphs.capturing:
            return
        if not interleaver.mediators:  # no block in this step (a request's block ended at its prefill)
            return
        try:
            total = interleaver.batcher.total
            live = self.live
            if total is not None:
                live = _rows(live, total)
            _copy_into(live, interleaver.handle(self.location, live))
        except BaseException as error:  # noqa: BLE001 - see the module docstring: never out of a break
            if self.graphs.error is None:
                self.graphs.error = error


def _rows(value: Any, total: int) -> Any:
    """``value`` cut to the step's ``total`` tokens (a graph is captured for a padded batch): the first dim of vLLM's
    flat ``[tokens, ...]`` rows. (The transformers backend's ``[1, tokens, ...]`` would need the second, and a
    one-token step cannot tell the two apart: `install` keeps that backend's traced steps eager.)"""
    if isinstance(value, torch.Tensor):
        return value[:total] if value.dim() and value.shape[0] > total else value
    if isinstance(value, (tuple, list)):
        return type(value)(_rows(item, total) for item in value)
    if isinstance(value, dict):
        return {key: _rows(item, total) for key, item in value.items()}
    return value


class SitedGraphs:
    """The sited graphs of one runner and their routing: ``runner.model``'s FULL ``CUDAGraphWrapper`` gets this
    as its router (`install`); a FULL step replays the sited graph when ``sited_step`` is set."""

    def __init__(self, runner: Any, locations: frozenset[str]) -> None:
        from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphWrapper
        from vllm.config import CUDAGraphMode

        self.locations = locations
        self.wrapper = BreakableCUDAGraphWrapper(runner.model.runnable, runner.vllm_config,
                                                 runtime_mode=CUDAGraphMode.FULL)
        self.capturing = False  # set while the sited set is captured: breaks are recorded, not served
        self.sited_step = False  # set by the runner for a step that carries a trace's block
        self.error: BaseException | None = None
        self.replays = 0  # traced steps that replayed a sited graph (the rest of a trace's steps ran eagerly)

    def stats(self) -> dict:
        """The sites' locations, the breaks of each captured batch size, and the sited replays so far."""
        return {"locations": sorted(self.locations), "breaks": sorted(set(self.breaks().values())),
                "graphs": len(self.breaks()), "replays": self.replays}

    def breaks(self) -> dict[Any, int]:
        """Each captured batch size's number of breaks (one per site)."""
        return {key: entry.capture.num_eager_breaks for key, entry in self.wrapper.entries.items()
                if entry.capture is not None}

    def record(self, interleaver: Any, location: str, value: Any) -> bool:
        """At a handoff: while the sited set is captured and ``location`` is a site, record a break there."""
        if not self.capturing or location not in self.locations:
            return False
        from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture

        capture = BreakableCUDAGraphCapture.current()
        if capture is None or not capture._capturing:
            return False
        capture.add_eager(_Break(interleaver, location, _weak(value), self))
        return True


def _routed(wrapper_class: type) -> type:
    """A subclass of vLLM's ``CUDAGraphWrapper`` whose FULL steps go to the sited graphs when asked (the instance's
    class is swapped, so vLLM's own ``isinstance`` checks and unwrapping still hold)."""

    class Routed(wrapper_class):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            sited: SitedGraphs = self.vlenvoys_sited
            if sited.capturing or sited.sited_step:
                from vllm.config import CUDAGraphMode
                from vllm.forward_context import get_forward_context, is_forward_context_available

                if not sited.capturing and is_forward_context_available() and (
                    get_forward_context().cudagraph_runtime_mode == CUDAGraphMode.FULL
                ):
                    sited.replays += 1
                sited.error = None
                output = sited.wrapper(*args, **kwargs)
                if sited.error is not None:
                    error, sited.error = sited.error, None
                    raise error
                return output
            return super().__call__(*args, **kwargs)

    Routed.__name__ = Routed.__qualname__ = f"Sited{wrapper_class.__name__}"
    return Routed


def install(runner: Any, model: Any) -> SitedGraphs | None:
    """Sited graphs for ``runner`` (its tree ``model``), where the engine opted in, declared sites, and its model
    is wrapped in vLLM's FULL graphs; None otherwise (traced steps stay eager). The interleaver's class is swapped
    for one that records breaks at the sites while they are captured."""
    sites = (runner.vllm_config.additional_config or {}).get(SITES_KEY)
    if not sites or not sited_graphs_asked():
        return None
    from vllm.compilation.cuda_graph import CUDAGraphWrapper

    if not isinstance(runner.model, CUDAGraphWrapper) or type(runner.get_model()).__name__.startswith("Transformers"):
        return None  # no FULL graphs; or the transformers backend's [1, tokens] rows (`_rows`)
    locations = site_locations(model, {name: frozenset(blocks) for name, blocks in sites.items()})
    if not locations:
        return None
    sited = SitedGraphs(runner, locations)
    runner.model.__class__ = _routed(type(runner.model))
    runner.model.vlenvoys_sited = sited
    interleaver = model.interleaver
    base = type(interleaver)

    class SitedInterleaver(base):
        def handle(self, provider: str, value: Any) -> Any:
            if sited.record(self, provider, value):
                return value
            return super().handle(provider, value)

    SitedInterleaver.__name__ = SitedInterleaver.__qualname__ = f"Sited{base.__name__}"
    interleaver.__class__ = SitedInterleaver
    return sited
