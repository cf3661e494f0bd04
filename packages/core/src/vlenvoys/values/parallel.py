"""Tensor parallelism: the attention kernel's heads made whole on every rank.

Under ``tensor_parallel_size > 1`` each rank holds a slice of the heads and of
the MLP's neurons. nnsight gathers the values of vLLM's parallel linear layers
(a column-parallel output, a row-parallel input such as the down projection's,
which is ``mlp_neurons``), and a row-parallel output is already reduced. It
does not know vLLM's attention layer, whose queries, keys, values and head
outputs are each this rank's heads: `KernelFragments` adds that rule, so the
values read there are every head, in the model's head order, and an edit is
cut back to each rank's heads before the kernel runs.

Rank ``r`` holds query heads ``r * H/tp .. (r+1) * H/tp - 1`` and the key/value
heads of the same group. Where the model has fewer key/value heads than ranks,
vLLM gives ``tp / kv_heads`` consecutive ranks the same key/value head: the
gather keeps one copy of each.

Every rank runs the user's block and must reach the same collectives in the
same order; nothing here branches on the rank except which slice is cut.
"""

from __future__ import annotations

from typing import Any

import torch
from nnsight.modeling.vllm.fragments import VLLMFragments

from .layouts import Slot, argument, with_argument

__all__ = ["KernelFragments", "gather_heads", "split_heads", "gather_vocab"]

QUERY: Slot = (0, "query")
KEY: Slot = (1, "key")
VALUE: Slot = (2, "value")


def tensor_parallel() -> tuple[int, int]:
    """(this rank, ranks) of the engine's tensor-parallel group; (0, 1) where there is none."""
    try:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except (AssertionError, ImportError, RuntimeError):  # no group initialised: one rank
        return 0, 1


def gather_heads(pieces: list[torch.Tensor], replicas: int = 1) -> torch.Tensor:
    """The whole ``[tokens, heads * head_dim]`` from the ranks' pieces, in rank order.

    ``replicas`` consecutive ranks hold the same heads (key/value heads fewer
    than ranks); one copy of each is kept.
    """
    return torch.cat(pieces[::replicas], dim=-1)


def split_heads(whole: torch.Tensor, rank: int, ranks: int, replicas: int = 1) -> torch.Tensor:
    """Rank ``rank``'s piece of ``whole`` (`gather_heads` undone), contiguous."""
    return whole.chunk(ranks // replicas, dim=-1)[rank // replicas].contiguous()


def gather_vocab(local_logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Every rank's vocabulary slice of ``[..., vocab / tp]`` logits as ``[..., vocab_size]``.

    vLLM pads the vocabulary to a multiple of the ranks' slice size; the
    padding rows come last and are dropped. A collective: every rank calls it.
    """
    _, ranks = tensor_parallel()
    if ranks > 1:
        from vllm.distributed.communication_op import tensor_model_parallel_all_gather

        local_logits = tensor_model_parallel_all_gather(local_logits.contiguous(), dim=-1)
    return local_logits[..., :vocab_size]


class KernelFragments(VLLMFragments):
    """nnsight's rules for vLLM's sharded values, plus the attention kernel's heads.

    Args:
        kv_replicas: How many consecutive ranks hold the same key/value heads:
            ``tp / kv_heads`` where the model has fewer key/value heads than
            ranks, else 1 (vLLM's ``QKVParallelLinear.num_kv_head_replicas``).
    """

    def __init__(self, kv_replicas: int = 1) -> None:
        super().__init__()
        self.kv_replicas = kv_replicas
        self.kernels: set[str] = set()

    def instrument(self, envoy: Any) -> None:
        super().instrument(envoy)
        from vllm.model_executor.layers.attention.attention import Attention

        if isinstance(envoy._module, Attention) and tensor_parallel()[1] > 1:
            for side in ("input", "output"):
                location = f"{envoy.path}.{side}"
                self.rules[location] = (envoy._module, side)
                self.kernels.add(location)
            self.enabled = True

    def _kernel_inputs(self) -> tuple[tuple[Slot, int], ...]:
        """The kernel's query, key and value arguments, each with how many consecutive ranks hold the same heads."""
        return ((QUERY, 1), (KEY, self.kv_replicas), (VALUE, self.kv_replicas))

    def whole(self, location: str, value: Any) -> tuple[Any, Any]:
        if location not in self.kernels:
            return super().whole(location, value)
        if location.endswith(".output"):
            return self._gather(value), lambda whole: self.split(location, whole)
        inputs = value
        for slot, replicas in self._kernel_inputs():
            piece = argument(inputs, slot)
            if isinstance(piece, torch.Tensor):
                inputs = with_argument(inputs, slot, self._gather(piece, replicas))
        return inputs, lambda whole: self.split(location, whole)

    def split(self, location: str, whole: Any) -> Any:
        if location not in self.kernels:
            return super().split(location, whole)
        rank, ranks = tensor_parallel()
        if location.endswith(".output"):
            return split_heads(whole, rank, ranks)
        inputs = whole
        for slot, replicas in self._kernel_inputs():
            tensor = argument(inputs, slot)
            if isinstance(tensor, torch.Tensor):
                inputs = with_argument(inputs, slot, split_heads(tensor, rank, ranks, replicas))
        return inputs

    @staticmethod
    def _gather(piece: torch.Tensor, replicas: int = 1) -> torch.Tensor:
        from vllm.distributed.communication_op import tensor_model_parallel_all_gather

        _, ranks = tensor_parallel()
        gathered = tensor_model_parallel_all_gather(piece.contiguous(), dim=-1)
        return gather_heads(list(gathered.chunk(ranks, dim=-1)), replicas)
