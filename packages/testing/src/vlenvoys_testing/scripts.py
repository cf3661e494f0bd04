"""The repository's scripts (``benchmarks/gate.py``, ``benchmarks/soak.py``), imported by path for their tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def script(path: str | Path, name: str | None = None) -> ModuleType:
    """The module of the Python file at ``path``, run once and registered in ``sys.modules`` as ``name``.

    Registered before it runs because dataclasses look their module up there. Raises FileNotFoundError when
    ``path`` does not exist (the scripts live in a checkout, not in an installed wheel).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no script at {path}: its tests run from a checkout of the repository")
    name = name or f"vlenvoys_script_{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
