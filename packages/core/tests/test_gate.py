"""The speed gate's bookkeeping (benchmarks/gate.py), and that README and the docs show its latest result."""

from __future__ import annotations

import ast
import json
import subprocess
from pathlib import Path

import pytest
from vlenvoys_testing import script

ROOT = Path(__file__).resolve().parents[3]


gate = script(ROOT / "benchmarks" / "gate.py")


def test_a_rows_ratio_is_the_median_of_its_rounds_ratios_against_the_baseline_runs_beside_it():
    # The baseline runs beside ours take 1 s on average every round; ours 2, 1 and 4 s: ratios 0.5, 1 and 0.25.
    seconds = {"plain.prefill": [0.5, 1.5, 1.0, 1.0, 1.0, 1.0], "vl.collect": [2.0, 1.0, 4.0]}
    beside = {"vl.collect": [1.0, 1.0, 1.0]}
    amounts = {"plain.prefill": 100, "vl.collect": 100}
    units = {"plain.prefill": "prompts/s", "vl.collect": "prompts/s"}
    (name, row), = gate.summarize(seconds, beside, amounts, units, ["collect", "trace3"]).items()
    assert name == "collect"  # trace3 was not measured: no row
    assert row["ratio"] == 0.5 and row["spread"] == 0.75 and row["rounds"] == [0.5, 1.0, 0.25]
    assert row["ours"] == 50.0 and row["baseline"] == 100.0 and row["unit"] == "prompts/s"


def test_every_row_runs_between_two_runs_of_its_baseline():
    runs = [("prefill", "plain.prefill"), ("prefill", "vl.collect"), ("prefill", "vl.trace3"),
            ("serve", "serve.plain"), ("serve", "serve.capture")]
    order = [key for _, key in gate.round_order(runs, {"plain.prefill", "serve.plain"})]
    assert order == ["plain.prefill", "vl.collect", "plain.prefill", "vl.trace3", "plain.prefill",
                     "serve.plain", "serve.capture", "serve.plain"]


def test_rows_under_their_floors_are_named():
    measured = {"collect": {"ratio": 0.9}, "trace3": {"ratio": 0.35}, "serve_capture": {"ratio": 0.2}}
    rows, under = gate.judged(measured, {"collect": 0.95, "trace3": 0.3})
    assert under == ["collect"]
    assert rows["collect"]["floor"] == 0.95 and not rows["collect"]["passed"]
    assert rows["trace3"]["passed"] and rows["serve_capture"]["floor"] is None and rows["serve_capture"]["passed"]


def test_a_card_without_floors_takes_the_default_table(tmp_path):
    floors = tmp_path / "floors.toml"
    floors.write_text("[default]\ncollect = 0.5\n[h100]\ncollect = 0.9\n")
    assert gate.floors_for("h100", floors) == ({"collect": 0.9}, "h100")
    assert gate.floors_for("b200", floors) == ({"collect": 0.5}, "default")


def test_floors_name_only_the_gates_rows():
    import tomllib

    for card, floors in tomllib.loads(gate.FLOORS.read_text()).items():
        unknown = set(floors) - set(gate.ROWS)
        assert not unknown, f"[{card}] names rows the gate does not have: {sorted(unknown)}"
        assert all(0 < value for value in floors.values())


def gate_results() -> list[Path]:
    return [path for path in gate.RESULTS.glob("gate-*.json") if not json.loads(path.read_text()).get("smoke")]


def test_every_gate_result_has_the_promised_keys():
    results = gate_results()
    assert results, "no gate result in benchmarks/results: every change to runtime code commits one"
    for path in results:
        result = json.loads(path.read_text())
        assert {"commit", "card", "vllm", "rows", "passed"} <= set(result), path.name
        # gate-<commit>-<card>.json; a second run of the same commit on the same card is kept beside it with a suffix
        assert path.name.startswith(f"gate-{result['commit'].replace('+', '-')}-{result['card']}"), path.name
        for name, row in result["rows"].items():
            assert name in gate.ROWS and {"ours", "baseline", "ratio", "spread", "floor"} <= set(row), (path.name, name)
        assert result["passed"] == all(row["floor"] is None or row["ratio"] >= row["floor"] for row in result["rows"].values())


def test_readme_and_docs_show_the_latest_gate():
    latest = gate.latest()
    for page in gate.SPEED_PAGES:
        text = page.read_text()
        assert gate.BEGIN in text and gate.END in text, f"{page.name} has no speed table"
        shown = text.split(gate.BEGIN, 1)[1].split(gate.END, 1)[0].strip()
        if latest is None:
            assert shown == "", f"{page.name} shows figures no gate result holds"
            continue
        expected = gate.render(json.loads(latest.read_text()), latest.relative_to(ROOT).as_posix())
        assert shown == expected, f"{page.name} does not show {latest.name}: run benchmarks/gate.py --report {latest}"


def code_of(source: str) -> str:
    """A module's code without its docstrings and comments (``ast.dump``, no line numbers): what the engine runs."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body and (
            isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def test_code_of_leaves_out_docstrings_and_comments_only():
    plain = "def f(x):\n    return x + 1\n"
    assert code_of('"""A module."""\n' + plain.replace("    return", '    """Adds one."""\n    # why\n    return')) == code_of(plain)
    assert code_of(plain.replace("+ 1", "+ 2")) != code_of(plain)
    assert code_of(plain.replace("return x + 1", 'return "a string"')) != code_of(plain)


def test_the_latest_gate_measured_the_runtime_code_of_this_checkout():
    """Every change to runtime code under packages/*/src runs the gate at its last commit and commits the result (#45
    item 3). vlenvoys-testing (packages/testing) is test support, which no engine runs; a change to a module's
    docstrings or comments alone runs nothing different (`code_of`)."""
    latest = gate.latest()
    assert latest is not None, "no gate result in benchmarks/results: every change to runtime code commits one"
    commit = json.loads(latest.read_text())["commit"]
    assert "+" not in commit, f"{latest.name} measured uncommitted code"

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)

    try:
        changed = git("diff", "--name-only", commit, "HEAD", "--", ":(glob)packages/*/src/**", ":(exclude)packages/testing/**")
    except (OSError, subprocess.TimeoutExpired):
        pytest.skip("no git here")
    if changed.returncode != 0:
        pytest.skip(f"this checkout cannot compare with {commit}: {changed.stderr.strip()[:200]}")
    code_changed = []
    for path in changed.stdout.split():
        before, after = git("show", f"{commit}:{path}"), git("show", f"HEAD:{path}")
        if not path.endswith(".py") or before.returncode or after.returncode or code_of(before.stdout) != code_of(after.stdout):
            code_changed.append(path)
    assert not code_changed, (
        f"runtime code changed since the latest gate ({latest.name}, at {commit}): run benchmarks/gate.py on a GPU "
        f"at this commit and commit its result: {', '.join(code_changed)}"
    )


def test_report_takes_only_a_judged_gpu_result(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"before\n{gate.BEGIN}\n{gate.END}\nafter\n")
    result = {"commit": "abc1234", "card": "cpu", "device": "CPU", "vllm": "0.32.0", "rounds": 1, "rows": {}, "smoke": True,
              "passed": True, "under_floor": []}
    smoke = tmp_path / "gate-abc1234-cpu-smoke.json"
    smoke.write_text(json.dumps(result))
    with pytest.raises(SystemExit, match="smoke run"):
        gate.report(smoke, pages=[page])
    unjudged = tmp_path / "gate-abc1234-h200.json"
    unjudged.write_text(json.dumps({key: value for key, value in result.items() if key not in ("smoke", "passed")}))
    with pytest.raises(SystemExit, match="--judge"):
        gate.report(unjudged, pages=[page])
    broken = tmp_path / "broken.json"
    broken.write_text('{"commit": "abc"}')
    with pytest.raises(SystemExit, match="lacks card, device, rounds, rows, vllm"):
        gate.report(broken, pages=[page])
    assert page.read_text() == f"before\n{gate.BEGIN}\n{gate.END}\nafter\n"
    judged = tmp_path / "judged.json"
    judged.write_text(json.dumps({**{key: value for key, value in result.items() if key != "smoke"}, "card": "h200"}))
    gate.report(judged, pages=[page])  # outside the repository: shown by its own path
    assert str(judged) in page.read_text() and page.read_text().endswith(f"{gate.END}\nafter\n")


def test_the_table_names_the_model_runner_each_side_ran():
    row = {"ours": 2.0, "baseline": 2.0, "unit": "prompts/s", "ratio": 1.0, "spread": 0.0, "floor": None, "what": "w"}
    result = {"commit": "c", "device": "d", "vllm": "0.32.0", "rounds": 1, "passed": True, "rows": {"collect": row}}
    # Gates that name no runners asked vLLM for V1 on both sides.
    assert "its V1 model runner, asked for), vlenvoys on its V1" in gate.render(result, "f.json")
    shown = gate.render(result | {"runners": {"plain": "V2", "vl": "V1", "vg": "V1"}}, "f.json")
    assert "its V2 model runner), vlenvoys on its V1 model runner" in shown
