"""What the server's own request fields share: the paths they are served on, and how a field's entries are read."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..values.names import OWNERS
from ..wire.steering import MAX_POSITIONS, NAMED_POSITIONS

__all__ = [
    "CAPTURES_PATH", "CAPTURE_POSITIONS", "FETCH_TOGETHER", "GENERATING", "OWN_FIELDS", "TRANSPORTS", "VECTORS_PATH",
    "CaptureEntry", "SteeringEntry", "SteeringError", "document", "field_entries",
]

#: Where named vectors are listed (GET) and registered (POST).
VECTORS_PATH = "/v1/steering/vectors"
#: Held captures are fetched at ``GET CAPTURES_PATH/{id}``, or several at ``GET CAPTURES_PATH?ids=a,b`` (`vlenvoys.capturing`).
CAPTURES_PATH = "/v1/captures"
#: The most captures one fetch asks for (``GET CAPTURES_PATH?ids=...``: its URL stays under 5 KB).
FETCH_TOGETHER = 128
#: Request paths whose ``steering`` field is served.
GENERATING = ("/v1/completions", "/v1/chat/completions")


#: The request fields the middleware serves (and takes out of the body before vLLM sees it).
OWN_FIELDS = frozenset({"steering", "capture", "capture_transport"})
#: How a response hands its captured values over (``capture_transport``): in its JSON, or held for one fetch.
TRANSPORTS = ("inline", "fetch")
#: The named choices of a capture entry's positions.
CAPTURE_POSITIONS = ("prompt", "generated", "all", "last")


class SteeringError(ValueError):
    """A request's ``steering`` (or named vector, or ``capture``) the model cannot take: an HTTP 400 with this message."""

    def __init__(self, message: str, param: str = "steering") -> None:
        super().__init__(message)
        self.param = param


def field_entries(
    field: Any, name: str, keys: frozenset[str], most: int, error: type[Exception]
) -> Iterator[tuple[str, dict]]:
    """A request field of one entry or a list of them: each entry, named for errors (``name[i]``).

    Raises:
        error: the field is neither an object nor a non-empty list, it has more than ``most``
            entries, an entry is not an object, or an entry has a key outside ``keys``.
    """
    shape = "{" + ", ".join(sorted(keys)) + "}"
    entries = [field] if isinstance(field, dict) else field
    if not isinstance(entries, list) or not entries:
        raise error(f"{name}: expected an entry {shape} or a non-empty list of them")
    if len(entries) > most:
        raise error(f"{name}: {len(entries)} entries, at most {most} are served")
    for number, entry in enumerate(entries):
        where = f"{name}[{number}]"
        if not isinstance(entry, dict):
            raise error(f"{where}: expected an object {shape}")
        unknown = sorted(set(entry) - keys)
        if unknown:
            raise error(f"{where}: unknown keys {unknown}; an entry has {sorted(keys)}")
        yield where, entry


# -- the fields in the server's OpenAPI document (/openapi.json, /docs) -------------------------------------------
# The middleware reads the fields from the raw body (vLLM's request models never see them); these models only
# describe them. The checks, and their messages, are `vlenvoys.serve.steering.steering_spec` and
# `vlenvoys.serve.capture.capture_spec`; test_llama_serve.py holds both to the same keys.


class SteeringEntry(BaseModel):
    """One entry of a request's ``steering``: ``factor * vector`` added to the residual stream leaving block ``layer``."""

    model_config = ConfigDict(extra="forbid", title="SteeringEntry")
    value: Literal["layer_output"] = Field("layer_output", description="The value steered: the block's output stream.")
    layer: int = Field(description="The block, 0-based; negative counts from the end.")
    vector: list[float] | str = Field(
        description="hidden_size numbers, or the name of a vector registered with --vectors or POST /v1/steering/vectors."
    )
    factor: float = Field(1.0, description="The vector's scale.")
    positions: Literal[("all", *NAMED_POSITIONS)] | list[int] = Field(  # type: ignore[valid-type]
        "all", description="Which positions are steered: all, the prompt's, the generated tokens', or a list (0: the "
        f"prompt's first token), at most {MAX_POSITIONS:,}.",
    )


class CaptureEntry(BaseModel):
    """One entry of a request's ``capture``: a standard value at some blocks, returned with the response."""

    model_config = ConfigDict(extra="forbid", title="CaptureEntry")
    value: Literal[tuple(OWNERS)] = Field(description="A standard block value (nnterp's names).")  # type: ignore[valid-type]
    layers: int | list[int] | Literal["all"] = Field(description="A block, a list of blocks (negative count from the end), or all.")
    positions: Literal[CAPTURE_POSITIONS] | list[int] = Field(  # type: ignore[valid-type]
        "prompt", description="Which rows: the prompt's, the decode steps', both, the prompt's last, or a list (negative "
        f"count from the end of the rows), at most {MAX_POSITIONS:,}.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="The dtype the values are returned in.")


def _one_or_list(model: type[BaseModel], description: str) -> dict:
    reference = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"anyOf": [reference, {"type": "array", "items": reference}, {"type": "null"}], "description": description}


#: The fields each generating request's schema gains (`document`).
_FIELDS = {
    "steering": _one_or_list(SteeringEntry, "vlenvoys: steer this request's generation (vlenvoys.serve.steering)."),
    "capture": _one_or_list(CaptureEntry, "vlenvoys: return standard values of this request's run with its response "
                            "(non-streamed, one prompt, one choice; vlenvoys.serve.capture)."),
    "capture_transport": {
        "anyOf": [{"type": "string", "enum": list(TRANSPORTS)}, {"type": "null"}],
        "description": "vlenvoys: the captured values as base64 in the response (inline, default) or held for one "
        "GET /v1/captures/{id} as safetensors (fetch).",
    },
}


def document(schema: dict) -> dict:
    """vLLM's OpenAPI ``schema`` with the request fields the middleware serves added to its completion and chat
    completion requests (in place; also returned). A schema without those requests is left as it is."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in (SteeringEntry, CaptureEntry):
        components[model.__name__] = model.model_json_schema(ref_template="#/components/schemas/{model}")
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        if request in components:
            components[request].setdefault("properties", {}).update(_FIELDS)
    return schema
