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
import functools
import inspect
import textwrap
import types
from collections.abc import Iterable, Mapping
from typing import Any

from nnsight.intervention.envoy import Envoy

from ..errors import NoSuchBlock
from ..values.names import OWNERS, choices

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
            raise ValueError(f"sites: {value!r} is not a standard block value; {choices(str(value))}")
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
            check cannot tell where that value is not declared at every block;
            or it hands the model (or one of its modules) to a callable whose
            source cannot be read.
        NoSuchBlock: it names a block outside the model's.
    """
    if node is None:
        return
    scope = {} if frame is None else {**frame.f_globals, **frame.f_locals}
    _check_block(node, scope, sites, blocks, frozenset(names), DEPTH, set(), "")


def _check_block(
    node: ast.AST, scope: Mapping[str, Any], sites: Sites, blocks: int, names: frozenset[str], depth: int, seen: set,
    where: str,
) -> None:
    declaration = described(sites, blocks)
    parents = {inner: each for each in ast.walk(node) for inner in ast.iter_child_nodes(each)}
    # A name the block binds (a loop variable, an assignment, a parameter of a lambda or def in it) says nothing
    # about the frame's value of it.
    bound = {each.id for each in ast.walk(node) if isinstance(each, ast.Name) and isinstance(each.ctx, ast.Store)}
    bound |= {each.arg for each in ast.walk(node) if isinstance(each, ast.arg)}
    bound |= {each.name for each in ast.walk(node) if isinstance(each, ast.ExceptHandler) and each.name}
    visible = {name: held for name, held in scope.items() if name not in bound}
    ints = {name: held for name, held in visible.items() if isinstance(held, int) and not isinstance(held, bool)}

    def site(value: str, block: int | None, at: ast.AST, doing: str = "read") -> None:
        _check_site(value, block, sites, blocks, f"{where}line {getattr(at, 'lineno', '?')}", declaration, doing)

    for each in sorted(ast.walk(node), key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0))):
        if isinstance(each, ast.Call):
            _check_call(each, visible, ints, names, depth, seen, site, lambda fn, d: _check_helper(
                fn, sites, blocks, names, d, seen))
        if not isinstance(each, ast.Attribute):
            continue
        parent = parents.get(each)
        if each.attr in LAYER_LISTS and isinstance(parent, ast.Subscript) and parent.value is each:
            site(LAYER_LISTS[each.attr], _index(parent.slice, ints), each)  # nnterp's model.layers_output[i]
        elif each.attr in RAW_VALUES and _reaches_a_module(each.value, names, visible):
            raise ValueError(
                f"{where}line {getattr(each, 'lineno', '?')}: .{each.attr} is a module's raw value, which this "
                f"engine's graphs replay without a trace's Python: it serves the standard values declared at load; "
                f"declared: {declaration}"
            )
        elif each.attr in OWNERS and not _plain_object(each.value, visible):
            site(each.attr, _block_of(each.value, names, ints), each, "written" if isinstance(each.ctx, ast.Store) else "read")
        elif each.attr == "token_embeddings" and not _plain_object(each.value, visible):
            site("layer_input", 0, each)  # the embedding's output: the stream entering block 0


def _check_call(call: ast.Call, visible: Mapping[str, Any], ints: Mapping[str, int], names: frozenset[str],
                depth: int, seen: set, site: Any, helper: Any) -> None:
    """A call in a checked block: ``model.steer``/``skip_layer(s)`` write ``layer_output``; a function of the user's
    is checked too (`_check_helper`); one that cannot be read and is handed the model or a module is refused."""
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr in ("steer", "skip_layer", "skip_layers") and (
        call.args or call.keywords
    ) and not _plain_object(func.value, visible):
        if func.attr == "skip_layers" and len(call.args) >= 2:
            start, end = _index(call.args[0], ints), _index(call.args[1], ints)
            for block in [None] if start is None or end is None else range(start, end + 1):
                site("layer_output", block, call, "written")
            return
        given = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg in ("layers", "layer")), None)
        listed = given.elts if isinstance(given, (ast.List, ast.Tuple)) else [given]
        for each in listed:
            site("layer_output", None if each is None else _index(each, ints), call, "written")
        return
    target = _callee(func, visible)
    if target is None:
        return
    if depth > 0 and helper(target, depth - 1):
        return
    handed = [arg for arg in [*call.args, *(k.value for k in call.keywords)] if _is_module(arg, visible, names)]
    if handed and not _readable(target):
        raise ValueError(
            f"line {getattr(call, 'lineno', '?')}: {ast.unparse(func)} is handed the model or one of its modules, "
            "and its source cannot be read to check the sites it reaches: read the values in the trace's block, or "
            "in a function defined in a file"
        )


def _callee(func: ast.AST, visible: Mapping[str, Any]) -> Any:
    """What a call's ``func`` names in the frame (``f``, ``module.f``, ``obj.method``), or None."""
    if isinstance(func, ast.Name):
        return visible.get(func.id)
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in visible:
        try:
            return inspect.getattr_static(visible[func.value.id], func.attr)
        except AttributeError:
            return None
    return None


def _function_of(target: Any) -> types.FunctionType | None:
    """The Python function behind a callable: a function (unwrapped), a method's, a partial's, a class's __init__."""
    for _ in range(4):
        if isinstance(target, (staticmethod, classmethod)):
            target = target.__func__
        elif isinstance(target, types.MethodType):
            target = target.__func__
        elif isinstance(target, functools.partial):
            target = target.func
        elif isinstance(target, type):
            target = target.__dict__.get("__init__")
        else:
            break
    target = inspect.unwrap(target) if callable(target) else target
    return target if isinstance(target, types.FunctionType) else None


def _readable(target: Any) -> bool:
    """Whether a callable is one the check can read (or one of a library's, which is not the user's code)."""
    function = _function_of(target)
    if function is None:
        return not isinstance(target, types.FunctionType)  # builtins, torch's functions: not the user's to check
    return function.__name__ != "<lambda>" and _source_tree(function) is not None


def _source_tree(function: types.FunctionType) -> ast.AST | None:
    """``function``'s own definition, parsed, with the file's line numbers; None where it cannot be read as it is
    (no file, a lambda, a file edited since it was imported)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except Exception:  # OSError, TypeError, SyntaxError, tokenize's errors on a file changed since
        return None
    first = tree.body[0] if tree.body else None
    if not isinstance(first, (ast.FunctionDef, ast.AsyncFunctionDef)) or first.name != function.__name__:
        return None
    ast.increment_lineno(tree, function.__code__.co_firstlineno - 1)
    return tree


def _check_helper(function: Any, sites: Sites, blocks: int, names: frozenset[str], depth: int, seen: set) -> bool:
    """A function of the user's that the block calls, checked as the block is: its arguments are unknown, so the
    blocks it indexes with them are too. Whether it was read (False: not a function with source to read)."""
    function = _function_of(function)
    if function is None or function.__name__ == "<lambda>":
        return False
    if function.__code__ in seen:
        return True
    module = inspect.getmodule(function)
    if module is not None and module.__name__.split(".")[0] in ("vlenvoys", "nnsight", "torch", "vllm"):
        return True  # the libraries' own: not the user's reads
    tree = _source_tree(function)
    if tree is None:
        return False
    seen.add(function.__code__)
    code = function.__code__
    own = set(code.co_varnames) | set(code.co_cellvars) | set(code.co_freevars)
    scope = {name: held for name, held in function.__globals__.items() if name not in own}
    if function.__closure__:
        scope.update(inspect.getclosurevars(function).nonlocals)
    where = f"in {function.__qualname__} ({inspect.getsourcefile(function)}), "
    _check_block(tree, scope, sites, blocks, names, depth, seen, where)
    return True


def _check_site(value: str, block: int | None, sites: Sites, blocks: int, line: str, declaration: str,
                doing: str = "read") -> None:
    chosen = sites.get(value, frozenset())
    if block is None:
        if len(chosen) == blocks:
            return
        raise ValueError(
            f"{line}: {value} is {doing} at a block this check cannot tell before the trace runs (the index is not a "
            f"constant or an int of the trace's frame): declare it at every block (sites={{{value!r}: 'all'}}) or "
            f"index the block with a constant; declared: {declaration}"
        )
    if not -blocks <= block < blocks:
        raise NoSuchBlock(f"{line}: block {block} is outside the model's {blocks} blocks (0 to {blocks - 1}, or "
                          f"-{blocks} to -1)")
    if block % blocks in chosen:
        return
    raise ValueError(
        f"{line}: model.layers[{block}].{value} is not a declared site of this engine (vlenvoys.load(..., "
        f"cuda_graphs=True, sites=...)); declared: {declaration}"
    )


def _plain_object(node: ast.AST, visible: Mapping[str, Any]) -> bool:
    """Whether ``node`` is a name the frame holds something other than the model's (or an envoy) in: its
    attributes are the user's own, not sites (``out.layer_output = ...``)."""
    if not isinstance(node, ast.Name) or node.id not in visible:
        return False
    return not isinstance(visible[node.id], Envoy)


def _is_module(node: ast.AST, visible: Mapping[str, Any], names: frozenset[str]) -> bool:
    """Whether a call's argument is the model or one of its modules: a name the frame holds an envoy in, or
    ``<...>.layers[i]`` and the like."""
    if isinstance(node, ast.Name):
        return isinstance(visible.get(node.id), Envoy)
    return _reaches_a_module(node, names, visible) or (
        isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr in names
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


def _reaches_a_module(node: ast.AST, names: frozenset[str], visible: Mapping[str, Any]) -> bool:
    """Whether ``node`` is a model's module as a trace names one: through its blocks (``layers[i]``, a child after),
    the model's own modules (``embed_tokens``, ``lm_head``, ``ln_final``, ``model``), or a name the frame holds an
    envoy in (the model itself)."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        if isinstance(node, ast.Attribute) and node.attr in names | {"embed_tokens", "lm_head", "ln_final", "model"}:
            return True
        node = node.func if isinstance(node, ast.Call) else node.value
    if isinstance(node, ast.Name) and node.id in visible:
        return isinstance(visible[node.id], Envoy)
    return False
