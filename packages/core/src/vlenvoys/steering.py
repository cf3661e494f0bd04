"""Steered generation at engine speed: each request's steering added by one hook per block per step.

Steering in a trace (``model.steer`` in ``for _ in tracer.iter[...]``) runs
one nnsight worker per request per step; on a GPU that costs more than the
forward (measured on an H200: 0.24 of plain eager vLLM). `generate` instead
sends each request's `Steering` with the request (``SamplingParams.extra_args``,
`KEY`), and the worker adds it with one forward hook on each steered block:
each step, the rows of the steered requests at their steered positions get
``factor * vector``, written back exactly as a trace's write of
``layer_output`` is (the same declaration's `place`), so the values are the
trace's, bit for bit on the same kernels. Other requests' rows are untouched.

The hooks run in the eager forward: on an engine that replays CUDA graphs
they would not run at replayed steps, so this path takes the eager engine
`vlenvoys.load` starts (nnsight's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

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
            step that feeds it), a list of positions (0 is the prompt's first
            token; generated token ``k`` (from 0) sits at ``len(prompt) + k``),
            or a ``slice`` with non-negative bounds (``slice(len(prompt),
            None)``: generated tokens only).
    """

    layers: int | Sequence[int]
    vector: torch.Tensor
    factor: float = 1.0
    positions: Sequence[int] | slice | None = None

    def encode(self, model: Any) -> dict:
        """The request's steering as ``extra_args`` carry it: blocks, the scaled vector, positions.

        Raises:
            IndexError: a block that does not exist.
            ValueError: a vector of another shape, a non-finite scaled vector,
                or negative or stepped positions.
            TypeError: a vector that is not a float tensor.
        """
        from .envoys import block_index

        if not isinstance(self.vector, torch.Tensor) or not self.vector.is_floating_point():
            raise TypeError(f"Steering.vector: expected a float tensor of shape [{model.hidden_size}], got {self.vector!r}")
        if tuple(self.vector.shape) != (model.hidden_size,):
            raise ValueError(
                f"Steering.vector: expected shape [{model.hidden_size}] (hidden_size), got {list(self.vector.shape)}"
            )
        layers = [self.layers] if isinstance(self.layers, int) else list(self.layers)
        if not layers or not all(isinstance(layer, int) and not isinstance(layer, bool) for layer in layers):
            raise TypeError(f"Steering.layers: expected a block index or a list of them, got {self.layers!r}")
        blocks = sorted({block_index(layer, model.num_layers) for layer in layers})
        # Scaled where a trace scales it: in the model's dtype (``factor * vector.to(dtype)``).
        scaled = float(self.factor) * self.vector.detach().to(device="cpu", dtype=_dtype(model))
        if not torch.isfinite(scaled).all():
            raise ValueError(f"Steering: factor * vector has non-finite entries in {_dtype(model)} (factor {self.factor})")
        return {
            "layers": blocks,
            # The model-dtype values, exact in float32, as a list: the request's arguments travel as msgpack.
            "vector": scaled.float().tolist(),
            "positions": _positions(self.positions),
        }


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
        RuntimeError: the engine has been shut down.
        NotImplementedError: the engine runs in ``mode="async"``, or its layer
            output is not one tensor a block hands on.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from .collect import _check_engine, _checked_prompts

    _check_engine(model)
    prompts = _checked_prompts(prompts)
    reason = eligible(model)
    if reason is not None:
        raise NotImplementedError(f"steered generation needs a block output it can write: {reason}")
    if steering is None or isinstance(steering, Steering):
        steering = [steering] * len(prompts)
    steering = list(steering)
    if len(steering) != len(prompts):
        raise ValueError(f"steering: {len(steering)} entries for {len(prompts)} prompts")
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        sampling_params = [sampling_params or SamplingParams()] * len(prompts)
    if len(sampling_params) != len(prompts):
        raise ValueError(f"sampling_params: {len(sampling_params)} entries for {len(prompts)} prompts")
    encoded: dict[int, dict] = {}  # one encoding per distinct Steering object
    per_request = []
    for each, params in zip(steering, sampling_params, strict=True):
        if each is not None and not isinstance(each, Steering):
            raise TypeError(f"steering: expected vlenvoys.Steering or None per prompt, got {type(each).__name__}")
        if each is not None:
            if id(each) not in encoded:
                encoded[id(each)] = each.encode(model)
            params = params.clone()
            params.extra_args = {**(params.extra_args or {}), KEY: encoded[id(each)]}
        per_request.append(params)
    inputs = [prompt if isinstance(prompt, str) else TokensPrompt(prompt_token_ids=prompt) for prompt in prompts]
    return model.vllm_entrypoint.generate(inputs, per_request, use_tqdm=use_tqdm)


def eligible(model: Any) -> str | None:
    """Why `generate` cannot steer ``model`` (None when it can): its layer output must be a `Flat` at a block's output."""
    from .values import Derived, Flat

    block = model.layers[0]
    value = type(block).layer_output
    if not isinstance(value, Flat) or isinstance(value, Derived) or value._batch(block):
        return "layer_output is recomputed per request or batched"
    if value.located_key(block).startswith("source."):
        return "layer_output is read at an operation inside the forward"
    return None


# -- worker side -------------------------------------------------------------------------


class Steerer:
    """Worker side: the steered requests and, each step, which of the step's rows get which vector."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        #: engine request id -> (blocks, vector on the device in the model's dtype, positions).
        self.requests: dict[str, tuple[list[int], torch.Tensor, Any]] = {}
        #: block -> (rows, vectors): this step's additions, or absent.
        self.plan: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.hooked: set[int] = set()

    def admit(self, request: str, spec: dict) -> None:
        model = self.runner.nnsight_model
        parameter = next(self.runner.get_model().parameters())
        vector = torch.tensor(spec["vector"], dtype=torch.float32).to(device=parameter.device, dtype=_dtype_of(self.runner))
        positions = spec["positions"]
        if isinstance(positions, list):
            positions = frozenset(positions)
        self.requests[request] = (list(spec["layers"]), vector, positions)
        for layer in spec["layers"]:
            if layer not in self.hooked:
                self._hook(model, layer)
                self.hooked.add(layer)

    def _hook(self, model: Any, layer: int) -> None:
        envoy = model.layers[layer]
        value = type(envoy).layer_output
        path, side = value._location(envoy).rsplit(".", 1)
        module = {each.path: each for each in model.modules()}[path]._module
        assert side == "output", side  # `eligible` admits a block output only

        def steer(module: Any, args: Any, output: Any) -> Any:
            plan = self.plan.get(layer)
            if plan is None:
                return None
            rows, vectors = plan
            current = value.pick(envoy, output)
            # What a trace's ``stream[:, positions] += v`` writes back, for all the step's steered rows at once.
            return value.place(envoy, output, current.index_add(0, rows, vectors), current)

        module.register_forward_hook(steer)

    def step(self, scheduler_output: Any) -> None:
        """Admit the step's new steered requests, forget finished ones, and plan the step's additions."""
        for request in scheduler_output.finished_req_ids:
            self.requests.pop(request, None)
        for data in scheduler_output.scheduled_new_reqs:
            spec = (getattr(data.sampling_params, "extra_args", None) or {}).get(KEY)
            if spec is not None:
                self.admit(data.req_id, spec)
        self.plan = {}
        if not self.requests:
            return
        tokens = scheduler_output.num_scheduled_tokens
        rows: dict[int, list[int]] = {}
        owners: dict[int, list[int]] = {}
        vectors, start = [], 0
        for request in self.runner.input_batch.req_ids:
            count = tokens.get(request)
            if count is None:
                continue
            spec = self.requests.get(request)
            if spec is not None:
                blocks, vector, positions = spec
                first = self.runner.requests[request].num_computed_tokens
                picked = [start + offset for offset in range(count) if _steered(first + offset, positions)]
                if picked:
                    vectors.append(vector)
                    for block in blocks:
                        rows.setdefault(block, []).extend(picked)
                        owners.setdefault(block, []).extend([len(vectors) - 1] * len(picked))
            start += count
        if not vectors:
            return
        table = torch.stack(vectors)
        device = table.device
        for block, block_rows in rows.items():
            index = torch.tensor(owners[block], dtype=torch.long).to(device, non_blocking=True)
            self.plan[block] = (torch.tensor(block_rows, dtype=torch.long).to(device, non_blocking=True),
                                table.index_select(0, index))

def _steered(position: int, positions: Any) -> bool:
    if positions is None:
        return True
    if isinstance(positions, dict):  # a slice
        return position >= positions["start"] and (positions["stop"] is None or position < positions["stop"])
    return position in positions


def _dtype_of(runner: Any) -> torch.dtype:
    return runner.model_config.dtype


def plan_step(runner: Any, scheduler_output: Any) -> None:
    """Worker side, each step (`vlenvoys.workers.StandardRunner`): the runner's `Steerer` plans the step.

    The steerer is made when the first steered request arrives; until then a step costs one look at its new requests.
    """
    current = getattr(runner, "vlenvoys_steerer", None)
    if current is None:
        if not any(KEY in (getattr(data.sampling_params, "extra_args", None) or {})
                   for data in scheduler_output.scheduled_new_reqs):
            return
        current = runner.vlenvoys_steerer = Steerer(runner)
    current.step(scheduler_output)


def step_done(runner: Any) -> None:
    current = getattr(runner, "vlenvoys_steerer", None)
    if current is not None:
        current.plan = {}
