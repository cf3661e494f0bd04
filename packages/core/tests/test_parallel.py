"""The head gather/split rules of `vlenvoys.values.parallel` on real tensors (the two-rank engines run in the family tests)."""

import pytest
import torch

from vlenvoys.values.parallel import gather_heads, gather_vocab, split_heads, tensor_parallel


@pytest.mark.parametrize(("ranks", "heads", "replicas"), [(2, 4, 1), (4, 8, 1), (2, 1, 2), (4, 2, 2), (4, 1, 4)])
def test_split_then_gather_is_the_whole_in_head_order(ranks, heads, replicas):
    head_dim, tokens = 3, 5
    whole = torch.randn(tokens, heads * head_dim)
    pieces = [split_heads(whole, rank, ranks, replicas) for rank in range(ranks)]
    # Rank r holds heads r * H/tp ..., or with replicas, head r // replicas.
    per_rank = max(1, heads * replicas // ranks)
    for rank, piece in enumerate(pieces):
        first = (rank // replicas) * per_rank
        assert torch.equal(piece, whole[:, first * head_dim : (first + per_rank) * head_dim])
        assert piece.is_contiguous()
    assert torch.equal(gather_heads(pieces, replicas), whole)


def test_one_rank_outside_an_engine():
    assert tensor_parallel() == (0, 1)
    logits = torch.randn(2, 7)
    assert torch.equal(gather_vocab(logits, 5), logits[:, :5])
