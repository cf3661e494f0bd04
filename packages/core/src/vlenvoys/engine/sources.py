"""The client's pickling of trace requests: each function's source read and parsed once, not per request.

nnsight pickles every invoke's mediator on its own, and a function the block
calls travels as its source: for each request it reads the source again
(``inspect.getsource`` tokenizes the file from the function's first line; a
lambda's source is found by parsing) and parses it again to find the names it
uses. A trace of 64 invokes calling one helper did that 64 times, a tenth of
the client's time in a trace on the CPU. The results depend only on the code
object (for the source) and on the source text (for the names), so they are
kept here, at most `KEPT` of each; nothing else in nnsight's pickling changes.
"""

from __future__ import annotations

import collections
import functools
import types
from typing import Any, Callable

__all__ = ["install"]

#: Entries kept per cache (least recently used dropped first).
KEPT = 512


def install() -> None:
    """Put the caching lookups into nnsight's serialization module (once per process)."""
    from nnsight.intervention import serialization

    if getattr(serialization, "_vlenvoys_sources", False):
        return
    serialization._lambda_source = _by_code(serialization._lambda_source)
    serialization._function_referenced_names = _by_source(serialization._function_referenced_names)
    serialization._referenced_names = _by_source(serialization._referenced_names)
    serialization.inspect = _Inspect(serialization.inspect)
    serialization._vlenvoys_sources = True


def _key(func: Any) -> Any:
    code = getattr(func, "__code__", None)
    # Equal code objects compare equal across files; the file and the qualified name tell them apart.
    return None if code is None else (code, code.co_filename, getattr(code, "co_qualname", code.co_name))


class _Lru(collections.OrderedDict):
    def remember(self, key: Any, make: Callable[[], Any]) -> Any:
        if key in self:
            self.move_to_end(key)
            return self[key]
        value = self[key] = make()
        if len(self) > KEPT:
            self.popitem(last=False)
        return value


def _by_code(find: Callable[[types.FunctionType], str]) -> Callable[[types.FunctionType], str]:
    kept = _Lru()

    @functools.wraps(find)
    def cached(func: types.FunctionType) -> str:
        key = _key(func)
        return find(func) if key is None else kept.remember(key, lambda: find(func))

    return cached


def _by_source(names: Callable[[str], set]) -> Callable[[str], set]:
    kept = _Lru()

    @functools.wraps(names)
    def cached(source: str) -> set:
        return set(kept.remember(source, lambda: frozenset(names(source))))  # a copy: callers may change theirs

    return cached


class _Inspect:
    """``inspect`` as nnsight's serialization uses it, with a function's source lines looked up once.

    An error (no source: a function made by ``exec``, a C function) is not
    kept: it is raised again at the next lookup, as ``inspect`` would.
    """

    def __init__(self, module: types.ModuleType) -> None:
        self._module = module
        self._lines = _Lru()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def getsourcelines(self, func: Any) -> tuple[list[str], int]:
        key = _key(func)
        if key is None:
            return self._module.getsourcelines(func)
        lines, first = self._lines.remember(key, lambda: self._module.getsourcelines(func))
        return list(lines), first

    def getsource(self, func: Any) -> str:
        return "".join(self.getsourcelines(func)[0])
