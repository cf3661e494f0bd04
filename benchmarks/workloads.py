"""What benchmarks/bench.py and compat/bench_nnterp.py both run: the prompts and the timer.

Plain Python, with neither torch nor vlenvoys: bench_nnterp.py runs in the
nnterp environment (nnsight 0.7), which cannot import vlenvoys, and loads
this file by its path; bench.py imports it from its own folder.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

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
