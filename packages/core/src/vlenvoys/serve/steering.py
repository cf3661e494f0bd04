"""The ``steering`` field of a served completion: checked against the model, handed to the engine.

A request steers its generation with a top-level ``steering`` field::

    "steering": [{"value": "layer_output", "layer": 1, "vector": [0.1, ...] or "name",
                  "factor": 4.0, "positions": "all"}]

Each entry adds ``factor * vector`` to the residual stream leaving block
``layer`` (``layer_output``, ``[tokens, hidden_size]`` per request), exactly
as `vlenvoys.generate` with the same `vlenvoys.Steering` does (the same bytes
reach the same hooks on the engine). ``vector`` is ``hidden_size`` numbers or
the name of a vector registered at start (``--vectors FILE.safetensors``) or
through ``POST /v1/steering/vectors``. ``positions``: ``"all"`` (default; every
prompt position and every generated token's), ``"prompt"`` (positions below the
prompt's length), ``"generated"`` (from the prompt's length on: generated token
``k``, counted from 0, sits at ``len(prompt) + k`` and is steered at the step
that feeds it, so the first token sampled is the unsteered one), or a list of
non-negative positions (0 is the prompt's first token). ``factor`` defaults
to 1. ``layer`` may be negative (counted from the end). Entries may steer
several blocks, each with its own vector, factor and positions (at most
`MAX_ENTRIES`, no block twice); entries alike in scaled vector and positions
share one slot of the engine's table.

The middleware checks the field against the model, takes it out of the body
and hands the request's spec to the engine in ``vllm_xargs`` (vLLM's
``SamplingParams.extra_args``) in the one format `vlenvoys.generate`'s requests
carry too (`vlenvoys.wire.steering`: JSON text, the vector as base64 of its
float32 bytes), and salts the request's prefix cache by its steering
(``cache_salt``) so steered and plain requests never share a cached prefix;
`vlenvoys.serve.server.guard` refuses a spec set by hand on any path without
that salt. A field the model cannot take is a 400 naming the reason
(OpenAI's error shape, ``param`` ``"steering"``), before the request reaches
the engine; the server goes on serving.

A steered row the engine
still finds non-finite (the scaled vector is bounded as for
`vlenvoys.generate`, by `vlenvoys.wire.steering.entry`, so only a stream
already near the dtype's range gets there) is left unsteered from then on, as under
`vlenvoys.generate`, but the response does not say so.
"""

from __future__ import annotations

import numbers
from pathlib import Path
from typing import Any

import torch

from ..values.names import OWNERS
from ..wire.requests import STEER_KEY
from ..wire.steering import Overlap, entry, salt_of, text
from .fields import OWN_FIELDS, SteeringError, field_entries

__all__ = ["ENTRY_KEYS", "MAX_ENTRIES", "STEERABLE", "VECTORS", "Vectors", "rewritten", "steering_spec"]

#: Values a request may steer (others are standard names served later).
STEERABLE = ("layer_output",)
#: The most named vectors the server keeps (each ``hidden_size`` float32 numbers).
MAX_VECTORS = 4096
#: An entry's keys.
ENTRY_KEYS = frozenset({"value", "layer", "vector", "factor", "positions"})
#: The most entries a request's steering may have (each distinct vector takes a slot on the engine).
MAX_ENTRIES = 16


class Vectors:
    """Named steering vectors, each ``[hidden_size]`` float32, registered once and referenced by name."""

    def __init__(self) -> None:
        self.named: dict[str, torch.Tensor] = {}

    def add(self, name: Any, vector: Any, hidden_size: int) -> torch.Tensor:
        """Register ``vector`` (numbers or a tensor) as ``name`` (a later one replaces it).

        Raises:
            SteeringError: a name that is not a non-empty string, a vector of
                another width, non-finite or non-numeric entries, or more than
                `MAX_VECTORS` names.
        """
        if not isinstance(name, str) or not name or len(name) > 200:
            raise SteeringError(f"a vector's name must be a non-empty string of at most 200 characters, got {name!r}", "name")
        tensor = _numbers(vector, hidden_size, f"vector {name!r}", "vector")
        if name not in self.named and len(self.named) >= MAX_VECTORS:
            raise SteeringError(f"{MAX_VECTORS} vectors are registered already, the most this server keeps", "name")
        self.named[name] = tensor
        return tensor

    def load(self, path: str | Path, hidden_size: int) -> list[str]:
        """Register every tensor of a safetensors file under its name; each must be ``[hidden_size]``.

        Raises:
            FileNotFoundError: no such file.
            SteeringError: a tensor of another shape or with non-finite entries.
        """
        from safetensors.torch import load_file

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"--vectors {path}: no such file")
        names = []
        for name, tensor in load_file(str(path)).items():
            if tensor.dim() != 1 or not tensor.is_floating_point():
                raise SteeringError(
                    f"--vectors {path}: {name!r} is a {tensor.dtype} tensor of shape {list(tensor.shape)}, "
                    f"expected float [{hidden_size}]", "vector"
                )
            try:
                self.add(name, tensor, hidden_size)
            except SteeringError as error:
                raise SteeringError(f"--vectors {path}: {error}", error.param) from None
            names.append(name)
        return names

    def get(self, name: str) -> torch.Tensor:
        try:
            return self.named[name]
        except KeyError:
            known = ", ".join(repr(each) for each in sorted(self.named)[:20]) or "none"
            raise SteeringError(f"no vector is registered as {name!r} (registered: {known})", "steering") from None


def _numbers(vector: Any, hidden_size: int, what: str, param: str = "steering") -> torch.Tensor:
    """``vector`` as a float32 ``[hidden_size]`` tensor, refused unless its entries are finite numbers."""
    if isinstance(vector, torch.Tensor):
        tensor = vector.detach().to("cpu", torch.float32).clone()
    else:
        if not isinstance(vector, list) or not all(
            isinstance(each, numbers.Real) and not isinstance(each, bool) for each in vector
        ):
            raise SteeringError(f"{what}: expected a list of {hidden_size} numbers or a registered name", param)
        tensor = torch.tensor(vector, dtype=torch.float32)
    if tuple(tensor.shape) != (hidden_size,):
        raise SteeringError(f"{what}: expected {hidden_size} numbers (the model's hidden_size), got {list(tensor.shape)}", param)
    if not torch.isfinite(tensor).all():
        raise SteeringError(f"{what}: has NaN or infinite entries (or entries too large for float32)", param)
    if not torch.isfinite(tensor.norm()):  # its listing reports the norm; a request would be refused anyway
        raise SteeringError(f"{what}: its norm is beyond float32's range (entries too large to steer with)", param)
    return tensor


def steering_spec(field: Any, hidden_size: int, num_layers: int, dtype: torch.dtype, vectors: Vectors) -> str:
    """A request's ``steering`` field as it travels to the engine's `vlenvoys.worker.steerer.Steerer`
    (`vlenvoys.wire.steering.text`: JSON text, each entry's scaled vector as base64 of its float32 bytes).

    Each entry is checked as `vlenvoys.generate` checks a `vlenvoys.Steering` (`vlenvoys.wire.steering.entry`),
    so the same steering travels as the same text either way; entries alike in scaled vector and positions
    share one slot on the engine.

    Args:
        field: One entry or a list of them (see the module's docstring).
        hidden_size: The served model's stream width.
        num_layers: The served model's block count.
        dtype: The served model's dtype (the vector is scaled in it).
        vectors: The named vectors.

    Raises:
        SteeringError: an unknown value or key, a layer that does not exist,
            a vector of another width, non-finite, or not registered, a bad
            factor or positions, a block two entries steer, more than
            `MAX_ENTRIES` entries.
    """
    entries = []
    for where, given in field_entries(field, "steering", ENTRY_KEYS, MAX_ENTRIES, SteeringError):
        value = given.get("value", "layer_output")
        if value not in STEERABLE:
            if isinstance(value, str) and value in OWNERS:  # JSON may give a list or an object: no dict key
                raise SteeringError(f"{where}: steering {value!r} is not served yet; served: {', '.join(STEERABLE)}")
            raise SteeringError(f"{where}: unknown value {value!r}; served: {', '.join(STEERABLE)}")
        if "layer" not in given:
            raise SteeringError(f"{where}: no layer; an entry steers one block, e.g. \"layer\": 0")
        vector = given.get("vector")
        if vector is None:
            raise SteeringError(f"{where}: no vector; give a list of {hidden_size} numbers or a registered vector's name")
        if isinstance(vector, str):
            try:
                vector = vectors.get(vector)
            except SteeringError as error:
                raise SteeringError(f"{where}.vector: {error}") from None
        elif isinstance(vector, list) and all(
            isinstance(each, numbers.Real) and not isinstance(each, bool) for each in vector
        ):
            vector = torch.tensor(vector, dtype=torch.float32)
        else:
            raise SteeringError(f"{where}.vector: expected a list of {hidden_size} numbers or a registered name")
        positions = given.get("positions", "all")
        try:
            entries.append(entry(
                given["layer"], vector, given.get("factor", 1.0), None if positions == "all" else positions,
                hidden_size=hidden_size, num_layers=num_layers, dtype=dtype,
            ))
        except (ValueError, TypeError, IndexError) as error:
            raise SteeringError(f"{where}: {error}") from None
    try:
        return text(entries)
    except Overlap as error:
        raise SteeringError(f"steering[{error.number}]: {error}") from None


def rewritten(body: dict, hidden_size: int, num_layers: int, dtype: torch.dtype, vectors: Vectors) -> dict | None:
    """The request body with its ``steering`` turned into ``vllm_xargs`` and a cache salt; None if it has none.

    Raises:
        SteeringError: see `steering_spec`; also ``vllm_xargs`` naming vlenvoys' own key,
            or a field named almost as ``steering`` or ``capture``.
    """
    for field in body:
        # vLLM ignores fields it does not know: a misspelt steering would generate unsteered without a word.
        for known, verb in (("steering", "steers"), ("capture", "captures")):
            if field not in OWN_FIELDS and isinstance(field, str) and field.lower().startswith(known[:5]):
                raise SteeringError(
                    f"unknown field {field!r}; a request {verb} with the field {known!r}"
                    + (" (and chooses how its values come with 'capture_transport')" if known == "capture" else ""),
                    field,
                )
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and STEER_KEY in xargs:
        raise SteeringError(f"vllm_xargs[{STEER_KEY!r}] is set by the server; steer with the request's 'steering' field", "vllm_xargs")
    if isinstance(xargs, dict) and any(isinstance(key, str) and key.startswith("vlenvoys_collect") for key in xargs):
        # Refused here, not only by `guard` on the way to the engine: there a streamed request had its 200 already,
        # and got the refusal as an error event inside the stream (found by fuzzing, #46).
        raise SteeringError("vllm_xargs' vlenvoys_collect keys are set by the server; capture with the 'capture' field",
                            "vllm_xargs")
    if "steering" not in body:
        return None
    body = dict(body)
    field = body.pop("steering")
    if field is None or field == []:
        return body
    if body.get("use_beam_search"):
        # vLLM's beam search runs requests of its own, which would go unsteered.
        raise SteeringError("beam search is not steered (use_beam_search); steer sampled or greedy requests", "use_beam_search")
    if xargs is not None and not isinstance(xargs, dict):
        raise SteeringError("vllm_xargs: expected an object", "vllm_xargs")
    spec = steering_spec(field, hidden_size, num_layers, dtype, vectors)
    body["vllm_xargs"] = {**(xargs or {}), STEER_KEY: spec}
    # Salted by its steering, as vlenvoys.generate salts it: a prefix cache shared only with requests steered alike.
    salt = salt_of(spec)
    own = body.get("cache_salt")
    body["cache_salt"] = f"{own}-{salt}" if isinstance(own, str) and own else salt
    return body


#: The server's named vectors (this process's: `prepare` loads ``--vectors`` files into it).
VECTORS = Vectors()
