"""The steering kernel (`vlenvoys.worker.kernels`) against the torch operations it replaces, bit for bit.

On a CUDA device the compiled kernel runs here. Elsewhere Triton's
interpreter runs the same kernel on the CPU, in a process of its own (it
must be chosen before Triton is first imported): float32 and float16 only,
since the interpreter rounds to bfloat16 by cutting bits where the GPU
rounds to nearest, so bfloat16 is checked on the GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view({4: torch.int32, 2: torch.int16}[tensor.element_size()])


def compare(device: str, dtype: torch.dtype, halves: bool) -> None:
    """Steered rows equal torch's, unsteered rows are untouched, refusals are counted alike (AssertionError if not)."""
    from vlenvoys.worker import kernels

    draw = torch.Generator().manual_seed(1)
    rows, width, slots, blocks = 11, 96, 6, 3
    hidden = (3 * torch.randn(rows, width, generator=draw)).to(dtype)
    residual = (3 * torch.randn(rows, width, generator=draw)).to(dtype).to(device) if halves else None
    table = torch.randn(slots, width, generator=draw).to(dtype)
    table[0] = 0
    # Slot 5 overflows the rows it steers: refused and left as they were.
    table[5] = 0.75 * torch.finfo(dtype).max
    hidden[5:7] = 0.75 * torch.finfo(dtype).max
    table = table.to(device)
    index = torch.randint(0, slots, (rows + 4, blocks), generator=draw)  # taller than the step, as in a graph
    index[:, 1] = torch.tensor([0, 1, 2, 3, 4, 5, 5, 0, 1, 0, 3, 0, 0, 0, 0])
    index, hidden = index.to(device), hidden.to(device)
    counted = 0.0
    for layer in range(blocks):
        want_refused = torch.zeros(slots, device=device)
        want = kernels.steer_rows_reference(hidden, residual, table, index, want_refused, layer)
        got, got_refused = hidden.clone(), torch.zeros(slots, device=device)
        assert kernels.fits(got, residual)
        kernels.steer_rows(got, residual, table, index, got_refused, layer)
        steered = index[:rows, layer] != 0
        assert torch.equal(bits(got[steered]), bits(want[steered])), f"block {layer}: a steered row differs from torch's"
        assert torch.equal(got, want), f"block {layer}"  # unsteered: torch adds +0.0 (turning -0.0 into 0.0)
        assert torch.equal(bits(got[~steered]), bits(hidden[~steered])), f"block {layer}: an unsteered row was written"
        assert torch.equal(got_refused[1:], want_refused[1:]), f"block {layer}: {got_refused} != {want_refused}"
        counted += float(got_refused[5])
    assert counted > 0, "the overflowing slot's rows must be counted"


def test_steered_rows_equal_torchs_and_the_others_are_untouched():
    if CUDA:
        for dtype in DTYPES.values():
            for halves in (True, False):
                compare("cuda", dtype, halves)
        return
    # One process for every case: Triton's interpreter must be chosen before Triton is imported.
    run = subprocess.run(
        [sys.executable, __file__], env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_only_rows_of_contiguous_columns_fit():
    from vlenvoys.worker import kernels

    device = "cuda" if CUDA else "cpu"
    stream = torch.zeros(4, 8, device=device)
    assert kernels.fits(stream, None) == CUDA  # without the interpreter, a CPU tensor keeps torch's path
    assert not kernels.fits(stream.t(), None)
    assert not kernels.fits(stream, torch.zeros(4, 8, dtype=torch.float16, device=device))


if __name__ == "__main__":  # the interpreter's run (see the module's docstring); bfloat16 is the GPU's to check
    for dtype in (torch.float32, torch.float16):
        for halves in (True, False):
            compare("cpu", dtype, halves)
