"""Which standard values a model serves, and why not where it cannot."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from .. import errors
from .envoys import StandardEnvoy
from .family import Architecture, resolve_checkpoint
from .layouts import Derived, Located, unavailable_reason

__all__ = ["Row", "Support", "envoy_rows", "support", "values_of"]


#: Layout names (a value's annotation) as shapes: T tokens, H hidden, I intermediate,
#: n query heads, k key/value heads, d head width, E experts, K experts per token.
SHAPES = {
    "Residual": "[1, T, H]", "Heads": "[1, T, n, d]", "KeyValueHeads": "[1, T, k, d]", "Neurons": "[1, T, I]",
    "Pattern": "[1, n, T, T]", "Experts": "[1, T, E]", "Routes": "[1, T, K]",
}
#: Named reasons by their text, for the `code` column.
CODES = {getattr(errors, name): name for name in ("DECODE_STEP", "GATED", "ROUTED", "NOT_ROUTED", "FUSED_ROUTING", "PARALLEL")}


@dataclass(frozen=True)
class Row:
    """One value of one kind of envoy."""

    envoy: str  #: "model", "layer", "attention" or "mlp"
    value: str
    layout: str  #: the layout's name (Residual, Heads, KeyValueHeads, Neurons, Pattern, Experts, Routes)
    available: bool
    note: str  #: the reason it is unavailable, or a restriction ("prefill only")

    @property
    def shape(self) -> str:
        return SHAPES.get(self.layout, self.layout)

    @property
    def code(self) -> str:
        """The reason's name (GATED, ROUTED, ...) where it is one of vlenvoys' named reasons."""
        return CODES.get(self.note, "DECODE_STEP" if "prefill only" in self.note else "")


@dataclass(frozen=True)
class Support:
    """Every standard value of a model's envoys with its availability; iterate it for the rows."""

    architecture: str
    family: str
    rows: tuple[Row, ...]

    def __iter__(self):
        return iter(self.rows)

    def __getitem__(self, key: tuple[str, str]) -> Row:
        """The row of ``(envoy, value)``, e.g. ``support["mlp", "mlp_activation"]``."""
        for row in self.rows:
            if (row.envoy, row.value) == key:
                return row
        raise KeyError(key)

    def table(self):
        """A rich Table of the rows."""
        from rich.table import Table

        table = Table(title=f"{self.architecture} ({self.family}): standard values")
        for column in ("envoy", "value", "layout", "available", "reason", "note"):
            table.add_column(column, no_wrap=column in ("value", "layout"))
        for row in self.rows:
            table.add_row(row.envoy, row.value, row.shape, "yes" if row.available else "no", row.code, row.note)
        return table

    def __str__(self) -> str:
        from rich.console import Console

        console = Console(width=160, record=True)
        with console.capture() as capture:
            console.print(self.table())
        return capture.get()


def values_of(cls: type) -> list[tuple[str, Located]]:
    """The standard values declared on an envoy class, in declaration order (bases first)."""
    seen: dict[str, Located] = {}
    for klass in reversed(cls.__mro__):
        for name, attribute in vars(klass).items():
            if isinstance(attribute, Located):
                seen.pop(name, None)
                seen[name] = attribute
    return list(seen.items())


def envoy_rows(kind: str, cls: type[StandardEnvoy], envoy: Any = None) -> list[Row]:
    """``cls``'s rows; with ``envoy`` (a loaded model's), its loaded modules' reasons too (`StandardEnvoy.unavailable_here`)."""
    rows = []
    for name, value in values_of(cls):
        reason = unavailable_reason(envoy, name) if isinstance(envoy, StandardEnvoy) else cls.unavailable(name)
        note = reason or ("prefill only; read-only" if isinstance(value, Derived) else "")
        rows.append(Row(kind, name, value.layout, reason is None, note))
    return rows


def support(model: Any) -> Support:
    """The availability of every standard value for ``model``.

    ``model`` is a model from `vlenvoys.load`, or a local checkpoint folder
    (no engine is started: availability follows from the family's
    declarations; a loaded model's own modules are asked too, so a mixture of
    experts whose kernel routes inside itself lists its routing as refused,
    ``FUSED_ROUTING``). Outside a trace, a value that only a decode step cannot
    serve is listed as available, on the prefill.

    Raises:
        UnknownArchitecture: no installed family declares the checkpoint's architecture.
    """
    if isinstance(model, (str, os.PathLike)):
        installed, name, architecture = resolve_checkpoint(model, {})
    else:
        architecture: Architecture = model.architecture
        installed = model.family
        declared = {**installed.family.architectures, **installed.family.transformers_backend}
        declared = {a: getattr(each, "choices", {None: each}) for a, each in declared.items()}  # ByConfig's choices
        # Several architectures can share one declaration (Llama, Mistral): the checkpoint's own name first.
        name = getattr(model, "architecture_name", None) or next(
            a for a, choices in declared.items() if any(each is architecture for each in choices.values())
        )
    rows = [Row("model", "token_embeddings", "Residual", True, "block 0's stream input")]
    block = attention = mlp = None
    if not isinstance(model, (str, os.PathLike)):
        # A loaded model's own modules can refuse more than its declarations (a mixture of experts'
        # monolithic kernel: no routing to read); block 0's stand for every block.
        block = model.layers[0]
        attention, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
    rows += envoy_rows("layer", architecture.layer, block)
    rows += envoy_rows("attention", architecture.attention, attention)
    rows += envoy_rows("mlp", architecture.mlp, mlp)
    return Support(name, installed.name, tuple(rows))
