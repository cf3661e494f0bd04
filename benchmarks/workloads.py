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
    """``count`` prompts of ``low``..``high`` words, deterministic.

    The lengths and start words are the draws of ``torch.randint(low, high + 1, (count,))``
    then ``torch.randint(0, len(WORDS), (count,))`` on ``torch.Generator().manual_seed(seed)``,
    as the benchmarks drew them with torch, made here without it (see `torch_draws`).
    """
    draw = torch_draws(seed)
    lengths = [low + draw() % (high + 1 - low) for _ in range(count)]
    starts = [draw() % len(WORDS) for _ in range(count)]
    return [
        " ".join(WORDS[(start + i) % len(WORDS)] for i in range(length))
        for start, length in zip(starts, lengths, strict=True)
    ]


def torch_draws(seed: int) -> Callable[[], int]:
    """The 32-bit draws of ``torch.Generator().manual_seed(seed)`` on the CPU, one per call.

    torch's CPU generator is an MT19937 seeded with the seed's low 32 bits,
    and its ``randint`` over a range below 2**32 takes one draw per element,
    ``low + draw % range``. Python's `random` is the same MT19937 seeded
    another way, so its state is set here as torch seeds it (init_genrand).
    """
    state = [seed & 0xFFFFFFFF]
    for i in range(1, 624):
        state.append((1812433253 * (state[-1] ^ (state[-1] >> 30)) + i) & 0xFFFFFFFF)
    generator = random.Random()
    generator.setstate((3, (*state, 624), None))
    return lambda: generator.getrandbits(32)


def median_time(run: Callable[[], object], repeats: int) -> float:
    """Median wall-clock seconds of ``repeats`` calls of ``run``, after one warm-up call."""
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
