"""`block_index`: the one check of a block index (``model.layers[i]``, ``steer``, ``collect``, the CLI)."""

from __future__ import annotations

import pytest

import vlenvoys
from vlenvoys.values.envoys import block_index


def test_negative_indices_count_from_the_end():
    assert [block_index(layer, 3) for layer in (0, 2, -1, -3)] == [0, 2, 2, 0]


@pytest.mark.parametrize(
    ("layer", "error", "message"),
    [
        (3, vlenvoys.NoSuchBlock, "^block 3 does not exist: the model has blocks 0 to 2$"),
        (-4, IndexError, "^block -4 does not exist: the model has blocks 0 to 2$"),
        (True, TypeError, "^block True is a bool; a block is an int$"),
        ("1", TypeError, "^block '1' is a str; a block is an int$"),
        (1.0, TypeError, "^block 1.0 is a float; a block is an int$"),
    ],
)
def test_a_missing_or_non_int_block_is_refused(layer, error, message):
    with pytest.raises(error, match=message):
        block_index(layer, 3)


def test_a_missing_block_is_an_index_error_and_a_value_error_under_the_callers_name():
    for caught in (IndexError, ValueError, vlenvoys.NoSuchBlock):
        with pytest.raises(caught, match="^layer 5 does not exist: the model has blocks 0 to 2$"):
            block_index(5, 3, noun="layer")
