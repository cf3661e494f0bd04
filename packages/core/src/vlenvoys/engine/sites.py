"""A graph engine's trace sites: the standard values at the blocks a trace may read or write there (#48).

An engine loaded with ``cuda_graphs=True`` replays CUDA graphs of its decode
steps, which run none of a trace's Python. Such an engine serves traces at
the sites declared at load (``vlenvoys.load(..., cuda_graphs=True,
sites={"layer_output": "all", "attention_output": [3, 7]})``): every step that
runs a trace's block runs eagerly, so its values are whole on the prefill and
on every decode step (`vlenvoys.worker.runner`), and a trace that names a
site outside the declaration is refused, by name, before any of its requests
is sent (`check`). Steps that run no block keep their graphs.

The check reads the trace's block as nnsight captured it: a standard value
reached through ``<model>.layers[i]`` (``.self_attn`` / ``.mlp`` between, or
nnterp's ``model.layers_output[i]``), with ``i`` a constant or a name the
trace's frame holds an int in (and the block does not rebind). A value reached otherwise (a loop variable, a
block bound to a name, an argument of a helper function the block calls,
which is read too) is served only where it is declared at every block. ``model.steer(layer, ...)`` writes ``layer_output``
at its block. Raw module values (``.output``, ``.input``,
``.inputs``, ``.source``) are refused: the declaration names standard values.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import NoSuchBlock
from ..values.names import OWNERS, nearest

__all__ = ["EVERY_BLOCK", "LAYER_LISTS", "RAW_VALUES", "Sites", "check", "declared"]

#: A declaration's word for every block.
EVERY_BLOCK = "all"
#: nnterp's per-layer lists on the model, and the value each serves (``model.layers_output[i]``).
LAYER_LISTS = {
    "layers_input": "layer_input",
    "layers_output": "layer_output",
    "attentions_output": "attention_output",
    "mlps_output": "mlp_output",
    "attention_probabilities": "attention_probabilities",
}
#: A module's raw values as nnsight names them: not sites.
RAW_VALUES = frozenset({"output", "input", "inputs", "source"})
#: The names a block's children go by between the block and one of their values.
_CHILDREN = frozenset({"self_attn", "mlp"})

#: Declared sites: each standard value name, and the blocks (0-based) it is declared at.
Sites = Mapping[str, frozenset[int]]


def declared(sites: Mapping[str, Any], blocks: int) -> dict[str, frozenset[int]]:
    """``load``'s ``sites`` resolved against a model of ``blocks`` blocks.

    ``sites`` maps a standard value name (nnterp's: ``layer_output``,
    ``attention_output``, ...) to ``"all"``, a block index or a list of them
    (negative counts from the end).

    Raises:
        ValueError: ``sites`` is empty or not a mapping, a name is no standard
            block value (with the nearest one), or a value names no blocks.
        NoSuchBlock: a block index outside the model's ``blocks``.
    """
    if not isinstance(sites, Mapping) or not sites:
        raise ValueError(
            f"sites: expected a mapping of standard value names to blocks, such as {{'layer_output': 'all'}}, "
            f"got {sites!r}"
        )
    resolved: dict[str, frozenset[int]] = {}
    for value, where in sites.items():
        if value not in OWNERS:
            close = nearest(str(value))
            guess = f"did you mean {close!r}? " if close else ""
            raise ValueError(f"sites: {value!r} is not a standard block value; {guess}the values are {', '.join(OWNERS)}")
        if where == EVERY_BLOCK:
            resolved[value] = frozenset(range(blocks))
            continue
        listed = [where] if isinstance(where, int) else where
        if not isinstance(listed, Iterable) or isinstance(listed, str) or not (listed := list(listed)):
            raise ValueError(f"sites[{value!r}]: expected 'all', a block index or a non-empty list of them, got {where!r}")
        chosen = set()
        for block in listed:
            if isinstance(block, bool) or not isinstance(block, int):
                raise ValueError(f"sites[{value!r}]: block indexes are ints, got {block!r}")
            if not -blocks <= block < blocks:
                raise NoSuchBlock(f"sites[{value!r}]: block {block} is outside the model's {blocks} blocks "
                                  f"(0 to {blocks - 1}, or -{blocks} to -1)")
            chosen.add(block % blocks)
        resolved[value] = frozenset(chosen)
    return resolved


def described(sites: Sites, blocks: int) -> str:
    """The declaration as a sentence's part: ``layer_output at every block; attention_output at blocks 3, 7``."""
    parts = []
    for value, chosen in sites.items():
        listed = ", ".join(map(str, sorted(chosen)))
        where = "every block" if len(chosen) == blocks else f"block{'s' if len(chosen) > 1 else ''} {listed}"
        parts.append(f"{value} at {where}")
    return "; ".join(parts)


#: How deep `check` follows the functions a block calls (a helper's helpers).
DEPTH = 3


def check(node: ast.AST | None, frame: Any, sites: Sites, blocks: int, names: Iterable[str]) -> None:
    """Refuse a trace's block that reaches a site outside ``sites``, before anything runs.

    ``node`` is the block as nnsight captured it (the trace's ``with``
    statement), ``frame`` the frame it was written in (its ints name blocks),
    ``names`` what the model's list of blocks goes by (``layers``, and
    vLLM's own name for it).

    Raises:
        ValueError: the block reads or writes a raw module value, a standard
            value at a block it is not declared at, or one at a block the
            check cannot tell where that value is not declared at every block.
    """
    if node is None:
        return
    scope = {} if frame is None else {**frame.f_globals, **frame.f_locals}
    _check_block(node, scope, sites, blocks, frozenset(names), DEPTH, set())


def _check_block(
    node: ast.AST, scope: Mapping[str, Any], sites: Sites, blocks: int, names: frozenset[str], depth: int, seen: set
) -> None:
    declaration = described(sites, blocks)
    parents = {inner: each for each in ast.walk(node) for inner in ast.iter_child_nodes(each)}
    # A name the block binds (a loop variable, an assignment) says nothing about the frame's value of it.
    bound = {each.id for each in ast.walk(node) if isinstance(each, ast.Name) and isinstance(each.ctx, ast.Store)}
    ints = {
        name: held for name, held in scope.items() if name not in bound and isinstance(held, int) and not isinstance(held, bool)
    }
    for each in sorted(ast.walk(node), key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0))):
        line = getattr(each, "lineno", "?")
        if isinstance(each, ast.Call) and isinstance(each.func, ast.Name) and depth > 0:
            _check_helper(scope.get(each.func.id), sites, blocks, names, depth - 1, seen)
        if isinstance(each, ast.Call) and isinstance(each.func, ast.Attribute) and each.func.attr == "steer":
            # model.steer(layer, ...) writes the stream leaving that block.
            layer = each.args[0] if each.args else next((k.value for k in each.keywords if k.arg == "layers"), None)
            _check_site("layer_output", None if layer is None else _index(layer, ints), sites, blocks, line, declaration)
        if not isinstance(each, ast.Attribute):
            continue
        if each.attr in RAW_VALUES and _reaches_a_module(each.value, names):
            raise ValueError(
                f"line {line}: .{each.attr} is a module's raw value, which this engine's graphs replay without a "
                f"trace's Python: it serves the standard values declared at load; declared: {declaration}"
            )
        if each.attr in OWNERS:
            _check_site(each.attr, _block_of(each.value, names, ints), sites, blocks, line, declaration)
        elif each.attr in LAYER_LISTS and isinstance(parents.get(each), ast.Subscript) and parents[each].value is each:
            _check_site(LAYER_LISTS[each.attr], _index(parents[each].slice, ints), sites, blocks, line, declaration)


def _check_helper(function: Any, sites: Sites, blocks: int, names: frozenset[str], depth: int, seen: set) -> None:
    """A function of the user's that the block calls, checked as the block is: its arguments are unknown, so the
    blocks it indexes with them are too. One whose source cannot be read (a builtin, a lambda) is not looked into."""
    if not isinstance(function, types.FunctionType) or function.__code__ in seen or function.__name__ == "<lambda>":
        return
    seen.add(function.__code__)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return
    arguments = set(function.__code__.co_varnames)
    scope = {name: held for name, held in function.__globals__.items() if name not in arguments}
    try:
        _check_block(tree, scope, sites, blocks, names, depth, seen)
    except ValueError as error:
        raise ValueError(f"in {function.__qualname__} ({inspect.getsourcefile(function)}), {error}") from None


def _check_site(value: str, block: int | None, sites: Sites, blocks: int, line: Any, declaration: str) -> None:
    chosen = sites.get(value, frozenset())
    if block is None:
        if len(chosen) == blocks:
            return
        raise ValueError(
            f"line {line}: {value} is read at a block this check cannot tell before the trace runs (a loop variable, "
            f"a name bound to a block, a helper): declare it at every block (sites={{{value!r}: 'all'}}) or index "
            f"the block with a constant; declared: {declaration}"
        )
    if -blocks <= block < blocks and block % blocks in chosen:
        return
    raise ValueError(
        f"line {line}: model.layers[{block}] {value} is not a declared site of this engine (vlenvoys.load(..., "
        f"cuda_graphs=True, sites=...)); declared: {declaration}"
    )


def _block_of(node: ast.AST, names: frozenset[str], ints: Mapping[str, int]) -> int | None:
    """The block index of ``<...>.layers[i]`` (``.self_attn`` / ``.mlp`` after it), or None where it is not that."""
    if isinstance(node, ast.Attribute) and node.attr in _CHILDREN:
        node = node.value
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr in names:
        return _index(node.slice, ints)
    return None


def _index(node: ast.AST, ints: Mapping[str, int]) -> int | None:
    """An index the check can read: a constant int, its negation, or a name of the frame's that holds an int."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _index(node.operand, ints)
        return None if inner is None else -inner
    if isinstance(node, ast.Name):
        return ints.get(node.id)
    return None


def _reaches_a_module(node: ast.AST, names: frozenset[str]) -> bool:
    """Whether ``node`` is a model's module as a trace names one: through its blocks (``layers[i]``, a child after)
    or the model's own modules (``embed_tokens``, ``lm_head``, ``ln_final``)."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        if isinstance(node, ast.Attribute) and node.attr in names | {"embed_tokens", "lm_head", "ln_final"}:
            return True
        node = node.func if isinstance(node, ast.Call) else node.value
    return False
