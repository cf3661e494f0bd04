"""Steered generation at engine speed: each request's steering added by one hook per block per step.

Steering in a trace (``model.steer`` in ``for _ in tracer.iter[...]``) runs
one nnsight worker per request per step; on a GPU that costs more than the
forward (measured on an H200: 0.24 of plain eager vLLM). `generate` instead
sends each request's `Steering` with the request (``SamplingParams.extra_args``,
`KEY`), and the worker adds it with one forward hook on each steered block:
each step, the rows of the steered requests at their steered positions get
``factor * vector``, written back exactly as a trace's write of
``layer_output`` is (the same declaration's `place`), so the values are the
trace's, bit for bit on the same kernels. Other requests' rows get zeros.

The hooks read only buffers made once (`Steerer`), so the same hooks serve
an eager engine and one that replays CUDA graphs (``vlenvoys.load(...,
cuda_graphs=True)``): there they are captured into the graphs, on every
block, and each step's plan reaches the replay through those buffers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["KEY", "Steering", "generate"]

#: ``SamplingParams.extra_args`` key holding a request's steering (`Steering.encode`).
KEY = "vlenvoys_steer"


@dataclasses.dataclass(frozen=True)
class Steering:
    """Add ``factor * vector`` to the residual stream leaving ``layers``, as nnterp's ``steer``.

    Attributes:
        layers: A block index or several (negative count from the end); the
            stream is `layer_output`, read where a trace reads it.
        vector: ``[hidden_size]``, any float dtype, any device; it is moved to
            the engine's device and cast to the model's dtype, then multiplied
            by ``factor`` there, as ``model.steer`` does.
        factor: The vector's multiplier.
        positions: Which token positions of each sequence get it: None for
            every one (the prompt's and each generated token's, at the decode
            step that feeds it), a position or a list of them (0 is the
            prompt's first token; generated token ``k`` (from 0) sits at
            ``len(prompt) + k``; positions the sequence never reaches steer
            nothing), or a ``slice`` with non-negative bounds and no step
            (``slice(len(prompt), None)``: generated tokens only).
    """

    layers: int | Sequence[int]
    vector: torch.Tensor
    factor: float = 1.0
    positions: Sequence[int] | slice | None = None

    def encode(self, model: Any) -> dict:
        """The request's steering as ``extra_args`` carry it: blocks, the scaled vector, positions.

        Raises:
            NoSuchBlock: a block that does not exist (an IndexError).
            ValueError: a vector of another shape, a scaled vector with
                non-finite entries or entries beyond the square root of the
                dtype's largest value, or negative or stepped positions.
            TypeError: a vector that is not a float tensor, a factor that is
                not a number, blocks that are not ints.
        """
        return self.encode_for(model.hidden_size, model.num_layers, _dtype(model))

    def encode_for(self, hidden_size: int, num_layers: int, dtype: torch.dtype) -> dict:
        """`encode` for a model known by its shape alone: ``hidden_size``, ``num_layers`` blocks, ``dtype``.

        What `vlenvoys.serving` uses, which holds no loaded model; raises as `encode`.
        """
        from .envoys import block_index

        if not isinstance(self.vector, torch.Tensor) or not self.vector.is_floating_point():
            got = f"a {self.vector.dtype} tensor" if isinstance(self.vector, torch.Tensor) else type(self.vector).__name__
            raise TypeError(f"Steering.vector: expected a float tensor of shape [{hidden_size}], got {got}")
        if not isinstance(self.factor, numbers.Real) or isinstance(self.factor, bool):
            raise TypeError(f"Steering.factor: expected a number, got {type(self.factor).__name__}")
        if tuple(self.vector.shape) != (hidden_size,):
            raise ValueError(
                f"Steering.vector: expected shape [{hidden_size}] (hidden_size), got {list(self.vector.shape)}"
            )
        layers = [self.layers] if isinstance(self.layers, int) else self.layers
        if not isinstance(layers, (list, tuple, range)) or not layers or not all(
            isinstance(layer, int) and not isinstance(layer, bool) for layer in layers
        ):
            raise TypeError(f"Steering.layers: expected a block index or a list of them, got {self.layers!r}")
        blocks = sorted({block_index(layer, num_layers) for layer in layers})
        # Scaled where a trace scales it: in the model's dtype (``factor * vector.to(dtype)``).
        scaled = float(self.factor) * self.vector.detach().to(device="cpu", dtype=dtype)
        if not torch.isfinite(scaled).all():
            raise ValueError(f"Steering: factor * vector has non-finite entries in {dtype} (factor {self.factor})")
        # The next norm squares the stream: entries past sqrt(max) would overflow it, and the
        # non-finite keys and values computed from it would reach the engine's cache.
        limit = torch.finfo(dtype).max ** 0.5
        if scaled.abs().max().item() > limit:
            raise ValueError(
                f"Steering: factor * vector has entries beyond {limit:.3g} (the square root of {dtype}'s largest "
                f"value; factor {self.factor}): the next norm would overflow"
            )
        # The next norm sums the squares in float32: entries each under the bound can still overflow that sum
        # (1.5e19 in each of 128 entries of a bfloat16 stream gave a uniform distribution, neither refused nor left unsteered).
        bound = torch.finfo(torch.float32).max ** 0.5
        if scaled.double().norm().item() > bound:
            raise ValueError(
                f"Steering: factor * vector has a norm beyond {bound:.3g} (the square root of float32's largest value, "
                f"where the next norm sums its squares; factor {self.factor}): the next norm would overflow"
            )
        return {
            "layers": blocks,
            # The model-dtype values, exact in float32, as raw bytes: vLLM deep-copies and walks a request's
            # extra_args on its way in, which for a list of 2048 floats took 2.5 ms a request (bytes: 0.1).
            "vector": scaled.float().numpy().tobytes(),
            "positions": _positions(self.positions),
        }


def _digest(spec: dict) -> str:
    """A steering's fingerprint (its requests' cache salt)."""
    rest = {key: value for key, value in spec.items() if key != "vector"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode() + bytes(spec["vector"])).hexdigest()


def _vector(encoded: Any) -> torch.Tensor:
    """A spec's vector as float32: raw bytes (`Steering.encode`), their base64 text (a spec sent as JSON,
    `vlenvoys.serving`), or a list of numbers (a hand-written request)."""
    if isinstance(encoded, str):
        import base64

        encoded = base64.b64decode(encoded, validate=True)
    if isinstance(encoded, (bytes, bytearray, memoryview)):
        if len(encoded) % 4:
            raise ValueError(f"a vector of {len(encoded)} bytes is not float32 values")
        return torch.frombuffer(bytearray(encoded), dtype=torch.float32)
    return torch.tensor(encoded, dtype=torch.float32)


def _dtype(model: Any) -> torch.dtype:
    return model.vllm_entrypoint.llm_engine.model_config.dtype


def _positions(positions: Any) -> Any:
    if positions is None:
        return None
    if isinstance(positions, slice):
        start, stop = positions.start or 0, positions.stop
        if positions.step not in (None, 1) or start < 0 or (stop is not None and stop < 0):
            raise ValueError(f"Steering.positions: a slice needs non-negative bounds and no step, got {positions}")
        return {"start": int(start), "stop": None if stop is None else int(stop)}
    listed = [positions] if isinstance(positions, int) else list(positions)
    if not all(isinstance(each, int) and not isinstance(each, bool) and each >= 0 for each in listed):
        raise ValueError(
            f"Steering.positions: expected non-negative token positions (a generation's length is not known "
            f"in advance, so none count from the end), got {positions!r}"
        )
    return sorted(set(listed))


def generate(
    model: Any,
    prompts: Sequence[str | Sequence[int]],
    sampling_params: Any = None,
    *,
    steering: Steering | Sequence[Steering | None] | None = None,
    use_tqdm: bool | Callable = True,
) -> list[Any]:
    """Generate from ``prompts`` with each request's own steering; vLLM's ``LLM.generate`` otherwise.

    Args:
        model: A model from `vlenvoys.load` (the synchronous engine).
        prompts: Strings or lists of token ids, one request each.
        sampling_params: vLLM ``SamplingParams`` (one for all, or one per
            prompt); vLLM's defaults when None. Their ``extra_args`` are kept.
        steering: One `Steering` for every request, one per prompt (None:
            that request is not steered), or None.
        use_tqdm: vLLM's progress bar.

    Returns:
        vLLM's ``RequestOutput`` of each prompt, in prompt order.

    Raises:
        ValueError, TypeError, IndexError: a `Steering` the model cannot take
            (`Steering.encode`), or a steering list of another length than
            ``prompts``; nothing is submitted then.
        InvalidWrite: a request's steered stream had NaN or infinite entries
            (a factor too large for the model's dtype): those rows were left
            unsteered and the request went on without its steering; every
            output is on the error's ``outputs``.
        RuntimeError: the engine has been shut down.
        NotImplementedError: the engine runs in ``mode="async"``, or its layer
            output is not one tensor a block hands on.

    With prefix caching on, a steered request's key/value cache is salted by
    its steering (vLLM's ``cache_salt``): it is shared only between requests
    steered alike.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from .collect import _check_engine, _checked_prompts

    _check_engine(model)
    prompts = _checked_prompts(prompts)
    if steering is None or isinstance(steering, Steering):
        steering = [steering] * len(prompts)
    steering = list(steering)
    reason = eligible(model)
    if reason is not None and any(each is not None for each in steering):
        # Plain generation needs no block output: it goes on where steering cannot.
        raise NotImplementedError(f"steered generation needs a block output it can write: {reason}")
    if len(steering) != len(prompts):
        raise ValueError(f"steering: {len(steering)} entries for {len(prompts)} prompts")
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        sampling_params = [sampling_params or SamplingParams()] * len(prompts)
    if not isinstance(sampling_params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in sampling_params):
        raise TypeError("sampling_params: expected vLLM SamplingParams, or a list of them (one per prompt)")
    if len(sampling_params) != len(prompts):
        raise ValueError(f"sampling_params: {len(sampling_params)} entries for {len(prompts)} prompts")
    encoded: dict[int, tuple[dict, str]] = {}  # one encoding per distinct Steering object
    per_request, inputs = [], []
    for prompt, each, params in zip(prompts, steering, sampling_params, strict=True):
        if each is not None and not isinstance(each, Steering):
            raise TypeError(f"steering: expected vlenvoys.Steering or None per prompt, got {type(each).__name__}")
        options = {}
        if each is not None:
            if id(each) not in encoded:
                spec = each.encode(model)
                encoded[id(each)] = spec, _digest(spec)
            spec, salt = encoded[id(each)]
            params = params.clone()
            params.extra_args = {**(params.extra_args or {}), KEY: spec}
            # A steered request's key/value cache is its steering's: salted, a prefix cache
            # shares it only with requests steered alike, never with unsteered ones.
            options["cache_salt"] = f"vlenvoys-steer-{salt}"
        per_request.append(params)
        if isinstance(prompt, str):
            inputs.append({"prompt": prompt, **options})
        else:
            inputs.append(TokensPrompt(prompt_token_ids=prompt, **options))
    from .stepping import abandoned_on_error

    with abandoned_on_error(model):  # an interrupted call leaves nothing running on the engine
        outputs = model.vllm_entrypoint.generate(inputs, per_request, use_tqdm=use_tqdm)
    if encoded:
        _raise_failures(model, outputs)
    return outputs


def _raise_failures(model: Any, outputs: list) -> None:
    """Raise `InvalidWrite` if the engine refused some request's steering (the outputs are on the error)."""
    from .errors import InvalidWrite

    ids = [output.request_id for output in outputs]
    failed = {}
    for answer in model.vllm_entrypoint.llm_engine.collective_rpc("vlenvoys_steer_failures", args=(ids,)):
        failed.update(answer)
    if failed:
        number = next(index for index, request in enumerate(ids) if request in failed)
        error = InvalidWrite(
            f"steering of {len(failed)} prompt(s) was refused on the engine, prompt {number} first: "
            f"{failed[ids[number]]}; their rows were left unsteered from there on (nothing non-finite reached "
            "the key/value cache), and the other prompts' outputs are intact (on this error's .outputs)"
        )
        error.outputs = outputs
        raise error


def eligible(model: Any) -> str | None:
    """Why `generate` cannot steer ``model`` (None when it can): its layer output must be a `Flat` at a block's output."""
    from .values import unhookable

    block = model.layers[0]
    value = type(block).layer_output
    reason = unhookable(block, value)
    return None if reason is None else f"layer_output {reason}"


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
        #: One fused kernel per hook (`vlenvoys.kernels`) on CUDA devices; torch's operations elsewhere.
        self.fused = device.type == "cuda" and _triton()
        if every_block:
            for block in range(self.blocks):
                self._hook(block)

    def admit(self, request: str, spec: Any) -> None:
        """Take a new request's steering; a spec the model cannot take is refused, never raised here.

        ``spec`` is a dict (`Steering.encode`), a list of such dicts steering
        disjoint blocks (each its own vector and positions, in a slot of its
        own), or the JSON text of either (what an HTTP request's ``vllm_xargs``
        can carry, `vlenvoys.serving`), whose ``positions`` may also be
        ``"prompt"`` (the prompt's positions) or ``"generated"`` (from the
        prompt's length on), resolved here by the request's prompt.
        """
        try:
            if isinstance(spec, str):
                spec = json.loads(spec)
            entries = [self._read(request, each) for each in (spec if isinstance(spec, list) else [spec])]
            blocks = [layer for layers, _, _ in entries for layer in layers]
            if not entries or len(set(blocks)) != len(blocks):
                raise ValueError(f"entries must steer disjoint blocks, got {blocks}")
            for layer in blocks:
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

    def _read(self, request: str, spec: dict) -> tuple[list[int], torch.Tensor, Any]:
        """One entry of a spec: its blocks, its vector (float32) and its positions, checked against the model."""
        layers = [int(layer) for layer in spec["layers"]]
        if not layers or any(layer < 0 or layer >= self.blocks for layer in layers):
            raise ValueError(f"blocks {layers}: the model has blocks 0 to {self.blocks - 1}")
        vector = _vector(spec["vector"])
        if tuple(vector.shape) != (self.hidden,):
            raise ValueError(f"a vector of shape {list(vector.shape)} for a stream of {self.hidden}")
        if not torch.isfinite(vector).all():
            raise ValueError("the vector is not finite")
        positions = spec["positions"]
        if positions in ("prompt", "generated"):
            length = int(self.runner.requests[request].num_prompt_tokens)
            positions = {"start": 0, "stop": length} if positions == "prompt" else {"start": length, "stop": None}
        elif positions == "all":
            positions = None
        if isinstance(positions, list):
            positions = frozenset(int(position) for position in positions)
        elif positions is not None:
            positions = {"start": int(positions["start"]), "stop": positions["stop"]}
        return layers, vector, positions

    def _hook(self, layer: int) -> None:
        if layer in self.hooked:
            return
        model = self.runner.nnsight_model
        envoy = model.layers[layer]
        value = type(envoy).layer_output
        path, side = value._location(envoy).rsplit(".", 1)
        if side != "output":  # `eligible` admits a block output only
            raise ValueError(f"layer_output of block {layer} is read at an input")
        module = _module_at(model, path)._module
        index, table, refused = self.index, self.table, self.refused
        from . import kernels

        def steer(module: Any, args: Any, output: Any) -> Any:
            if not self.every_block and layer not in self.active:
                return None
            if self.fused:
                halves = value.halves(envoy, output)
                if halves is not None:
                    # Rows of the step: vLLM's transformers backend runs the step as one sequence, [1, tokens, hidden].
                    halves = tuple(None if half is None else half.flatten(0, -2) for half in halves)
                if halves is not None and kernels.fits(*halves):
                    # One launch, in place; unsteered rows are not touched (see `vlenvoys.kernels`).
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
            spec = (getattr(data.sampling_params, "extra_args", None) or {}).get(KEY)
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
                first = self.runner.requests[request].num_computed_tokens
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


def plan_step(runner: Any, scheduler_output: Any, spans: Sequence[tuple[str, int, int]]) -> None:
    """Worker side, each step (`vlenvoys.workers.StandardRunner`): the runner's `Steerer` plans the step.

    On an eager engine the steerer is made when the first steered request
    arrives; until then a step costs one look at its new requests.
    """
    current = getattr(runner, "vlenvoys_steerer", None)
    if current is None:
        if not any(KEY in (getattr(data.sampling_params, "extra_args", None) or {})
                   for data in scheduler_output.scheduled_new_reqs):
            return
        current = runner.vlenvoys_steerer = Steerer(runner)
    current.step(scheduler_output, spans)


def failures(worker: Any, requests: list[str]) -> dict[str, str]:
    """The worker's RPC (`vlenvoys.workers.StandardWorker`): refused steerings of ``requests``, by caller id."""
    current = getattr(worker.model_runner, "vlenvoys_steerer", None)
    return {} if current is None else current.failures(requests)
