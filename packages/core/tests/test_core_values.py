"""The value machinery on real tensors: layouts, write checks, the fused stream sum."""

from __future__ import annotations

import pytest
import torch

from vlenvoys import InvalidWrite, argument, batched, unbatched, with_argument
from vlenvoys.values.layouts import _Summed, _SummedOutput, edited, served_shape


def test_argument_reads_positional_and_keyword():
    hidden = torch.ones(3, 4)
    assert argument(((None, hidden), {}), (1, "hidden_states")) is hidden
    assert argument(((None,), {"hidden_states": hidden}), (1, "hidden_states")) is hidden
    assert argument(((None,), {}), (1, "hidden_states")) is None


def test_with_argument_replaces_where_passed():
    old, new = torch.zeros(2), torch.ones(2)
    args, kwargs = with_argument(((1, old, 3), {}), (1, "x"), new)
    assert args[1] is new and args[0] == 1 and args[2] == 3
    args, kwargs = with_argument(((1,), {"x": old}), (1, "x"), new)
    assert kwargs["x"] is new and args == (1,)
    with pytest.raises(KeyError, match="'x'"):
        with_argument(((1,), {}), (1, "x"), new)


def test_batched_is_a_private_copy_with_a_batch_axis():
    rows = torch.arange(12.0).reshape(3, 4)
    served = batched(rows)
    assert served.shape == (1, 3, 4)
    rows.zero_()  # the model's next kernel rewrites its buffer
    assert served.sum() == sum(range(12))


def test_an_in_place_edit_of_a_served_copy_is_seen_under_inference_mode():
    # vLLM runs under inference mode, whose tensors keep no version counter;
    # the served copy keeps one, so the write-back need not compare.
    with torch.inference_mode():
        rows = torch.randn(3, 8)
        served, kept = batched(rows, head_dim=4), batched(rows)
        summed = batched(rows + 1, fresh=True)
        served[:, -1, 0] += 1.0  # the user's in-place edit, inside the block
        assert edited(served) and not edited(kept) and not edited(summed)
        assert not hasattr(kept, "_vlenvoys_version")  # the mark does not travel with a saved value
        assert edited(torch.zeros(2))  # a tensor never served counts as edited: it is handed back as written


def test_batched_splits_heads():
    rows = torch.arange(3 * 8.0).reshape(3, 8)
    served = batched(rows, head_dim=4)
    assert served.shape == (1, 3, 2, 4) == served_shape(rows, 4)
    assert torch.equal(served[0, 1, 1], rows[1, 4:])
    assert torch.equal(unbatched(served, rows, "heads", head_dim=4), rows)


@pytest.mark.parametrize(
    "value, message",
    [
        (torch.zeros(1, 4, 8), r"expected shape \[1, 3, 8\].*3 tokens.*got \[1, 4, 8\]"),
        (torch.zeros(3, 8), r"expected shape \[1, 3, 8\].*got \[3, 8\]"),
        (torch.zeros(1, 3, 7), r"expected shape \[1, 3, 8\].*got \[1, 3, 7\]"),
        (torch.zeros(1, 3, 8, dtype=torch.float64), "expected dtype torch.float32, got torch.float64"),
        ([0.0] * 24, "expected a tensor"),
    ],
)
def test_unbatched_refuses_what_the_model_cannot_take(value, message):
    with pytest.raises(InvalidWrite, match=message):
        unbatched(value, torch.zeros(3, 8), "layer_output")


def test_summed_reads_the_sum_and_writes_a_change_to_the_hidden_half():
    value = _Summed("input", hidden=(0, "x"), residual=(1, "residual"))(lambda self, v: v)
    hidden, residual = torch.randn(3, 8), torch.randn(3, 8)
    raw = ((hidden, residual), {})
    stream = value.pick(None, raw)
    assert torch.equal(stream, hidden + residual)
    edited = stream + 1
    (new_hidden, same_residual), _ = value.place(None, raw, edited, stream)
    assert same_residual is residual
    assert torch.allclose(new_hidden + residual, edited, atol=1e-6)


def test_summed_without_residual_is_the_stream_alone():
    value = _Summed("input", hidden=(1, "hidden_states"), residual=(2, "residual"))(lambda self, v: v)
    hidden = torch.randn(3, 8)
    raw = ((torch.arange(3), hidden, None), {})
    assert value.pick(None, raw) is hidden
    replaced = torch.zeros(3, 8)
    (_, new_hidden, residual), _ = value.place(None, raw, replaced, hidden)
    assert new_hidden is replaced and residual is None


def test_unedited_write_back_hands_back_exactly_what_the_model_had():
    value = _SummedOutput("output")(lambda self, v: v)
    raw = (torch.randn(3, 8), torch.randn(3, 8))
    view = value._read(None, raw)
    assert value._write_back(None, view, raw) is raw
    view[:, 0] += 1
    written = value._write_back(None, view, raw)
    assert written is not raw
    assert torch.allclose(written[0] + written[1], view[0], atol=1e-6)
    assert written[1] is raw[1]
