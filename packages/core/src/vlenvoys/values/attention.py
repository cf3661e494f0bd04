"""The attention pattern, recomputed from the queries and keys vLLM's kernel receives.

vLLM's attention kernel takes this step's queries, keys and values and
returns the per-head outputs; the scores and the softmax between them are
inside the kernel, not Python. They are recomputed here, with the layer's own
scale, logit soft cap, sliding window and causal mask, and with grouped-query
heads expanded, from the rows a prefill holds for every prompt token.
"""

from __future__ import annotations

from typing import Any

import torch
from nnsight.intervention.interleaver import Mediator

from ..errors import DECODE_STEP
from .layouts import argument

__all__ = ["on_decode_step", "scores"]


def on_decode_step(envoy: Any, location: str) -> str | None:
    """`DECODE_STEP` when a read made now would be served a decode step of the request, else None.

    A request's first visit to its attention layer is the prefill (every
    prompt token at once; chunked prefill is off) and each later visit a
    decode step of one token. The worker knows which visit a read would be
    served before anything is read. Outside a trace there is no step to ask
    about, and the answer is the prefill's.
    """
    try:
        mediator = Mediator.current(location)
    except ValueError:
        return None
    return DECODE_STEP if mediator.wanted(location) > 0 else None


def scores(kernel: torch.nn.Module, inputs: tuple[tuple, dict]) -> torch.Tensor:
    """The scores entering the softmax, ``[1, heads, query, key]``, float32, masked entries ``-inf``.

    ``kernel`` is vLLM's ``Attention`` layer and ``inputs`` its call's
    ``(args, kwargs)``: queries ``[tokens, heads * head_dim]`` and keys
    ``[tokens, kv_heads * head_dim]``, already normed and rotated. Scale and
    soft cap are the kernel implementation's (``impl.scale``,
    ``impl.logits_soft_cap``, 0 for none); the window is the layer's
    ``sliding_window`` (None for full attention): a query attends to itself
    and the ``window - 1`` tokens before it.
    """
    query = argument(inputs, (0, "query")).float()
    key = argument(inputs, (1, "key")).float()
    head_dim = int(kernel.head_size)
    tokens = query.shape[0]
    query = query.reshape(tokens, -1, head_dim).transpose(0, 1)  # [heads, T, d]
    key = key.reshape(tokens, -1, head_dim).transpose(0, 1)  # [kv_heads, T, d]
    key = key.repeat_interleave(query.shape[0] // key.shape[0], dim=0)
    impl = kernel.impl
    result = (query @ key.transpose(1, 2)) * float(impl.scale)
    cap = float(getattr(impl, "logits_soft_cap", 0) or 0)
    if cap > 0:
        result = cap * torch.tanh(result / cap)
    positions = torch.arange(tokens, device=result.device)
    distance = positions[:, None] - positions[None, :]
    allowed = distance >= 0
    window = getattr(kernel, "sliding_window", None)
    if window is not None and window > 0:
        allowed &= distance < window
    return result.masked_fill(~allowed, float("-inf")).unsqueeze(0)
