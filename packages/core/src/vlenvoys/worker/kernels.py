"""One fused kernel for the steering hooks of `vlenvoys.worker.steerer` on CUDA devices.

The steering hook of a block computes, for the step's token rows, the stream
(``hidden + residual`` where vLLM splits it), adds each row's vector, leaves a
row whose sum is not finite as it was (and counts it), and writes the result
back as a trace's write of ``layer_output`` does. In torch that is about ten
kernels per block, run at every step and on every block of a graph engine,
steered or not. Here it is one kernel per block, whose unsteered rows (slot 0)
return before they read anything, so a step that steers nothing costs one
empty launch per block.

The arithmetic is torch's, operation by operation: each sum is formed in
float32 and rounded to the stream's dtype, as torch's elementwise kernels do
for half precision (and exactly, for float32), so the values equal the torch
path's and a trace's bit for bit (`vlenvoys.worker.steerer.Steerer._hook` keeps the
torch path for every other device, and the tests compare the two).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["steer_rows", "steer_rows_reference"]


_KERNELS: dict[bool, Any] = {}


def _kernel() -> Any:
    """The Triton kernel, compiled on first use (Triton is imported only where a CUDA engine steers)."""
    import triton
    import triton.language as tl
    from triton import knobs

    interpreted = bool(knobs.runtime.interpret)  # TRITON_INTERPRET=1: the tests run it on the CPU
    if interpreted in _KERNELS:
        return _KERNELS[interpreted]

    def steer(hidden, residual, table, index, refused, layer, blocks, rows_stride, residual_stride, width,
              HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):  # noqa: N803 (Triton's constexpr style)
        row = tl.program_id(0)
        slot = tl.load(index + row * blocks + layer)
        if slot != 0:
            columns = tl.arange(0, BLOCK)
            inside = columns < width
            stream = hidden + row * rows_stride + columns
            own = tl.load(stream, mask=inside, other=0.0)
            vector = tl.load(table + slot * width + columns, mask=inside, other=0.0)
            if HAS_RESIDUAL:
                half = tl.load(residual + row * residual_stride + columns, mask=inside, other=0.0)
                current = (own.to(tl.float32) + half.to(tl.float32)).to(own.dtype)
            else:
                current = own
            added = (current.to(tl.float32) + vector.to(tl.float32)).to(own.dtype)
            wide = added.to(tl.float32)
            bad = ((wide - wide) != 0) & inside  # NaN and the infinities alone give a non-zero x - x (NaN)
            if tl.sum(bad.to(tl.int32), axis=0) == 0:
                if HAS_RESIDUAL:
                    # The edit rides on the hidden half: hidden + (added - current), as `place` writes it.
                    change = (wide - current.to(tl.float32)).to(own.dtype)
                    written = (own.to(tl.float32) + change.to(tl.float32)).to(own.dtype)
                else:
                    written = added
                tl.store(stream, written, mask=inside)
            else:
                tl.atomic_add(refused + slot, 1.0)

    _KERNELS[interpreted] = triton.jit(steer)
    return _KERNELS[interpreted]


def fits(stream: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether `steer_rows` serves these tensors: CUDA (or Triton's interpreter), rows of contiguous columns."""
    if stream.dim() != 2 or stream.stride(-1) != 1:
        return False
    if residual is not None and (residual.shape != stream.shape or residual.stride(-1) != 1 or residual.dtype != stream.dtype):
        return False
    if stream.device.type != "cuda":
        from triton import knobs

        return bool(knobs.runtime.interpret)
    return True


def steer_rows(
    stream: torch.Tensor,
    residual: torch.Tensor | None,
    table: torch.Tensor,
    index: torch.Tensor,
    refused: torch.Tensor,
    layer: int,
) -> None:
    """Steer a block's token rows in place: one launch, unsteered rows untouched.

    Args:
        stream: ``[rows, width]``, the block's output tensor that the next
            call reads: the ``hidden_states`` half where ``residual`` is given,
            else the whole stream. Written in place, steered rows only.
        residual: ``[rows, width]`` or None: the other half (read only).
        table: ``[slots, width]`` in the stream's dtype: each slot's
            ``factor * vector`` (slot 0 is zeros and never read).
        index: ``[at least rows, blocks]`` int64: the slot each row gets at
            each block (0: none).
        refused: ``[slots]`` float32: counts, per slot, the rows whose steered
            stream was not finite (those rows are left as they were).
        layer: The block, a column of ``index``.
    """
    rows, width = stream.shape
    if rows == 0:
        return
    import triton

    _kernel()[(rows,)](
        stream, residual if residual is not None else stream, table, index, refused, layer, index.shape[1],
        stream.stride(0), (residual if residual is not None else stream).stride(0), width,
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(width),
    )


def steer_rows_reference(
    stream: torch.Tensor,
    residual: torch.Tensor | None,
    table: torch.Tensor,
    index: torch.Tensor,
    refused: torch.Tensor,
    layer: int,
) -> torch.Tensor:
    """What `steer_rows` computes, in torch ops: the new ``stream`` (returned, not written in place)."""
    current = stream if residual is None else stream + residual
    rows = index[: stream.shape[0], layer]
    added = current + table.index_select(0, rows)
    finite = torch.isfinite(added).all(-1)
    refused.index_add_(0, rows, (~finite).to(refused.dtype))
    added = torch.where(finite[:, None], added, current)
    return added if residual is None else stream + (added - current)
