"""Core's wings keep their shape (#47): each imports only the wings below it, at a module's top, no private names."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import vlenvoys

ROOT = Path(__file__).resolve().parents[3]
#: The imported vlenvoys, the one lint-imports analyzes: this checkout's source, or an environment's installed copy.
CORE = Path(vlenvoys.__file__).parent


def test_import_linter_contracts_are_kept():
    """The layers, the client/worker split and no circles (pyproject.toml's [tool.importlinter])."""
    command = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    ran = subprocess.run([command, "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stdout[-4000:] + ran.stderr[-2000:]


def modules() -> list[tuple[str, ast.Module]]:
    """Every module of core: its dotted name (a package's is its own, a module's its package's and its own)."""
    found = []
    for path in sorted(CORE.rglob("*.py")):
        name = ".".join(path.relative_to(CORE.parent).with_suffix("").parts)
        found.append((name, ast.parse(path.read_text(), str(path))))
    return found


def own(module: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The vlenvoys modules ``node`` imports, absolute; ``module`` is where it stands (a package: ``pkg.__init__``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] == "vlenvoys"]
    if node.level == 0:
        return [node.module] if (node.module or "").split(".")[0] == "vlenvoys" else []
    package = module.split(".")[:-1]  # a relative import counts from the module's package
    base = package[: len(package) - (node.level - 1)]
    return [".".join([*base, *([node.module] if node.module else [])])]


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_core_imports_its_own_modules_at_the_top_only():
    """A function-level import of core's own modules hid circles and upward imports; optional packages stay lazy."""
    late = []
    for name, tree in modules():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if isinstance(inner, (ast.Import, ast.ImportFrom)) and own(name, inner):
                        late.append(f"{name}:{inner.lineno} {ast.unparse(inner)}")
    assert not late, late


def test_no_private_name_is_imported_across_modules():
    crossing = []
    for name, tree in modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and own(name, node):
                crossing += [f"{name}:{node.lineno} {alias.name}" for alias in node.names if private(alias.name)]
    assert not crossing, crossing


def test_the_runtime_lists_its_value_names_once():
    """`VALUES` is the runtime's (`vlenvoys.values.names`), not the test oracle's."""
    from vlenvoys.values.names import OWNERS, VALUES

    defining = [
        name for name, tree in modules() for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(target, "id", None) == "VALUES" for target in node.targets)
    ]
    assert defining == ["vlenvoys.values.names"]
    assert list(OWNERS) == [value for _, value in VALUES]


def test_the_readmes_modules_are_reachable_after_import_vlenvoys():
    """``import vlenvoys; vlenvoys.activations.collect_dataset(...)`` (#49), in a fresh process, and no optional package
    (datasets, matplotlib, pandas) is imported by it."""
    program = (
        "import sys, vlenvoys; "
        "print(vlenvoys.activations.collect_dataset.__module__, vlenvoys.capturing.fetch.__module__); "
        "print(sorted(name for name in ('datasets', 'matplotlib', 'pandas', 'pyarrow') if name in sys.modules))"
    )
    ran = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-4000:]
    assert ran.stdout.splitlines()[-2:] == ["vlenvoys.collect.activations vlenvoys.serve.client", "[]"]
