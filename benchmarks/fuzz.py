"""The fuzz tests of packages/family-llama/tests/test_llama_fuzz.py with many examples, and a summary of outcomes.

CI runs each fuzz test with a few dozen fixed examples; this runs the same tests with many more (default 500
each) on the CPU engine, drawn from a seed (a new one each run unless given), and prints what every fuzzed block
and request came to: how many ran clean, how many were refused with which error, and the slowest.

    python benchmarks/fuzz.py                    # 500 examples a test, a random seed
    python benchmarks/fuzz.py --examples 2000 --seed 7 -k serve

Needs the llama family's test environment (``nox -s "family(family='llama')"`` builds one; ``pip install
packages/core[cpu,test] packages/family-llama`` does too). Exits with pytest's status: a failing example is
printed by hypothesis with its seed and blob, to rerun it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import random
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTS = ROOT / "packages" / "family-llama" / "tests" / "test_llama_fuzz.py"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=500, help="examples per fuzz test (CI: a few dozen)")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis' seed (default: a random one, printed)")
    parser.add_argument("-k", default=None, help="pytest -k expression: 'trace' or 'serve' for one of the two tests")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    with tempfile.TemporaryDirectory() as folder:
        log = pathlib.Path(folder) / "fuzz.jsonl"
        env = {**os.environ, "VLENVOYS_FUZZ_EXAMPLES": str(args.examples), "VLENVOYS_FUZZ_SEED": str(seed),
               "VLENVOYS_FUZZ_LOG": str(log), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        command = [sys.executable, "-m", "pytest", str(TESTS), "-q", "-p", "no:cacheprovider", "--show-capture=no",
                   *(["-k", args.k] if args.k else []), *args.pytest_args]
        print(f"seed {seed}, {args.examples} examples a test: {' '.join(command)}", flush=True)
        started = time.monotonic()
        status = subprocess.call(command, env=env, cwd=ROOT)
        elapsed = time.monotonic() - started
        rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    summarize(rows, elapsed, seed, status)
    return status


def summarize(rows: list[dict], elapsed: float, seed: int, status: int) -> None:
    print(f"\n{len(rows)} examples in {elapsed:.0f} s (seed {seed}; pytest exit {status})")
    for test in sorted({row["test"] for row in rows}):
        mine = [row for row in rows if row["test"] == test]
        outcomes = collections.Counter(row["outcome"] for row in mine)
        seconds = sorted(row["seconds"] for row in mine)
        print(f"\n{test}: {len(mine)} examples, median {seconds[len(seconds) // 2]:.2f} s, slowest {seconds[-1]:.2f} s")
        for outcome, count in outcomes.most_common():
            print(f"  {count:6d}  {outcome}")
        refusals = collections.Counter((row["outcome"], row["detail"][:110]) for row in mine
                                       if row["outcome"] not in ("ok", "200"))
        if refusals:
            print("  the most frequent refusals:")
            for (outcome, detail), count in refusals.most_common(12):
                print(f"  {count:6d}  {outcome}: {detail}")


if __name__ == "__main__":
    sys.exit(main())
