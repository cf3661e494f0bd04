"""`vlenvoys.wire.steering`: a request's steering checked once, written in one format, read back by the worker."""

from __future__ import annotations

import base64
import json

import pytest
import torch
from vlenvoys import NoSuchBlock, Steering
from vlenvoys.wire.steering import Entry, Overlap, entry, read, salt_of, text

HIDDEN, LAYERS = 8, 4


def checked(layers=1, vector=None, factor=1.0, positions=None, dtype=torch.float32) -> Entry:
    vector = torch.ones(HIDDEN) if vector is None else vector
    return entry(layers, vector, factor, positions, hidden_size=HIDDEN, num_layers=LAYERS, dtype=dtype)


def test_the_worker_reads_back_what_the_client_wrote():
    vector = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(0))
    made = [
        checked([-1, 0], vector, 2.0, slice(3, None)),
        checked(1, vector, 0.5, [4, 2, 4]),
        checked(2, positions="generated"),
    ]
    spec = text(made)
    (first, second, third) = read(spec, HIDDEN, LAYERS)
    assert first[0] == [0, 3] and first[2] == {"start": 3, "stop": None}
    assert torch.equal(first[1], 2.0 * vector) and second[2] == [2, 4] and third[2] == "generated"
    assert salt_of(spec) == salt_of(text(made)) != salt_of(text(made[:1]))
    # `vlenvoys.Steering` writes the same text for the same steering.
    assert Steering([0, -1], vector, 2.0, slice(3, None)).encode_for(HIDDEN, LAYERS, torch.float32) == text(made[:1])


def test_entries_alike_share_one_spec_and_may_not_overlap():
    spec = json.loads(text([checked(0), checked(2), checked(1, factor=2.0)]))
    assert [each["layers"] for each in spec] == [[0, 2], [1]]
    assert base64.b64decode(spec[1]["vector"]) == (2.0 * torch.ones(HIDDEN)).numpy().tobytes()
    with pytest.raises(Overlap) as raised:
        text([checked([0, 1]), checked(1, factor=3.0)])
    assert (raised.value.number, raised.value.block) == (1, 1)


def test_the_scaled_vector_is_bounded_in_the_model_dtype():
    with pytest.raises(ValueError, match="non-finite"):
        checked(factor=1e39)
    with pytest.raises(ValueError, match="the next norm would overflow"):
        checked(factor=1e30, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="has a norm beyond"):
        checked(factor=1e19)
    with pytest.raises(ValueError, match="expected a finite number"):
        checked(factor=float("nan"))
    with pytest.raises(TypeError, match="expected a finite number"):
        checked(factor=True)
    with pytest.raises(ValueError, match=r"expected shape \[8\]"):
        checked(vector=torch.ones(HIDDEN + 1))
    with pytest.raises(ValueError, match=r"or \[1, 8\], got \[2, 8\]"):
        checked(vector=torch.ones(2, HIDDEN))
    with pytest.raises(TypeError, match="expected a real tensor"):
        checked(vector=torch.ones(HIDDEN, dtype=torch.complex64))
    with pytest.raises(TypeError, match="expected a real tensor"):
        checked(vector=[1.0] * HIDDEN)
    # What nnterp's steer adds, a [1, hidden] row or integers, is the [hidden] float vector's steering.
    assert checked(vector=torch.ones(1, HIDDEN, dtype=torch.int64)) == checked()
    with pytest.raises(NoSuchBlock):
        checked(layers=LAYERS)
    with pytest.raises(ValueError, match="non-negative"):
        checked(positions=[-1])


ZEROS = base64.b64encode(bytes(4 * HIDDEN)).decode()


@pytest.mark.parametrize("spec, reason", [
    ({"layers": [7], "vector": ZEROS, "positions": None}, "the model has blocks 0 to 3"),
    ({"layers": [0], "vector": base64.b64encode(bytes(4 * 3)).decode(), "positions": None}, r"a vector of shape \[3\]"),
    ({"layers": [0], "vector": base64.b64encode(torch.full((HIDDEN,), float("inf")).numpy().tobytes()).decode(),
      "positions": None}, "not finite"),
    ({"layers": [0], "vector": [1.0] * HIDDEN, "positions": None}, "argument should be"),  # a list: no format of ours
    ([], "disjoint blocks"),
])
def test_the_worker_refuses_what_no_client_wrote(spec, reason):
    with pytest.raises((ValueError, TypeError), match=reason):
        read(json.dumps(spec), HIDDEN, LAYERS)
