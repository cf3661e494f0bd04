"""The standard values of a block by name: which envoy serves each, in the order the forward computes them.

The one list every path checks a value name against (a trace's reads, `vlenvoys.collect`,
activation datasets, the CLI, a served request's ``capture`` and ``steering``).
"""

from __future__ import annotations

__all__ = ["KINDS", "ORDER", "OWNERS", "VALUES", "Read", "envoy_of"]

#: The values of a block, as (owner, name), in the order the forward reaches them
#: (nnsight needs that order within one invoke). The owner is the envoy that serves
#: the value: the block itself (``"layer"``), its attention (``"self_attn"``) or its MLP (``"mlp"``).
VALUES = (
    ("layer", "layer_input"),
    ("layer", "attention_norm_output"),
    ("self_attn", "attention_queries"),
    ("self_attn", "attention_keys"),
    ("self_attn", "attention_values"),
    ("self_attn", "attention_scores"),
    ("self_attn", "attention_probabilities"),
    ("self_attn", "attention_head_outputs"),
    ("self_attn", "attention_premix"),
    ("self_attn", "attention_output"),
    ("layer", "layer_mid"),
    ("layer", "mlp_norm_output"),
    ("mlp", "mlp_router_logits"),
    ("mlp", "mlp_router_experts"),
    ("mlp", "mlp_router_weights"),
    ("mlp", "mlp_activation"),
    ("mlp", "mlp_neurons"),
    ("mlp", "mlp_output"),
    ("layer", "layer_output"),
)
#: A value's name -> its owner.
OWNERS = {name: owner for owner, name in VALUES}
#: A value's name -> its place in the forward order.
ORDER = {name: number for number, (_, name) in enumerate(VALUES)}
#: An owner -> the kind of envoy `vlenvoys.support` lists its values under.
KINDS = {"layer": "layer", "self_attn": "attention", "mlp": "mlp"}

#: (layer, owner, value): one read of a block value; the owner as in `VALUES`.
Read = tuple[int, str, str]


def envoy_of(block: object, owner: str) -> object:
    """The envoy of ``block`` (a block's envoy) that serves ``owner``'s values: the block, or its child."""
    return block if owner == "layer" else getattr(block, owner)
