"""What the server's own request fields share: the paths they are served on, and how a field's entries are read."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["CAPTURES_PATH", "FETCH_TOGETHER", "GENERATING", "OWN_FIELDS", "VECTORS_PATH", "SteeringError", "field_entries"]

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
