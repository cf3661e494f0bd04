"""The standard values of a block by name: which envoy serves each, in the order the forward computes them.

The one list every path checks a value name against (a trace's reads, `vlenvoys.collect`,
activation datasets, the CLI, a served request's ``capture`` and ``steering``), and each value's
name in TransformerLens and SAELens (`TRANSFORMER_LENS`, `transformer_lens_name`, `standard_name`).
"""

from __future__ import annotations

import difflib

__all__ = [
    "KINDS",
    "ORDER",
    "OWNERS",
    "TRANSFORMER_LENS",
    "TRANSFORMER_LENS_NOTES",
    "VALUES",
    "Read",
    "choices",
    "envoy_of",
    "hint",
    "nearest",
    "standard_name",
    "transformer_lens_name",
    "where",
]

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


def hint(name: str, owner: str | None) -> str | None:
    """What to tell a user who asked an envoy for ``name``, which it does not have; None when nothing fits.

    ``owner`` is the owner whose values the envoy serves (as in `VALUES`), or
    None for one that serves none. A standard value of another envoy names
    where it is served (``'mlp_output' is served by the block's mlp: ...``); a
    name close to a standard one (``layer_ouput``) is answered with it (``did
    you mean 'layer_output'?``, difflib's closest match).
    """
    if name in OWNERS:
        return None if OWNERS[name] == owner else where(name)
    found = nearest(name)
    if found is None:
        return None
    return f"did you mean {found!r}?" if OWNERS[found] == owner else f"did you mean {found!r}? {where(found)}"


def nearest(name: str) -> str | None:
    """The standard value name closest to ``name`` (difflib's closest match), or None when none is close."""
    close = difflib.get_close_matches(name, list(OWNERS), n=1)
    return close[0] if close else None


def choices(name: str) -> str:
    """What to tell a user who named ``name``, no standard value: ``did you mean 'x'? the values are ...``."""
    close = nearest(name)
    return f"{f'did you mean {close!r}? ' if close else ''}the values are {', '.join(OWNERS)}"


def where(value: str) -> str:
    """Where a standard value is read, as a sentence:
    ``'mlp_output' is served by the block's mlp: model.layers[i].mlp.mlp_output``."""
    owner = OWNERS[value]
    if owner == "layer":
        return f"{value!r} is served by the block: model.layers[i].{value}"
    return f"{value!r} is served by the block's {owner}: model.layers[i].{owner}.{value}"


#: Each block value's hook in TransformerLens (and so the activation name SAELens trains on), ``{layer}``
#: the block's index; None where TransformerLens holds no hook with the same tensor. TransformerLens' rotary
#: attentions (Llama, Gemma, NeoX, ...) hold the queries and keys as vLLM's attention receives them at
#: ``hook_rot_q``/``hook_rot_k``; a model without rotary embeddings (GPT-2) at ``hook_q``/``hook_k``.
#: A hook's tensor is the same as ours on a model TransformerLens loads without processing its weights
#: (``from_pretrained_no_processing``): its ``from_pretrained`` folds each norm's weight into the next layer
#: and centres the weights that write to the stream, which changes the norm outputs and, on LayerNorm models,
#: the stream itself.
TRANSFORMER_LENS: dict[str, str | None] = {
    "layer_input": "blocks.{layer}.hook_resid_pre",
    "attention_norm_output": None,
    "attention_queries": "blocks.{layer}.attn.hook_rot_q",
    "attention_keys": "blocks.{layer}.attn.hook_rot_k",
    "attention_values": "blocks.{layer}.attn.hook_v",
    "attention_scores": "blocks.{layer}.attn.hook_attn_scores",
    "attention_probabilities": "blocks.{layer}.attn.hook_pattern",
    "attention_head_outputs": "blocks.{layer}.attn.hook_z",
    "attention_premix": "blocks.{layer}.attn.hook_z",
    "attention_output": "blocks.{layer}.hook_attn_out",
    "layer_mid": "blocks.{layer}.hook_resid_mid",
    "mlp_norm_output": None,
    "mlp_router_logits": None,
    "mlp_router_experts": "blocks.{layer}.mlp.hook_expert_indices",
    "mlp_router_weights": None,
    "mlp_activation": "blocks.{layer}.mlp.hook_post",
    "mlp_neurons": "blocks.{layer}.mlp.hook_post",
    "mlp_output": "blocks.{layer}.hook_mlp_out",
    "layer_output": "blocks.{layer}.hook_resid_post",
}
#: Where a value and its TransformerLens hook differ in kind or in how they are laid out (docs/interop.md's table).
TRANSFORMER_LENS_NOTES: dict[str, str] = {
    "attention_norm_output": "`ln1.hook_normalized` is the normalized stream before the norm's weight (and bias)",
    "attention_queries": "after any query norm and rotary; `attn.hook_q` on a model without rotary embeddings (GPT-2)",
    "attention_keys": "after any key norm and rotary; `attn.hook_k` on a model without rotary embeddings (GPT-2)",
    "attention_scores": "both scaled, masked entries -inf, before the softmax",
    "attention_head_outputs": "SAELens flattens heads: `[tokens, heads * head_dim]`",
    "attention_premix": "the same tensor as `attention_head_outputs` wherever no gate sits before the output projection",
    "mlp_norm_output": "`ln2.hook_normalized` is the normalized stream before the norm's weight (and bias)",
    "mlp_router_logits": "`mlp.hook_expert_weights` is their softmax over every expert",
    "mlp_router_weights": "`mlp.hook_expert_weights` is the softmax over every expert, before the top-k and its renormalisation",
    "mlp_activation": "served on a plain MLP only, where it is the down projection's input, as `mlp_neurons`",
}
#: A TransformerLens hook's name (its part after ``blocks.{layer}.``) -> our value, where several of ours share it.
_PREFERRED = {"attn.hook_z": "attention_head_outputs", "mlp.hook_post": "mlp_neurons"}
#: Hooks of models without rotary embeddings, which hold what ours hold there.
_UNROTATED = {"attn.hook_q": "attention_queries", "attn.hook_k": "attention_keys"}


def transformer_lens_name(value: str, layer: int) -> str:
    """TransformerLens' hook of block ``layer``'s ``value`` (``"blocks.3.hook_resid_post"`` for ``layer_output`` of block 3).

    Raises:
        ValueError: ``value`` is not a block value, or TransformerLens has no hook holding it (`TRANSFORMER_LENS_NOTES` says why).
    """
    if value not in TRANSFORMER_LENS:
        raise ValueError(f"{value!r} is not a block value; choose from {', '.join(OWNERS)}")
    hook = TRANSFORMER_LENS[value]
    if hook is None:
        raise ValueError(f"TransformerLens has no hook holding {value}: {TRANSFORMER_LENS_NOTES[value]}")
    return hook.format(layer=layer)


def standard_name(hook: str) -> tuple[str, int]:
    """Our value and block of a TransformerLens hook: ``"blocks.3.hook_resid_post"`` -> ``("layer_output", 3)``.

    ``hook_q``/``hook_k`` (a model without rotary embeddings) read as the queries and keys.

    Raises:
        ValueError: a hook that holds none of the block values.
    """
    parts = hook.split(".", 2)
    if len(parts) == 3 and parts[0] == "blocks" and parts[1].isdigit():
        rest = parts[2]
        for value, name in TRANSFORMER_LENS.items():
            if name is not None and name.split(".", 2)[2] == rest:
                return _PREFERRED.get(rest, value), int(parts[1])
        if rest in _UNROTATED:
            return _UNROTATED[rest], int(parts[1])
    raise ValueError(f"{hook!r} is not a TransformerLens hook of a block value (blocks.LAYER.hook_resid_post, ...)")
