"""What the benchmarks share: the prompts, the timer, and the commit and card a result names.

Plain Python, with neither torch nor vlenvoys: bench_nnterp.py runs in the
nnterp environment (nnsight 0.7), which cannot import vlenvoys, and loads
this file by its path; bench.py imports it from its own folder.
"""

from __future__ import annotations

import random
import re
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven tired sailors sing about distant islands "
    "and golden rivers under a pale morning sky full of quiet birds and old stories"
).split()


def prompts(count: int, low: int = 8, high: int = 40, seed: int = 0) -> list[str]:
    """``count`` prompts of ``low``..``high`` words, the same for the same arguments on every machine."""
    draw = random.Random(seed)
    lengths = [draw.randint(low, high) for _ in range(count)]
    starts = [draw.randrange(len(WORDS)) for _ in range(count)]
    return [
        " ".join(WORDS[(start + i) % len(WORDS)] for i in range(length))
        for start, length in zip(starts, lengths, strict=True)
    ]


def median_time(run: Callable[[], object], repeats: int) -> float:
    """Median wall-clock seconds of ``repeats`` calls of ``run``, after one warm-up call."""
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def checkout(code: tuple[str, ...] = ("packages", "benchmarks")) -> str:
    """HEAD's short hash, with ``+changes`` where ``code`` (paths in the repo) differs from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()

    commit = git("rev-parse", "--short=7", "HEAD") or "unknown"
    return commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no", "--", *code) else "")


def card_name() -> str:
    """The GPU's short name (``h100``, ``h200``), or ``cpu``: the gate's floors table and results' file names."""
    import torch  # not at the top: bench_nnterp.py loads this file where torch may differ

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    found = re.search(r"\b([a-z]{1,2}\d{2,4}[a-z]?)\b", name)
    return found.group(1) if found else re.sub(r"[^a-z0-9]+", "-", name).strip("-")
