"""A trace's tracer: one forward pass unless the trace asks for more, and a pointer where a block's raw output is read.

nnsight's vLLM tracer makes each invoke a vLLM request whose ``SamplingParams``
are the trace's and the invoke's keyword arguments, so a trace that names no
length generated vLLM's default 16 tokens. Users of nnsight on transformers
and of nnterp expect ``model.trace(prompt)`` to be one forward pass (#49):
`Trace` gives such a request ``max_tokens=1``. What the user asks for wins: a
length named on the trace or the invoke (``max_tokens``, ``max_new_tokens``,
``min_tokens``), a trace that steps through the generation (``tracer.iter``,
``tracer.all()``), or ``with model.generate(...)`` (`Generation`), which keep
vLLM's own length as before.

Both tracers also point a user at the residual stream when the trace reads a
block's raw ``.output`` (`RawOutputWarning`): on vLLM it is what vLLM's module
returns (on most families ``(hidden_states, residual)``, whose first half is
only the last sublayer's output), not transformers' ``(stream, ...)``.
"""

from __future__ import annotations

import ast
import inspect
import warnings
from types import CodeType
from typing import Any

from nnsight.modeling.vllm.tracer import VLLMTracer

from ..errors import RawOutputWarning
from ..values.envoys import FusedLayer
from .sites import check

__all__ = ["GENERATION_LENGTH", "RAW", "Generation", "Trace", "raw_reads", "steps_through"]

#: A block's raw values as nnsight names them: what its module returns, its first argument, all its arguments.
RAW = ("output", "input", "inputs")
#: The ``SamplingParams`` fields that set a generation's length: a trace or invoke naming one keeps its length.
GENERATION_LENGTH = frozenset({"max_tokens", "min_tokens"})


class Generation(VLLMTracer):
    """``with model.generate(...)``: nnsight's vLLM tracer, which warns where a block's raw output is read, and on an
    engine that replays CUDA graphs refuses a site outside those declared at load (`vlenvoys.engine.sites`)."""

    def prepare(self, code: CodeType) -> tuple:
        model = self.envoy
        if getattr(model, "cuda_graphs", False) and getattr(model, "sites", None) is not None:
            layers = model.layers
            check(self.node, None if self.info is None else self.info.frame, model.sites, len(layers),
                  {"layers", layers.path.rsplit(".", 1)[-1]})
        try:
            prepared = super().prepare(code)
        except ValueError as error:
            # With no prompt of the trace's own, nnsight runs the block here to find its invokes, and a read outside
            # one fails naming vLLM's module path and "interleaving".
            if "outside of interleaving" not in str(error) or model._batch_size(*self.args, **self.kwargs):
                raise
            raise ValueError(
                "this trace has no prompt where it reads: pass one, model.trace('The Eiffel Tower is in', ...), or "
                f"read inside an invoke, with tracer.invoke('...'): ({error})"
            ) from None
        if getattr(model, "cuda_graphs", False) and waits_off_the_sites(self.node):
            _, params, _ = prepared[1]
            for param in params:  # its steps run eagerly: a sited graph would pass where the block waits
                param.vlenvoys_eager = True  # into extra_args once nnsight has attached the block (`_call`)
        warn_raw_output(self)
        return prepared


class Trace(Generation):
    """``with model.trace(...)``: one forward pass (``max_tokens=1``) per request that asks for no length.

    A request asks for one when its invoke (or, with a direct input, the
    trace) names a `GENERATION_LENGTH` field, or the trace names one for
    every invoke; a trace that steps through the generation (`steps_through`)
    keeps vLLM's default for every request.
    """

    def prepare(self, code: CodeType) -> tuple:
        mediators, args, kwargs = super().prepare(code)
        if not (GENERATION_LENGTH & set(kwargs)) and not steps_through(self.node):
            _, params, _ = args
            for param in params:
                if not GENERATION_LENGTH & getattr(param, "nnsight_named", frozenset()):
                    param.max_tokens = 1
        return mediators, args, kwargs


#: What a block may reach on a graph engine that waits at no declared site: the embedding's input, a block's input
#: (``skip_layer``), every module (``tracer.cache()``).
OFF_THE_SITES = frozenset({"input_ids", "input_size", "skip_layer", "skip_layers", "cache"})


def waits_off_the_sites(node: ast.AST | None) -> bool:
    """Whether a trace's block names something a graph broken only at the declared sites would pass without
    serving (`OFF_THE_SITES`), read from its source as nnsight captured it (not the functions it calls)."""
    return node is not None and any(
        isinstance(each, ast.Attribute) and each.attr in OFF_THE_SITES for each in ast.walk(node)
    )


def steps_through(node: ast.AST | None) -> bool:
    """Whether a trace's ``with`` block steps through the generation: ``tracer.iter[...]`` or ``tracer.all()``.

    Read from the block's source, as nnsight captured it: ``.iter`` on
    anything (the tracer's, or an envoy's deprecated one), ``.all`` on the
    name the tracer is bound to (``with model.trace(...) as tracer``; a
    tensor's ``.all()`` is not a step). A helper function that steps with a
    tracer passed to it is not seen: such a trace names its ``max_tokens``.
    """
    if node is None:
        return False
    tracers = {
        item.optional_vars.id for item in getattr(node, "items", ()) if isinstance(item.optional_vars, ast.Name)
    }
    for each in ast.walk(node):
        if isinstance(each, ast.Attribute):
            if each.attr == "iter":
                return True
            if each.attr == "all" and isinstance(each.value, ast.Name) and each.value.id in tracers:
                return True
    return False


def raw_reads(node: ast.AST | None, blocks: set[str]) -> list[ast.Attribute]:
    """The places in a ``with`` block that read or write ``<...>.<blocks>[i].output`` (or ``.input``,
    ``.inputs``: `RAW`), in source order.

    ``blocks`` are the names the model's list of blocks goes by (``layers``,
    and vLLM's own, ``h`` for GPT-2). A block reached otherwise (``for layer in
    model.layers: layer.output``) is not seen.
    """
    if node is None:
        return []
    found = [
        each
        for each in ast.walk(node)
        if isinstance(each, ast.Attribute)
        and each.attr in RAW
        and isinstance(each.value, ast.Subscript)
        and isinstance(each.value.value, ast.Attribute)
        and each.value.value.attr in blocks
    ]
    return sorted(found, key=lambda each: (each.lineno, each.col_offset))


def warn_raw_output(tracer: Any) -> None:
    """`RawOutputWarning` at the first place ``tracer``'s block reads a block's raw ``.output`` or ``.input``.

    Issued as if from that line of the user's file (``warnings.warn_explicit``
    with its module's registry), so Python's default filter shows it once
    per place, however often the trace runs.
    """
    model, info = tracer.envoy, tracer.info
    layers = getattr(model, "layers", None)
    if layers is None or info is None or len(layers) == 0:
        return
    reads = raw_reads(tracer.node, {"layers", layers.path.rsplit(".", 1)[-1]})
    if not reads:
        return
    frame = info.frame
    message = raw_output_message(layers[0]) if reads[0].attr == "output" else raw_input_message(layers[0], reads[0].attr)
    warnings.warn_explicit(
        message,
        RawOutputWarning,
        frame.f_code.co_filename,
        reads[0].lineno,
        module=frame.f_globals.get("__name__", "__main__"),
        registry=frame.f_globals.setdefault("__warningregistry__", {}),
        module_globals=frame.f_globals,
    )


def raw_output_message(block: Any) -> str:
    """What `RawOutputWarning` says of a block like ``block`` (the first of the model's)."""
    if isinstance(block, FusedLayer):
        returned = (
            "on this model a tuple (hidden_states, residual) of [tokens, hidden_size] rows with no batch axis: "
            "output[0] is only the last sublayer's output (the MLP's), and the residual stream is the sum of the two"
        )
    else:
        returned = "in vLLM's layout: rows with no batch axis ([tokens, hidden_size], or a tuple of them)"
    return (
        f"model.layers[i].output is what vLLM's decoder layer ({type(block._module).__name__}) returns, not "
        f"transformers' (stream, ...): {returned}. The residual stream leaving block i, [1, tokens, hidden_size] "
        "as on transformers, is model.layers[i].layer_output (nnterp's model.layers_output[i]); entering it, "
        ".layer_input. The raw output stays readable; silence this with "
        "warnings.filterwarnings('ignore', category=vlenvoys.RawOutputWarning)."
    )


def raw_input_message(block: Any, attr: str) -> str:
    """What `RawOutputWarning` says where a block's raw ``.input`` or ``.inputs`` (``attr``) is read."""
    module = block._module
    try:
        arguments = [name for name in inspect.signature(type(module).forward).parameters if name != "self"]
    except (TypeError, ValueError):
        arguments = []
    taken = f"({', '.join(arguments)})" if arguments else "its arguments"
    read = (
        f"the first argument, {arguments[0]}" if attr == "input" and arguments
        else "the first argument" if attr == "input" else "every argument"
    )
    return (
        f"model.layers[i].{attr} is what vLLM passes its decoder layer ({type(module).__name__}{taken}), not "
        f"transformers' hidden_states [1, tokens, hidden_size]: {read}, in vLLM's layout (rows with no batch axis). "
        "The residual stream entering block i, [1, tokens, hidden_size] as on transformers, is "
        "model.layers[i].layer_input (nnterp's model.layers_input[i]); leaving it, .layer_output. The raw value stays "
        "readable; silence this with warnings.filterwarnings('ignore', category=vlenvoys.RawOutputWarning)."
    )
