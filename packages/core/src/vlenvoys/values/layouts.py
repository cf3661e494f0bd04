"""Values served in nnterp's layouts over vLLM's flat ``[tokens, ...]`` tensors.

vLLM keeps one request's activations as ``[tokens, ...]`` rows of a step that
holds every request in flight, rewrites its buffers in place with the next
fused kernel, and hands most blocks their residual stream in two halves. A
value declared here absorbs all three: it is read at one location of one
module (its input or output), served as a private ``[1, tokens, ...]`` copy,
and an edit of the copy, or an assignment, is handed back to the model in the
model's own form when the block moves on.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any, NewType

import torch
from nnsight.intervention.eproperty import eproperty
from nnsight.intervention.interleaver import Mediator

from ..errors import InvalidWrite, ReadOnly, Unavailable

__all__ = [
    "Checked",
    "Derived",
    "Experts",
    "Flat",
    "Heads",
    "KeyValueHeads",
    "Located",
    "Neurons",
    "Pattern",
    "Residual",
    "Routes",
    "argument",
    "batched",
    "check_masked",
    "edited",
    "unavailable_reason",
    "unmark",
    "served_shape",
    "summed",
    "summed_output",
    "unbatched",
    "with_argument",
]

#: ``[1, tokens, hidden_size]``: the residual stream, or what a sublayer adds to it.
Residual = NewType("Residual", torch.Tensor)
#: ``[1, tokens, heads, head_dim]``: one row per query head.
Heads = NewType("Heads", torch.Tensor)
#: ``[1, tokens, key_value_heads, head_dim]``: one row per key/value head (fewer than the query heads under
#: grouped-query attention: each serves a group of them).
KeyValueHeads = NewType("KeyValueHeads", torch.Tensor)
#: ``[1, tokens, intermediate_size]``: the MLP's hidden units.
Neurons = NewType("Neurons", torch.Tensor)
#: ``[1, heads, query, key]``: one score or weight per head, query token and key token.
Pattern = NewType("Pattern", torch.Tensor)
#: ``[1, tokens, num_experts]``: one entry per expert of a mixture of experts (the router's logits).
Experts = NewType("Experts", torch.Tensor)
#: ``[1, tokens, experts_per_token]``: a token's chosen experts, or their weights.
Routes = NewType("Routes", torch.Tensor)

#: Where an argument sits in a call: ``(position, keyword)``.
Slot = tuple[int, str]


def argument(inputs: tuple[tuple, dict], slot: Slot) -> Any:
    """One argument of a call served as ``(args, kwargs)``, however the caller passed it.

    Returns None when the call did not pass it.
    """
    args, kwargs = inputs
    index, name = slot
    if name in kwargs:
        return kwargs[name]
    return args[index] if index < len(args) else None


def with_argument(inputs: tuple[tuple, dict], slot: Slot, value: Any) -> tuple[tuple, dict]:
    """``inputs`` with the argument at ``slot`` replaced, where the caller passed it.

    Raises:
        KeyError: the call did not pass that argument.
    """
    args, kwargs = inputs
    index, name = slot
    if name in kwargs:
        return args, {**kwargs, name: value}
    if index < len(args):
        return (*args[:index], value, *args[index + 1 :]), kwargs
    raise KeyError(f"the call passed no argument {name!r} (position {index})")


def batched(value: torch.Tensor, head_dim: int | None = None, batch: bool = False, *, fresh: bool = False) -> torch.Tensor:
    """``[tokens, ...]`` as a private ``[1, tokens, ...]`` copy.

    With ``head_dim``, the last axis (``heads * head_dim`` wide) is split into
    ``[heads, head_dim]``. With ``batch`` the tensor already carries the batch
    axis (``[1, tokens, ...]``, vLLM's transformers backend) and keeps it. The
    copy is the caller's: the model's buffer can be rewritten by the next
    kernel without touching it. ``fresh`` says ``value`` is already a tensor
    of its own (a sum computed for the read), which is then not copied again.

    The copy is made outside inference mode, where vLLM runs: unlike the
    model's tensors it keeps a version counter, which `edited` reads.
    """
    copy = value if fresh and not value.is_inference() else _copy(value)
    if head_dim is not None:
        copy = copy.reshape(*copy.shape[:-1], -1, head_dim)
    copy = copy if batch else copy.unsqueeze(0)
    return _versioned(copy)


def _copy(value: torch.Tensor) -> torch.Tensor:
    with _outside_inference():
        return value.clone()


def _outside_inference() -> Any:
    # inference_mode(False) also turns gradients back on; nothing served needs them.
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(False))
    stack.enter_context(torch.no_grad())
    return stack


def _versioned(value: torch.Tensor) -> torch.Tensor:
    """``value`` with its version counter noted, for `edited`."""
    value._vlenvoys_version = value._version
    return value


def edited(value: torch.Tensor) -> bool:
    """Whether ``value`` (served by `batched`, or a `Derived` read) was edited in place since it was served.

    Reads the version counter every in-place operation bumps (a tensor
    without one, made in inference mode, counts as edited); the mark is
    removed, so a saved value carries nothing of it back to the user.
    """
    version = unmark(value)
    return version is None or value.is_inference() or value._version != version


def unmark(value: torch.Tensor) -> int | None:
    """Removes `batched`'s version mark from ``value`` (when nothing will ask `edited`); returns it."""
    return value.__dict__.pop("_vlenvoys_version", None)


def unbatched(
    value: Any,
    rows: torch.Tensor,
    name: str,
    head_dim: int | None = None,
    batch: bool = False,
    *,
    top_k: int | None = None,
) -> torch.Tensor:
    """What `batched` served, back as the ``[tokens, ...]`` the model holds.

    ``rows`` is the tensor the model holds at that place now; the written
    value must have exactly the layout it was served in (``[1, *rows.shape]``,
    heads split out where ``head_dim`` is given) and its dtype. A value on
    another device (a CPU tensor written into a GPU engine's value) is moved
    to the engine's: which device the engine's worker uses is the engine's
    business, while the dtype is the caller's precision, so it is never changed
    behind the caller's back.

    A written value is spliced into the step the engine is running, among
    other requests' rows, and one of another height would reach the next
    kernel as it is, where the mismatch can end the engine and every request
    in it. So it is refused here, in the block that wrote it. So is a NaN or
    an infinity: carried into the keys and values the engine caches, it
    stays in cache blocks vLLM reuses for later requests, and their attention
    picks it up (measured on the CPU engine: a NaN written at block 3 of one
    request made every later request NaN from block 4's attention on).

    With ``top_k`` the value holds scores a softmax and a top-k of ``top_k``
    entries pick from along the last axis (a router's logits), where ``-inf``
    has a meaning: that entry gets weight 0 and is never picked. Such entries
    are accepted as long as every row keeps ``top_k`` finite ones (see
    `check_masked`).

    Raises:
        InvalidWrite: ``value`` is not a tensor, its shape or dtype differs
            from what was served, or it has NaN or infinite entries (with
            ``top_k``: NaN, ``+inf``, or a row with fewer than ``top_k``
            finite entries), or entries beyond `WRITE_LIMIT`.
    """
    expected = served_shape(rows, head_dim, batch)
    if not isinstance(value, torch.Tensor):
        raise InvalidWrite(f"{name}: expected a tensor of shape {list(expected)}, got {type(value).__name__}")
    if tuple(value.shape) != expected:
        raise InvalidWrite(
            f"{name}: expected shape {list(expected)} ([1, tokens, ...] for this request's "
            f"{expected[1]} tokens), got {list(value.shape)}"
        )
    if value.dtype != rows.dtype:
        raise InvalidWrite(f"{name}: expected dtype {rows.dtype}, got {value.dtype}; convert it with .to({rows.dtype})")
    if value.is_meta:
        raise InvalidWrite(f"{name}: expected a tensor on {rows.device}, got one on meta, which holds no data")
    if value.device != rows.device:
        value = value.to(rows.device)
    if value.is_floating_point() and value.numel():
        # One reduction and one wait for the device for both checks below (NaN propagates through the max).
        largest = float(value.abs().amax())
        if not math.isfinite(largest):
            if top_k is None:
                raise InvalidWrite(
                    f"{name}: the written value has NaN or infinite entries; they would reach the engine's "
                    "key/value cache and spoil the logits of later requests"
                )
            check_masked(value, name, top_k)
            largest = float(value.abs().nan_to_num(posinf=0.0).amax())  # past the -inf that mask (top_k)
        # Finite but huge entries overflow the next product (a query-key dot, a norm's sum of squares, a residual
        # add) to inf, and the NaN after it reached the cached keys and values as a written NaN does: keys of 3e38
        # made every later plain request draw token 0 (found by fuzzing, #46). The bound `Steering` refuses past.
        if largest > WRITE_LIMIT:
            raise InvalidWrite(
                f"{name}: the written value has entries up to {largest:.3g}, beyond {WRITE_LIMIT:.3g} (the "
                "square root of float32's largest value): the next product or norm would overflow to inf, and the "
                "NaN it makes would reach the engine's key/value cache and spoil the logits of later requests"
            )
    return value.reshape(rows.shape)


#: The largest magnitude a written entry may have: the square root of float32's largest value, past which the next
#: norm's sum of squares (in float32) or a query-key product overflows (as `vlenvoys.Steering` bounds a vector).
WRITE_LIMIT = torch.finfo(torch.float32).max ** 0.5


def check_masked(value: torch.Tensor, name: str, top_k: int) -> None:
    """Refuse scores a top-k of ``top_k`` picks from (``[..., entries]``) unless their only non-finite entries mask.

    ``-inf`` masks an entry: its softmax weight is 0, on vLLM and transformers
    alike, so a row keeping ``top_k`` finite entries has its top-k among them.

    Raises:
        InvalidWrite: a NaN or a ``+inf`` entry (the softmax would be NaN), or a
            row with fewer than ``top_k`` finite entries: its top-k would pick
            among tied ``-inf`` entries, an arbitrary choice (and with no
            finite entry at all the softmax is NaN).
    """
    masks = "-inf is the one non-finite entry taken: it masks the entry (weight 0, never in the top-k)"
    if bool(torch.isnan(value).any()):
        raise InvalidWrite(f"{name}: the written value has NaN entries; {masks}")
    if bool((value == torch.inf).any()):
        raise InvalidWrite(f"{name}: the written value has +inf entries (the softmax would be NaN); {masks}")
    finite = torch.isfinite(value).sum(-1).reshape(-1)
    short = (finite < top_k).nonzero()
    if short.numel():
        row = int(short[0])
        raise InvalidWrite(
            f"{name}: token {row} keeps {int(finite[row])} of its {value.shape[-1]} entries finite, and the top-k "
            f"picks {top_k}: at least {top_k} must stay above -inf, or the top-k picks among tied masked entries "
            "(with none finite, the softmax is NaN)"
        )


def served_shape(rows: torch.Tensor, head_dim: int | None = None, batch: bool = False) -> tuple[int, ...]:
    """The shape `batched` serves ``rows`` in."""
    shape = tuple(rows.shape) if batch else (1, *rows.shape)
    if head_dim is None:
        return shape
    return (*shape[:-1], shape[-1] // head_dim, head_dim)


def unavailable_reason(envoy: Any, value: str) -> str | None:
    """Why ``envoy`` cannot serve ``value``, or None when it can.

    Asks the loaded module (`StandardEnvoy.unavailable_here`) where the envoy
    has one, else its declarations (``unavailable``), so that a reason that
    depends on the loaded model (`FUSED_ROUTING`) is never missed; an envoy
    with neither (a plain nnsight one) serves everything it has.
    """
    ask = getattr(envoy, "unavailable_here", None) or getattr(envoy, "unavailable", None)
    return None if ask is None else ask(value)


class Located(eproperty):
    """An eproperty whose location key is filled from the envoy's declarations,
    and which can refuse, by name, a value the model cannot serve.

    ``{NAME}`` parts of the key are the envoy's class attributes; a key
    starting with ``../`` is relative to the envoy's parent (a sibling
    module's input or output); a key starting with ``source.`` is an
    operation inside the module's forward (nnsight's ``.source``), where a
    value has no module boundary of its own. The envoy's reason
    (`unavailable_reason`: its class's static reasons, and
    those of its loaded modules) and ``dynamic`` (a callable of the envoy and
    the location, for reasons that depend on the step a read would be served)
    are asked before anything is read.
    """

    def __init__(self, key: str, *, description: str | None = None, dynamic: Callable | None = None) -> None:
        super().__init__(key=key, description=description)
        self.dynamic = dynamic
        self._stub: Callable | None = None

    def __call__(self, stub: Callable) -> "Located":
        super().__call__(stub)
        self._stub = stub
        if self.description is None and stub.__doc__:
            self.description = stub.__doc__.strip().splitlines()[0]
        return self

    def __str__(self) -> str:
        hint = getattr(self._stub, "__annotations__", {}).get("return")
        hint = getattr(hint, "__name__", hint)
        return f"({self.name}) -> {hint}: {self.description}" if hint else f"({self.name}): {self.description}"

    @property
    def layout(self) -> str:
        """The value's layout, from its stub's annotation (``Residual``, ``Heads``, ...)."""
        hint = getattr(self._stub, "__annotations__", {}).get("return")
        return str(getattr(hint, "__name__", hint))

    def located_key(self, obj: Any) -> str:
        """The key with the envoy's declarations filled in."""
        return self.key.format_map(_Declarations(obj)) if "{" in self.key else self.key

    def _location(self, obj: Any) -> str:
        key, path = self.located_key(obj), obj.path
        # "../x" is a sibling's location: a sublayer's contribution read at the
        # block's post-sublayer norm (Gemma 2, EXAONE 4).
        while key.startswith("../"):
            key, path = key[3:], path.rsplit(".", 1)[0]
        return f"{path}.{key}"

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        self._check_available(obj)
        return super().__get__(obj, owner)

    def _check_available(self, obj: Any) -> None:
        reason = unavailable_reason(obj, self.name)
        if reason is None and self.dynamic is not None:
            reason = self.dynamic(obj, self._location(obj))
        if reason is not None:
            raise Unavailable(self.name, type(obj).__name__, reason)


class Checked(eproperty):
    """A value of the run outside any module (nnsight's ``logits``, ``samples``), served as a private copy.

    An edit of the copy, or an assignment, reaches the engine only through
    ``check(envoy, value, raw) -> value``, which raises `InvalidWrite` for a
    value the engine cannot take (a token id outside the vocabulary ended the
    engine, and every request in it, at the next step's embedding); the
    engine then keeps its own value and the error is the block's alone.
    """

    def __init__(self, key: str, check: Callable[[Any, Any, Any], Any], *, description: str | None = None) -> None:
        super().__init__(key=key, description=description)
        self.check = check

    def __call__(self, stub: Callable) -> "Checked":
        super().__call__(stub)
        self._preprocess = self._read
        self._transform = self._write_back
        return self

    def _read(self, obj: Any, raw: torch.Tensor) -> torch.Tensor:
        with _outside_inference():  # keeps a version counter, for `edited`
            return _versioned(raw.clone())

    def _write_back(self, obj: Any, view: torch.Tensor, raw: Any) -> Any:
        return self.check(obj, view, raw) if edited(view) else raw

    def __set__(self, obj: Any, value: Any) -> None:
        location = self._location(obj)
        Mediator.swap(location, self.check(obj, value, Mediator.value(location)))


def checked_tensor(name: str, value: Any, raw: torch.Tensor) -> torch.Tensor:
    """``value`` as the engine holds ``raw``: a tensor of its shape, on its device; TypeError-free checks.

    Raises:
        InvalidWrite: not a tensor, or another shape.
    """
    if not isinstance(value, torch.Tensor):
        raise InvalidWrite(f"{name}: expected a tensor of shape {list(raw.shape)}, got {type(value).__name__}")
    if value.shape != raw.shape:
        raise InvalidWrite(f"{name}: expected shape {list(raw.shape)}, got {list(value.shape)}")
    if value.is_meta:  # torch's "Cannot copy out of meta tensor" named neither the value nor the device (#46)
        raise InvalidWrite(f"{name}: expected a tensor on {raw.device}, got one on meta, which holds no data")
    return value.to(raw.device)


class Derived(Located):
    """A read-only value computed from the raw value at one location.

    The decorated stub receives the raw value (a module's ``(args, kwargs)``
    or output) and returns the value. Assigning it raises `ReadOnly`, whose
    message (``read_only``) says what to edit instead; so does an in-place
    edit, when the block moves on (the model never takes the value, so an
    edit would otherwise vanish without a word).
    """

    def __init__(self, key: str, *, read_only: str, description: str | None = None, dynamic: Callable | None = None):
        super().__init__(key, description=description, dynamic=dynamic)
        self.read_only = read_only

    def __call__(self, stub: Callable) -> "Derived":
        super().__call__(stub)
        self._preprocess = self._read
        self._transform = self._refuse_edits
        return self

    def _read(self, obj: Any, raw: Any) -> torch.Tensor:
        # Computed outside inference mode, so that the value keeps a version
        # counter and an in-place edit is seen without keeping a copy to compare.
        with _outside_inference():
            value = self._stub(obj, raw)
        return _versioned(value)

    def _refuse_edits(self, obj: Any, view: torch.Tensor, raw: Any) -> Any:
        if edited(view):
            raise ReadOnly(f"{self.name} is read-only, and an in-place edit does not reach the model: {self.read_only}")
        return raw

    def __set__(self, obj: Any, value: Any) -> None:
        raise ReadOnly(f"{self.name} is read-only: {self.read_only}")


class Flat(Located):
    """A value over a ``[tokens, ...]`` tensor, served as a private ``[1, tokens, ...]`` copy.

    Declared on an envoy class by decorating a stub whose return annotation is
    the layout and whose docstring says what the value is::

        @Flat("output")
        def mlp_output(self, value) -> Residual:
            '''What the MLP adds to the residual stream.'''
            return value

    Args:
        key: The location on the envoy: ``"input"``, ``"output"``, or a child's,
            ``"post_attention_layernorm.input"``. ``{NAME}`` parts are filled
            from the envoy's declarations (class attributes), so one value
            serves every family that names the place another way.
        select: Which part of the location is the tensor. On an ``input``, a
            `Slot` ``(position, keyword)``; on an output, an index into a tuple
            (by default a tuple serves its first element, so a norm vLLM calls
            with the residual beside the stream serves its normed half). A
            string names a declaration on the envoy holding either.
        heads: The name of a declaration on the envoy giving the head width;
            the last axis is then split into ``[heads, head_dim]``.
        factor: A declaration name for a scalar of the model the tensor is
            multiplied by to give the value (a residual multiplier); a written
            value is divided back.
        batch: Whether the tensor already carries the batch axis, or the name
            of the envoy's declaration saying so (``BATCHED``: True for the
            modules of vLLM's transformers backend, whose activations are
            ``[1, tokens, ...]``; vLLM's own attention kernel stays flat).
        top_k: The name of a declaration on the envoy giving how many
            entries of each row a top-k picks from the value (a router's
            logits: ``experts_per_token``): a written ``-inf`` then masks an
            entry instead of being refused, as long as each row keeps that
            many finite (`check_masked`). None for every other value, which
            must be finite; so must this one where the declaration is None.
        description: One line shown in the envoy's repr.
        dynamic: ``(envoy, location) -> reason | None``, asked before a read
            (see `Located`).

    Reading outside a trace raises ValueError (nnsight's); a value the model
    cannot serve raises `Unavailable` before anything is read; an assignment
    or in-place edit of the wrong layout raises `InvalidWrite` in the block.
    """

    def __init__(
        self,
        key: str,
        *,
        select: Slot | int | str | None = None,
        heads: str | None = None,
        factor: str | None = None,
        batch: bool | str = "BATCHED",
        top_k: str | None = None,
        description: str | None = None,
        dynamic: Callable | None = None,
    ) -> None:
        super().__init__(key, description=description, dynamic=dynamic)
        self.select = select
        self.heads = heads
        self.factor = factor
        self.batch = batch
        self.top_k = top_k

    def __call__(self, stub: Callable) -> "Flat":
        super().__call__(stub)
        self._preprocess = self._read
        self._transform = self._write_back
        return self

    # -- where the value is --------------------------------------------------

    def _slot(self, obj: Any) -> Any:
        return getattr(obj, self.select) if isinstance(self.select, str) else self.select

    def _head_dim(self, obj: Any) -> int | None:
        return None if self.heads is None else int(getattr(obj, self.heads))

    def _batch(self, obj: Any) -> bool:
        return bool(getattr(obj, self.batch, False)) if isinstance(self.batch, str) else self.batch

    def _scale(self, obj: Any) -> float:
        return 1.0 if self.factor is None else float(getattr(obj, self.factor))

    def _top_k(self, obj: Any) -> int | None:
        count = None if self.top_k is None else getattr(obj, self.top_k)
        return None if count is None else int(count)

    def _unbatched(self, obj: Any, value: Any, current: torch.Tensor) -> torch.Tensor:
        return unbatched(value, current, self.name, self._head_dim(obj), self._batch(obj), top_k=self._top_k(obj))

    # -- the raw value and the model's tensor in it --------------------------

    def pick(self, obj: Any, raw: Any) -> torch.Tensor:
        """The model's ``[tokens, ...]`` tensor at this location, as the value sees it."""
        slot = self._slot(obj)
        if self.key.endswith("input"):
            tensor = argument(raw, slot if slot is not None else (0, ""))
        elif isinstance(raw, (tuple, list)):
            tensor = raw[slot or 0]
        else:
            tensor = raw
        scale = self._scale(obj)
        return tensor if scale == 1.0 else tensor * scale

    def place(self, obj: Any, raw: Any, new: torch.Tensor, current: torch.Tensor) -> Any:
        """``raw`` with the tensor `pick` read replaced so that it reads ``new``."""
        scale = self._scale(obj)
        if scale != 1.0:
            new = new / scale
        slot = self._slot(obj)
        if self.key.endswith("input"):
            return with_argument(raw, slot if slot is not None else (0, ""), new)
        if isinstance(raw, (tuple, list)):
            index = slot or 0
            return type(raw)((*raw[:index], new, *raw[index + 1 :]))
        return new

    def halves(self, obj: Any, raw: Any) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The model's tensors whose sum `pick` reads, for an edit made in place: ``(written, other or None)``.

        An edit in place goes to the first (the value reads ``written + other``,
        and `place` puts a change on ``written``). None where the value is not
        such a plain sum (a scaled value).
        """
        if self._scale(obj) != 1.0:
            return None
        slot = self._slot(obj)
        if self.key.endswith("input"):
            return argument(raw, slot if slot is not None else (0, "")), None
        return (raw[slot or 0] if isinstance(raw, (tuple, list)) else raw), None

    # -- nnsight's three callbacks -------------------------------------------

    def _read(self, obj: Any, raw: Any) -> torch.Tensor:
        with _outside_inference():
            picked = self.pick(obj, raw)
        value = batched(picked, self._head_dim(obj), self._batch(obj), fresh=self._fresh(obj, raw))
        return self._stub(obj, value)

    def _fresh(self, obj: Any, raw: Any) -> bool:
        """Whether `pick` computes a tensor of its own (a scaled or summed stream), which needs no copy."""
        return self._scale(obj) != 1.0

    def _write_back(self, obj: Any, view: torch.Tensor, raw: Any) -> Any:
        # Fires whether the view was edited or not: an unedited view hands the
        # model back exactly what it had.
        if not edited(view):
            return raw
        current = self.pick(obj, raw)
        return self.place(obj, raw, self._unbatched(obj, view, current), current)

    def __set__(self, obj: Any, value: Any) -> None:
        self._check_available(obj)
        location = self._location(obj)
        raw = Mediator.value(location)
        current = self.pick(obj, raw)
        new = self._unbatched(obj, value, current)
        Mediator.swap(location, self.place(obj, raw, new, current))


class _Summed(Flat):
    """`Flat` over a call that takes the stream in two halves (see `summed`)."""

    def __init__(self, key: str, hidden: Slot | str, residual: Slot | str, description: str | None = None) -> None:
        super().__init__(key, select=hidden, description=description)
        self.residual = residual

    def _residual(self, obj: Any) -> Slot:
        return getattr(obj, self.residual) if isinstance(self.residual, str) else self.residual

    def pick(self, obj: Any, raw: Any) -> torch.Tensor:
        hidden = argument(raw, self._slot(obj))
        residual = argument(raw, self._residual(obj))
        return hidden if residual is None else hidden + residual

    def _fresh(self, obj: Any, raw: Any) -> bool:
        return argument(raw, self._residual(obj)) is not None

    def halves(self, obj: Any, raw: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        return argument(raw, self._slot(obj)), argument(raw, self._residual(obj))

    def place(self, obj: Any, raw: Any, new: torch.Tensor, current: torch.Tensor) -> Any:
        slot = self._slot(obj)
        hidden = argument(raw, slot)
        if argument(raw, self._residual(obj)) is None:
            return with_argument(raw, slot, new)
        # The callee adds the halves, so the edit rides on the hidden half.
        return with_argument(raw, slot, hidden + (new - current))


def summed(
    key: str,
    hidden: Slot | str = (0, "x"),
    residual: Slot | str = (1, "residual"),
    description: str | None = None,
) -> Callable[[Callable], Flat]:
    """The stream at a call that takes it in two halves, ``hidden + residual``, ``[1, tokens, hidden_size]``.

    A fused block hands its stream to the next norm as ``norm(hidden_states,
    residual)``, and the norm adds the two before it normalizes: the stream is
    their sum, computed for the read. ``key`` is the call's ``input``,
    ``hidden`` and ``residual`` where the halves sit in it (`Slot`, or the
    name of a declaration on the envoy holding one). An edit goes back
    as a change to the hidden half, and a read that edits nothing hands the
    model back exactly what it had; a call without the residual (a block's
    first norm, block 0) is its stream alone.
    """

    def decorate(stub: Callable) -> Flat:
        return _Summed(key, hidden, residual, description)(stub)

    return decorate


class _SummedOutput(Flat):
    """`Flat` over an output ``(hidden, residual)`` whose sum is the stream (see `summed_output`)."""

    def pick(self, obj: Any, raw: Any) -> torch.Tensor:
        return raw[0] + raw[1]

    def halves(self, obj: Any, raw: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        return raw[0], raw[1]

    def _fresh(self, obj: Any, raw: Any) -> bool:
        return True

    def place(self, obj: Any, raw: Any, new: torch.Tensor, current: torch.Tensor) -> Any:
        return type(raw)((raw[0] + (new - current), *raw[1:]))


def summed_output(key: str = "output", description: str | None = None) -> Callable[[Callable], Flat]:
    """The stream a fused block returns as ``(hidden_states, residual)``: their sum, ``[1, tokens, hidden_size]``.

    An edit goes back as a change to ``hidden_states`` (the next norm adds
    the two); an unedited read hands back exactly what the block returned.
    """

    def decorate(stub: Callable) -> Flat:
        return _SummedOutput(key, description=description)(stub)

    return decorate


def unhookable(envoy: Any, value: Any) -> str | None:
    """Why one hook per module per step cannot serve ``value`` on ``envoy`` for a whole batch (None when it can).

    The batched paths (`vlenvoys.worker.collector`, `vlenvoys.worker.steerer`) read or write
    a value as one ``[tokens, ...]`` tensor at a module's input or output: a
    `Flat`, not one recomputed per request (`Derived`), nor one at an
    operation inside a forward (``source.``, which nnsight's workers serve).
    """
    if not isinstance(value, Flat) or isinstance(value, Derived):
        return "is recomputed per request"
    if value.located_key(envoy).startswith("source."):
        return "is read at an operation inside the forward"
    return None


class _Declarations(dict):
    """Fills ``{NAME}`` in a location key from the envoy's declarations."""

    def __init__(self, envoy: Any) -> None:
        super().__init__()
        self.envoy = envoy

    def __missing__(self, name: str) -> str:
        return str(getattr(self.envoy, name))
