"""The worker's side of steered generation: each steered request's vector added by one hook per block per step.

The client (`vlenvoys.generate`, `vlenvoys serve`) sends each request's
steering with the request (``SamplingParams.extra_args``,
`vlenvoys.wire.requests.STEER_KEY`); the worker adds it with one forward hook
on each steered block: each step, the rows of the steered requests at their
steered positions get ``factor * vector``, written back exactly as a trace's
write of ``layer_output`` is (the same declaration's `place`), so the values
are the trace's, bit for bit on the same kernels. Other requests' rows get
zeros.

The hooks read only buffers made once (`Steerer`), so the same hooks serve
an eager engine and one that replays CUDA graphs (``vlenvoys.load(...,
cuda_graphs=True)``): there they are captured into the graphs, on every
block, and each step's plan reaches the replay through those buffers.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..wire.requests import STEER_KEY
from ..wire.steering import read
from . import kernels

__all__ = ["REFUSED", "SETTLE_EVERY", "Steerer", "failures", "plan_step", "request_state"]


# -- worker side -------------------------------------------------------------------------

#: Steps between two reads of the refusal counts (a read waits for the device).
SETTLE_EVERY = 32
REFUSED = "the steered stream had NaN or infinite entries (factor * vector too large for the model's dtype)"


class Steerer:
    """Worker side: each steered request's vector in a slot of a device table, and per step which rows get which.

    Everything the hooks read lives in buffers made once, at fixed addresses,
    so a captured CUDA graph replays the additions with each step's plan:
    ``table[slot]`` is a request's ``factor * vector`` (slot 0 is zeros),
    ``index[row, block]`` the slot whose vector the step's token row gets at
    that block, and ``refused[slot]`` counts rows whose steered stream came
    out non-finite. A step's plan is one host-to-device copy of ``index``.
    """

    def __init__(self, runner: Any, every_block: bool = False) -> None:
        config, scheduler = runner.model_config, runner.scheduler_config
        self.runner = runner
        self.blocks = int(config.hf_text_config.num_hidden_layers)
        self.hidden = int(config.get_hidden_size())
        self.dtype = config.dtype
        device = runner.device
        capture = getattr(runner.compilation_config, "max_cudagraph_capture_size", None) or 0
        rows = max(int(scheduler.max_num_batched_tokens), int(capture))
        # Running requests, plus finished ones whose refusal counts are not read yet.
        self.slots = 2 * int(scheduler.max_num_seqs)
        #: slot -> 1 at the blocks its request steers (host side, to write plans).
        self.mask = np.zeros((self.slots + 1, self.blocks), dtype=np.int64)
        self.table = torch.zeros(self.slots + 1, self.hidden, dtype=self.dtype, device=device)
        self.index = torch.zeros(rows, self.blocks, dtype=torch.long, device=device)
        self.refused = torch.zeros(self.slots + 1, dtype=torch.float32, device=device)
        pinned = device.type == "cuda"
        # Two staging buffers, so a step's plan is written while the last one's copy may still run.
        self.staging = [torch.zeros(rows, self.blocks, dtype=torch.long, pin_memory=pinned) for _ in range(2 if pinned else 1)]
        self.copied = [None] * len(self.staging)  # the event after each staging buffer's last copy
        self.turn = 0
        #: rows of ``index`` that may be non-zero on the device (a graph pads a step with rows past its own).
        self.written = 0
        #: engine request id -> its entries' (slot, blocks, positions), blocks disjoint.
        self.requests: dict[str, list[tuple[int, list[int], Any]]] = {}
        self.owner: dict[int, str] = {}  # slot -> request, running or retired
        self.free = list(range(self.slots, 0, -1))
        self.retired: list[int] = []  # finished requests' slots, free once their counts are read
        self.steps = 0
        #: request stem (the caller's id) -> why its steering was refused.
        self.failed: dict[str, str] = {}
        self.hooked: set[int] = set()
        #: On a graph engine every hook runs at every step (a captured graph replays what ran at capture);
        #: eagerly, a block's hook runs only at steps that steer some row there.
        self.every_block = every_block
        self.active: set[int] = set()
        #: The last step's (spans, steered requests, `changes`) whose plan the device holds, and its blocks.
        self.planned: tuple | None = None
        self.planned_active: set[int] = set()
        self.changes = 0  # counts requests admitted, retired and refused: a plan of the same spans may differ
        #: One fused kernel per hook (`vlenvoys.worker.kernels`) on CUDA devices; torch's operations elsewhere.
        self.fused = device.type == "cuda" and _triton()
        if every_block:
            for block in range(self.blocks):
                self._hook(block)

    def admit(self, request: str, spec: Any) -> None:
        """Take a new request's steering; a spec the model cannot take is refused, never raised here.

        ``spec`` is the request's steering as it travels (`vlenvoys.wire.steering.text`): entries steering
        disjoint blocks, each its own vector and positions, in a slot of its own. Positions ``"prompt"``
        (the prompt's) and ``"generated"`` (from the prompt's length on) are resolved here by the
        request's prompt.
        """
        try:
            entries = [
                (layers, vector, self._positions(request, positions))
                for layers, vector, positions in read(spec, self.hidden, self.blocks)
            ]
            for layer in [layer for layers, _, _ in entries for layer in layers]:
                self._hook(layer)
        except Exception as error:  # from a hand-made extra_args: the engine must go on serving
            self.failed[_stem(request)] = f"its steering could not be read ({type(error).__name__}: {error})"
            return
        if len(self.free) < len(entries):
            self._settle()
        if len(self.free) < len(entries):
            self.failed[_stem(request)] = f"no room for {len(entries)} vectors (the engine holds {self.slots})"
            return
        admitted = []
        for layers, vector, positions in entries:
            slot = self.free.pop()
            self.table[slot].copy_(vector.to(self.dtype), non_blocking=True)
            self.mask[slot] = 0
            self.mask[slot, layers] = 1
            self.owner[slot] = request
            admitted.append((slot, layers, positions))
        self.requests[request] = admitted
        self.changes += 1

    def _positions(self, request: str, positions: Any) -> Any:
        """An entry's positions as the plan reads them: None, a set, or ``{"start", "stop"}`` resolved by the prompt."""
        if positions in ("prompt", "generated"):
            length = int(request_state(self.runner, request).num_prompt_tokens)
            positions = {"start": 0, "stop": length} if positions == "prompt" else {"start": length, "stop": None}
        elif positions == "all":
            positions = None
        if isinstance(positions, list):
            positions = frozenset(int(position) for position in positions)
        elif positions is not None:
            positions = {"start": int(positions["start"]), "stop": positions["stop"]}
        return positions

    def _hook(self, layer: int) -> None:
        if layer in self.hooked:
            return
        model = self.runner.nnsight_model
        envoy = model.layers[layer]
        value = type(envoy).layer_output
        path, side = value._location(envoy).rsplit(".", 1)
        if side != "output":  # `unsteerable` admits a block output only
            raise ValueError(f"layer_output of block {layer} is read at an input")
        module = _module_at(model, path)._module
        index, table, refused = self.index, self.table, self.refused

        def steer(module: Any, args: Any, output: Any) -> Any:
            if not self.every_block and layer not in self.active:
                return None
            if self.fused:
                halves = value.halves(envoy, output)
                if halves is not None:
                    # Rows of the step: vLLM's transformers backend runs the step as one sequence, [1, tokens, hidden].
                    halves = tuple(None if half is None else half.flatten(0, -2) for half in halves)
                if halves is not None and kernels.fits(*halves):
                    # One launch, in place; unsteered rows are not touched (see `vlenvoys.worker.kernels`).
                    kernels.steer_rows(*halves, table, index, refused, layer)
                    return None
            current = value.pick(envoy, output)
            flat = current.flatten(0, -2)  # [tokens, hidden], with or without the backend's batch axis
            rows = index[: flat.shape[0], layer]
            added = flat + table.index_select(0, rows)
            # A row the steering makes non-finite keeps its stream (nothing non-finite reaches the
            # key/value cache, which later requests reuse) and its request is refused (`_settle`).
            finite = torch.isfinite(added).all(-1)
            refused.index_add_(0, rows, (~finite).to(refused.dtype))
            added = torch.where(finite[:, None], added, flat).view_as(current)
            # What a trace's ``stream[:, positions] += v`` writes back, for the whole step at once.
            return value.place(envoy, output, added, current)

        module.register_forward_hook(steer)
        self.hooked.add(layer)

    def step(self, scheduler_output: Any, spans: Sequence[tuple[str, int, int]]) -> None:
        """Admit the step's new steered requests, retire finished ones, and copy the step's plan to the device."""
        for request in scheduler_output.finished_req_ids:
            entries = self.requests.pop(request, None)
            if entries is not None:
                self.retired += [slot for slot, _, _ in entries]
                self.changes += 1
        for data in scheduler_output.scheduled_new_reqs:
            spec = (getattr(data.sampling_params, "extra_args", None) or {}).get(STEER_KEY)
            if spec is not None:
                self.admit(data.req_id, spec)
        self.steps += 1
        if self.steps % SETTLE_EVERY == 0:
            self._settle()
        key = (spans, len(self.requests), self.changes)
        if key == self.planned:
            # The same rows of the same requests as the last step (a decode step of an unchanged batch), none
            # steered at some positions only: the device holds this step's plan already.
            self.active = self.planned_active
            return
        steered = [(start, count, request) for request, start, count in spans if request in self.requests]
        self.active = set()
        self.planned, self.planned_active = None, self.active
        if not steered and not self.written:
            self.planned = key
            return  # the device's plan is all zeros already
        total = spans[-1][1] + spans[-1][2] if spans else 0
        width = max(total, self.written)
        staged = self._staging()[:width]
        plan = staged.numpy()
        plan[:] = 0
        # (first row, rows, slot) of entries steering every position, by the entry's place in its request's
        # list: within one place no two entries share a row, and a request's entries steer disjoint blocks,
        # so each place's slots are added to the zeroed plan at once.
        whole: list[list[tuple[int, int, int]]] = []
        for start, count, request in steered:
            for place, (slot, blocks, positions) in enumerate(self.requests[request]):
                if not self.every_block:
                    self.active.update(blocks)
                if positions is None:
                    while len(whole) <= place:
                        whole.append([])
                    whole[place].append((start, count, slot))
                    continue
                first = request_state(self.runner, request).num_computed_tokens
                rows = [start + offset for offset in range(count) if _steered(first + offset, positions)]
                plan[rows] += self.mask[slot] * slot
        for entries in whole:
            if not entries:
                continue
            starts, counts, slots = np.array(entries, dtype=np.int64).T
            # Each request's rows, side by side: start + 0 .. count - 1.
            rows = np.arange(counts.sum()) + np.repeat(starts - (np.cumsum(counts) - counts), counts)
            owners = np.repeat(slots, counts)
            plan[rows] += self.mask[owners] * owners[:, None]
        self.index[:width].copy_(staged, non_blocking=True)
        if self.copied[self.turn] is not None:
            self.copied[self.turn].record()
        self.written = total if steered else 0
        if all(positions is None for _, _, request in steered for _, _, positions in self.requests[request]):
            self.planned = key  # a plan by positions changes with every step

    def _staging(self) -> torch.Tensor:
        self.turn = (self.turn + 1) % len(self.staging)
        if len(self.staging) > 1:
            event = self.copied[self.turn]
            if event is None:
                event = self.copied[self.turn] = torch.cuda.Event()
            else:
                event.synchronize()  # its last copy has left the staging buffer
        return self.staging[self.turn]

    def _settle(self) -> None:
        """Read the refusal counts (one wait for the device): refused requests go on unsteered, retired slots are freed.

        Until then a refused request's non-finite rows are still left unsteered at every step
        (the hook's guard), so the cache stays clean; only its vector is added a little longer.
        """
        counts = self.refused.tolist()
        for slot, count in enumerate(counts):
            if slot and count and slot in self.owner:
                request = self.owner[slot]
                self.failed.setdefault(_stem(request), REFUSED)
                entries = self.requests.pop(request, None)
                if entries is not None:  # unsteered from here on, every entry
                    self.retired += [each for each, _, _ in entries]
                    self.changes += 1
        if any(counts):
            self.refused.zero_()
        for slot in self.retired:
            self.owner.pop(slot, None)
            self.free.append(slot)
        self.retired = []

    def failures(self, requests: Sequence[str]) -> dict[str, str]:
        """Why the steering of these requests (the caller's ids) was refused, for those refused; forgets them."""
        with torch.inference_mode():  # the counts were made in a step, under it
            self._settle()
        return {request: self.failed.pop(request) for request in requests if request in self.failed}


def _triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _module_at(model: Any, path: str) -> Any:
    for envoy in model.modules():
        if envoy.path == path:
            return envoy
    raise KeyError(path)


def _stem(request: str) -> str:
    from nnsight.modeling.vllm.model_runners.GPUModelRunner import Request

    return Request(request).engine_id


def _steered(position: int, positions: Any) -> bool:
    if isinstance(positions, dict):  # a slice
        return position >= positions["start"] and (positions["stop"] is None or position < positions["stop"])
    return position in positions


def request_state(runner: Any, request: str) -> Any:
    """``request``'s prompt length and tokens computed before this step (``num_prompt_tokens``,
    ``num_computed_tokens``): V1's per-request state, or what the V2 runner tells (``vlenvoys_request_state``)."""
    state = getattr(runner, "vlenvoys_request_state", None)
    return runner.requests[request] if state is None else state(request)


def plan_step(runner: Any, scheduler_output: Any, spans: Sequence[tuple[str, int, int]]) -> None:
    """Worker side, each step (`vlenvoys.worker.runner.StandardRunner`): the runner's `Steerer` plans the step.

    On an eager engine the steerer is made when the first steered request
    arrives; until then a step costs one look at its new requests.
    """
    current = getattr(runner, "vlenvoys_steerer", None)
    if current is None:
        if not any(STEER_KEY in (getattr(data.sampling_params, "extra_args", None) or {})
                   for data in scheduler_output.scheduled_new_reqs):
            return
        current = runner.vlenvoys_steerer = Steerer(runner)
    current.step(scheduler_output, spans)


def failures(worker: Any, requests: list[str]) -> dict[str, str]:
    """The worker's RPC (`vlenvoys.worker.runner.StandardWorker`): refused steerings of ``requests``, by caller id."""
    current = getattr(worker.model_runner, "vlenvoys_steerer", None)
    return {} if current is None else current.failures(requests)
