"""A request's steering as it travels to the worker: one validation, one format, one reader.

Whoever steers a request, `vlenvoys.generate` (a `vlenvoys.Steering`) or a
served request's ``steering`` field (`vlenvoys.serve.steering`), makes each
entry with `entry`, the one check of a steering against the model, and writes
the request's entries with `text`, the one format: JSON text under
`vlenvoys.wire.requests.STEER_KEY`, each entry's ``factor * vector`` (in the
model's dtype, exact in float32) as base64 of its float32 bytes, so it fits
an HTTP request's ``vllm_xargs`` as it is, and vLLM copies a string, not a
list of numbers, on the request's way in. The request's cache salt is
`salt_of` that text. The worker reads it back with `read`, which refuses
(by name, the engine going on) what no `text` made: blocks the model lacks,
another width, entries that overlap.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch

from ..values.envoys import block_index

__all__ = ["MAX_POSITIONS", "NAMED_POSITIONS", "Entry", "Overlap", "entry", "read", "salt_of", "steering_vector", "text"]

#: Positions resolved by the worker from the request's prompt: its own, or every one after it.
NAMED_POSITIONS = ("prompt", "generated")
#: The most positions a steering or a capture may list (a slice, or "prompt"/"generated", covers any length).
MAX_POSITIONS = 1 << 16


@dataclasses.dataclass(frozen=True)
class Entry:
    """One steering of a request, checked (`entry`): ``vector`` added at ``positions`` of the stream leaving ``layers``.

    ``layers``: block indices, non-negative, sorted; ``vector``: ``factor * vector`` in the model's dtype as
    float32 bytes; ``positions``: None (every one), a sorted list, ``{"start", "stop"}`` (a slice), or one of
    `NAMED_POSITIONS`.
    """

    layers: tuple[int, ...]
    vector: bytes
    positions: Any = None


def steering_vector(vector: Any, hidden_size: int, name: str) -> torch.Tensor:
    """``vector`` as the ``[hidden_size]`` tensor a steering adds: the one check of `entry` and of ``model.steer``.

    Takes what nnterp's ``steer`` adds to the stream: a real tensor (float or integer) of shape
    ``[hidden_size]``, or with leading axes of size 1 (``[1, hidden_size]``), which broadcast to every
    position alike. ``name`` is the argument named in the errors.

    Raises:
        TypeError: not a tensor, or a bool or complex one.
        ValueError: another last axis, or a leading axis of another size than 1 (``[2, hidden_size]`` would
            add a different row at each position, or fail, depending on the prompt's length).
    """
    if not isinstance(vector, torch.Tensor) or vector.dtype == torch.bool or vector.is_complex():
        got = f"a {vector.dtype} tensor" if isinstance(vector, torch.Tensor) else type(vector).__name__
        raise TypeError(f"{name}: expected a real tensor of shape [{hidden_size}] (hidden_size), got {got}")
    shape = list(vector.shape)
    if shape[-1:] != [hidden_size] or any(size != 1 for size in shape[:-1]):
        raise ValueError(f"{name}: expected shape [{hidden_size}] (hidden_size), or [1, {hidden_size}], got {shape}")
    return vector.reshape(hidden_size)


def entry(
    layers: Any, vector: Any, factor: Any, positions: Any, *, hidden_size: int, num_layers: int, dtype: torch.dtype
) -> Entry:
    """A steering checked against a model of ``hidden_size``, ``num_layers`` blocks and ``dtype``.

    Raises:
        NoSuchBlock: a block that does not exist (an IndexError).
        ValueError: a vector of another shape, a factor that is not finite, a scaled vector with
            non-finite entries or entries beyond the square root of the dtype's largest value, a
            norm beyond the square root of float32's, or negative or stepped positions.
        TypeError: a vector that is not a real tensor (`steering_vector`), a factor that is not a number, blocks
            that are not ints.
    """
    vector = steering_vector(vector, hidden_size, "Steering.vector")
    if not isinstance(factor, numbers.Real) or isinstance(factor, bool):
        raise TypeError(f"Steering.factor: expected a finite number, got {factor!r}")
    if not math.isfinite(factor):
        raise ValueError(f"Steering.factor: expected a finite number, got {factor!r}")
    listed = [layers] if isinstance(layers, int) else layers
    if not isinstance(listed, (list, tuple, range)) or not listed or not all(
        isinstance(layer, int) and not isinstance(layer, bool) for layer in listed
    ):
        raise TypeError(f"Steering.layers: expected a block index or a list of them, got {layers!r}")
    blocks = tuple(sorted({block_index(layer, num_layers) for layer in listed}))
    # Scaled where a trace scales it: in the model's dtype (``factor * vector.to(dtype)``).
    scaled = float(factor) * vector.detach().to(device="cpu", dtype=dtype)
    if not torch.isfinite(scaled).all():
        raise ValueError(
            f"Steering: factor * vector has non-finite (NaN or infinite) entries in {dtype} (factor {factor})"
        )
    # The next norm squares the stream: entries past sqrt(max) would overflow it, and the
    # non-finite keys and values computed from it would reach the engine's cache.
    limit = torch.finfo(dtype).max ** 0.5
    if scaled.abs().max().item() > limit:
        raise ValueError(
            f"Steering: factor * vector has entries beyond {limit:.3g} (the square root of {dtype}'s largest "
            f"value; factor {factor}): the next norm would overflow"
        )
    # The next norm sums the squares in float32: entries each under the bound can still overflow that sum (1.5e19
    # in each of 128 entries of a bfloat16 stream gave a uniform distribution, neither refused nor left unsteered).
    bound = torch.finfo(torch.float32).max ** 0.5
    if scaled.double().norm().item() > bound:
        raise ValueError(
            f"Steering: factor * vector has a norm beyond {bound:.3g} (the square root of float32's largest "
            f"value, where the next norm sums its squares; factor {factor}): the next norm would overflow"
        )
    return Entry(blocks, scaled.float().numpy().tobytes(), _positions(positions))


def _positions(positions: Any) -> Any:
    if positions is None or (isinstance(positions, str) and positions in NAMED_POSITIONS):
        return positions
    if isinstance(positions, slice):
        start, stop = positions.start or 0, positions.stop
        if positions.step not in (None, 1) or start < 0 or (stop is not None and stop < 0):
            raise ValueError(f"Steering.positions: a slice needs non-negative bounds and no step, got {positions}")
        return {"start": int(start), "stop": None if stop is None else int(stop)}
    listed = [positions] if isinstance(positions, int) else list(positions)
    if len(listed) > MAX_POSITIONS:
        raise ValueError(f"Steering.positions: {len(listed)} positions, at most {MAX_POSITIONS} are served "
                         "(a slice steers a range of any length)")
    if not all(isinstance(each, int) and not isinstance(each, bool) and each >= 0 for each in listed):
        raise ValueError(
            f"Steering.positions: expected non-negative token positions (a generation's length is not known "
            f"in advance, so none count from the end), got {positions!r}"
        )
    return sorted(set(listed))


class Overlap(ValueError):
    """Two entries of a request steer one block (entry ``number`` the second); the worker takes disjoint ones."""

    def __init__(self, number: int, block: int) -> None:
        super().__init__(f"block {block} is steered by two entries")
        self.number, self.block = number, block


def text(entries: Sequence[Entry]) -> str:
    """A request's entries as they travel: JSON of one spec, or a list of them (entries alike in scaled vector and
    positions share one spec, and one slot on the engine).

    Raises:
        Overlap: two entries steer one block.
    """
    groups: dict[tuple, list[int]] = {}
    steered: set[int] = set()
    for number, each in enumerate(entries):
        twice = sorted(steered & set(each.layers))
        if twice:
            raise Overlap(number, twice[0])
        steered.update(each.layers)
        groups.setdefault((each.vector, json.dumps(each.positions)), []).extend(each.layers)
    made = [
        {"layers": sorted(layers), "vector": base64.b64encode(vector).decode("ascii"), "positions": json.loads(where)}
        for (vector, where), layers in groups.items()
    ]
    return json.dumps(made[0] if len(made) == 1 else made, separators=(",", ":"))


def salt_of(spec: str) -> str:
    """The cache salt of a request whose steering is ``spec`` (`text`): its prefix cache is shared only with
    requests steered alike, never with unsteered ones."""
    return "vlenvoys-steer-" + hashlib.sha256(spec.encode()).hexdigest()


def read(spec: Any, hidden_size: int, num_layers: int) -> list[tuple[list[int], torch.Tensor, Any]]:
    """The worker's reading of `text`: each entry's blocks, vector (float32) and positions (as written).

    A spec comes from the client, or is set by hand in a request's ``extra_args``; what no `text` makes is
    refused here, and the engine goes on serving the request unsteered.

    Raises:
        ValueError: a block the model lacks, a vector of another width or not finite, entries that overlap.
        KeyError, TypeError: not the format at all.
    """
    parsed = json.loads(spec) if isinstance(spec, str) else spec
    read_entries = []
    for each in parsed if isinstance(parsed, list) else [parsed]:
        layers = [int(layer) for layer in each["layers"]]
        if not layers or any(layer < 0 or layer >= num_layers for layer in layers):
            raise ValueError(f"blocks {layers}: the model has blocks 0 to {num_layers - 1}")
        data = base64.b64decode(each["vector"], validate=True)
        if len(data) % 4:
            raise ValueError(f"a vector of {len(data)} bytes is not float32 values")
        vector = torch.frombuffer(bytearray(data), dtype=torch.float32)
        if tuple(vector.shape) != (hidden_size,):
            raise ValueError(f"a vector of shape {list(vector.shape)} for a stream of {hidden_size}")
        if not torch.isfinite(vector).all():
            raise ValueError("the vector is not finite")
        read_entries.append((layers, vector, each["positions"]))
    blocks = [layer for layers, _, _ in read_entries for layer in layers]
    if not read_entries or len(set(blocks)) != len(blocks):
        raise ValueError(f"entries must steer disjoint blocks, got {blocks}")
    return read_entries
