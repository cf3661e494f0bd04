"""The base envoys of a vLLM family: nnterp's values, read where vLLM keeps them.

A family states how its modules differ as class attributes (declarations)
on subclasses of these; the values themselves are declared once, here.
Every value is a private ``[1, tokens, ...]`` copy (see `vlenvoys.values.layouts`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from nnsight.intervention.envoy import Envoy
from nnsight.intervention.interleaver import Mediator

from .attention import on_decode_step, scores
from ..errors import FUSED_ROUTING, GATED, NOT_ROUTED, PARALLEL, ROUTED, InvalidWrite, NoSuchBlock, SkipRefused
from .routing import Chosen, routes_of
from .routing import Routes as RoutesModule
from .names import hint
from .layouts import (
    Derived,
    Experts,
    Flat,
    Heads,
    KeyValueHeads,
    Neurons,
    Pattern,
    Residual,
    Routes,
    Slot,
    argument,
    summed,
    summed_output,
    unbatched,
)

_PATTERN_READ_ONLY = (
    "vLLM's kernel computes the pattern and takes none; edit attention_queries or attention_keys "
    "to change what a head attends to, or attention_head_outputs to change what it wrote"
)

__all__ = [
    "Attention",
    "Blocks",
    "Contributing",
    "FusedLayer",
    "Layer",
    "Mlp",
    "ParallelLayer",
    "StandardEnvoy",
    "TransformersAttention",
    "TransformersLayer",
    "TransformersMlp",
    "block_index",
]


def block_index(layer: Any, count: int, *, noun: str = "block") -> int:
    """``layer`` as a non-negative block index; a negative one counts from the end, as in Python.

    Args:
        layer: The index given: an int (not a bool).
        count: How many blocks the model has.
        noun: What the message calls the index (``"block"``, ``"layer"``).

    Returns:
        The index in ``range(count)``.

    Raises:
        TypeError: ``layer`` is not an int, or is a bool.
        NoSuchBlock: ``layer`` is out of range, as "block 5 does not exist: the model has blocks 0 to 2"
            (an IndexError and a ValueError).
    """
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise TypeError(f"{noun} {layer!r} is a {type(layer).__name__}; a {noun} is an int")
    if not -count <= layer < count:
        raise NoSuchBlock(f"{noun} {layer} does not exist: the model has blocks 0 to {count - 1}")
    return layer % count


class Blocks(Envoy):
    """The model's blocks, ``model.layers``: ``model.layers[i]`` is block ``i`` (negative from the end).

    Raises:
        NoSuchBlock: a block that does not exist, with the valid range (see `block_index`; an IndexError).
        TypeError: a bool index.
    """

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, int):
            key = block_index(key, len(self))
        return super().__getitem__(key)


class StandardEnvoy(Envoy):
    """An envoy that serves standard values and can name the ones it cannot.

    ``UNAVAILABLE`` maps a value's name to the reason this kind of module
    cannot serve it (`vlenvoys.errors.GATED`, ...); reading such a value raises
    `vlenvoys.Unavailable` before anything is read.
    """

    UNAVAILABLE: ClassVar[Mapping[str, str]] = {}
    #: Whether this module's activations carry the batch axis (vLLM's transformers backend).
    BATCHED: ClassVar[bool] = False
    #: The owner whose standard values this envoy serves (`vlenvoys.values.names.VALUES`): "layer", "self_attn", "mlp".
    OWNER: ClassVar[str | None] = None

    def __getattr__(self, name: str) -> Any:
        """nnsight's lookup (a child, then the module's own attribute); a miss close to a standard value's name says
        which (``model.layers[0].layer_ouput``: "did you mean 'layer_output'?"), one of another envoy where it is."""
        try:
            return super().__getattr__(name)
        except AttributeError as error:
            told = None if name.startswith("_") else hint(name, self.OWNER)
            if told is None:
                raise
            raise AttributeError(f"{error}; {told}") from None

    @classmethod
    def unavailable(cls, value: str) -> str | None:
        """Why ``value`` cannot be served by this kind of module, or None when it can."""
        return cls.UNAVAILABLE.get(value)

    def unavailable_here(self, value: str) -> str | None:
        """Why this module, as loaded, cannot serve ``value`` (None when it can): the class's reason, or one
        that depends on the loaded modules (a mixture of experts' monolithic kernel, see `Mlp`)."""
        return type(self).unavailable(value)


class Layer(StandardEnvoy):
    """A vLLM block that is called with the residual stream and returns it.

    Declarations a family states where its block differs:

    - ``STREAM``: where the stream sits in the block's call, ``(position,
      keyword)``; most blocks take the positions first, GPT-2's takes the
      stream alone (``(0, "hidden_states")``).
    - ``RETURNS_TUPLE``: whether the block returns the stream with
      something beside it (EXAONE 4's ``(stream, mid)``), and ``OUTPUT``
      which element is the stream.
    - ``ATTENTION_NORM`` / ``MLP_NORM``: the child names of the norms before
      the attention and the MLP.
    - ``MID`` / ``MID_SELECT``: where the stream after the attention add is
      held, as a location key and a selection (None where the block holds it
      in no tensor of its own).
    - ``PARALLEL``: whether the attention and the MLP both read the block's
      input and are added to it together (GPT-J, Pythia; see
      `ParallelLayer`): ``layer_mid`` is then unavailable (`PARALLEL`) and
      the block's identity is ``layer_input + attention_output + mlp_output
      == layer_output``.
    """

    OWNER = "layer"
    STREAM: ClassVar[Slot] = (1, "hidden_states")
    RETURNS_TUPLE: ClassVar[bool] = False
    OUTPUT: ClassVar[int] = 0
    ATTENTION_NORM: ClassVar[str] = "input_layernorm"
    MLP_NORM: ClassVar[str] = "post_attention_layernorm"
    MID: ClassVar[str | None] = None
    MID_SELECT: ClassVar[Slot | int | None] = None
    PARALLEL: ClassVar[bool] = False

    @Flat("input", select="STREAM")
    def layer_input(self, value) -> Residual:
        """The residual stream entering the block, [1, tokens, hidden_size]: the block's call's stream argument."""
        return value

    @Flat("{ATTENTION_NORM}.output")
    def attention_norm_output(self, value) -> Residual:
        """The attention's input after its norm, [1, tokens, hidden_size]: the norm's (first) output."""
        return value

    @Flat("{MID}", select="MID_SELECT")
    def layer_mid(self, value) -> Residual:
        """The residual stream after the attention add, [1, tokens, hidden_size]."""
        return value

    @Flat("{MLP_NORM}.output")
    def mlp_norm_output(self, value) -> Residual:
        """The MLP's input after its norm, [1, tokens, hidden_size]: the norm's (first) output."""
        return value

    @Flat("output", select="OUTPUT")
    def layer_output(self, value) -> Residual:
        """The residual stream leaving the block, [1, tokens, hidden_size]: the block's output."""
        return value

    @classmethod
    def unavailable(cls, value: str) -> str | None:
        if value == "layer_mid" and cls.PARALLEL:
            return PARALLEL
        if value == "layer_mid" and cls.MID is None:
            return (
                f"{cls.__name__} declares no place where the stream after the attention add "
                "is held; read layer_input + attention_output"
            )
        return super().unavailable(value)

    def skip(self, hidden: torch.Tensor) -> None:
        """Skip this block, handing ``hidden`` (``[1, tokens, hidden_size]``) on as its residual stream.

        Safe on a request that runs alone. vLLM batches every request in flight
        into one step and a skipped block would have to answer for all of
        them, so a step shared with other requests is refused.

        Raises:
            SkipRefused: other requests share this step.
            InvalidWrite: ``hidden`` is not ``[1, tokens, hidden_size]`` for this request.
        """
        _skip(self, hidden, self._skipped)

    def _skipped(self, stream: torch.Tensor) -> Any:
        # What the block would return: the stream, or the stream beside itself
        # (a skipped block's mid-layer stream is its input).
        return (stream, stream) if self.RETURNS_TUPLE else stream


def _skip(layer: Layer, hidden: torch.Tensor, output: Callable[[torch.Tensor], Any]) -> None:
    """Skip ``layer`` for this request, handing ``output(rows)`` on as what it returned."""
    # Wait for the block to be reached: only then is this step's batch known.
    inputs = Mediator.value(f"{layer.path}.input")
    mediator = Mediator.current(f"{layer.path}.skip")
    _, rows = mediator.batch_group
    total = mediator.interleaver.batcher.total
    if rows != total:
        raise SkipRefused(
            f"cannot skip {layer.path}: this step runs {total} tokens of which {rows} are this request's. "
            "vLLM runs the block once for every request in the step, and a skipped block would have to answer "
            "for all of them; skip it in a trace whose request runs alone (one invoke, nothing else in flight)"
        )
    if not isinstance(hidden, torch.Tensor) or hidden.ndim != 3 or tuple(hidden.shape[:2]) != (1, rows):
        shape = list(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        raise InvalidWrite(f"skip: expected the stream as [1, {rows}, hidden_size], got {shape}")
    stream = argument(inputs, layer.STREAM) if isinstance(inputs, tuple) and len(inputs) == 2 else None
    if isinstance(stream, torch.Tensor):
        # The block's output goes on to the next blocks as a written stream does: checked as one (width, dtype,
        # device, NaN or inf). Unchecked, a NaN stream reached the cached keys and values and every later plain
        # request drew token 0 (found by fuzzing, #46).
        hidden = unbatched(hidden, stream, "skip", batch=layer.BATCHED).reshape(1, *hidden.shape[-2:])
    Envoy.skip(layer, output(hidden if layer.BATCHED else hidden[0]))


class ParallelLayer(Layer):
    """A parallel block: attention and MLP read the same input and their outputs are added to it together.

    ``layer_output = layer_input + attention_output + mlp_output`` (GPT-J,
    Pythia's GPT-NeoX, Cohere): no stream lies between the two sublayers, so
    ``layer_mid`` is unavailable (`vlenvoys.PARALLEL`). ``mlp_norm_output``
    is read where the MLP is called (``MLP``: its child name), the first
    argument of that call: a block with one norm for both sublayers (GPT-J's
    ``ln_1``) computes it before the attention, and the MLP's input is the
    one place it is seen after the attention's values, in forward order.
    """

    PARALLEL = True
    MLP: ClassVar[str] = "mlp"

    @Flat("{MLP}.input", select=(0, "hidden_states"))
    def mlp_norm_output(self, value) -> Residual:
        """The MLP's input after its norm, [1, tokens, hidden_size]: the MLP's call's first argument."""
        return value


class FusedLayer(Layer):
    """A vLLM block with the residual add fused into the next norm (Llama, Qwen, Gemma, most families).

    It is called ``forward(positions, hidden_states, residual)`` and returns
    ``(hidden_states, residual)``: ``hidden_states`` is what the last sublayer
    produced and ``residual`` the stream before it, so the stream is their
    sum, entering and leaving. The first block is called with ``residual``
    None and the embeddings as ``hidden_states``.

    The sum is computed for the read, so it is nobody's buffer. An edit goes
    back as a change to ``hidden_states`` (the next norm adds the two), and a
    read that edits nothing changes nothing: the model gets back exactly what
    it had. ``RESIDUAL`` declares where the residual half sits in the call.
    """

    RESIDUAL: ClassVar[Slot] = (2, "residual")

    @summed("input", hidden="STREAM", residual="RESIDUAL")
    def layer_input(self, value) -> Residual:
        """The residual stream entering the block, [1, tokens, hidden_size]: hidden_states + residual of its call."""
        return value

    attention_norm_output = Layer.attention_norm_output

    @summed("{MLP_NORM}.input")
    def layer_mid(self, value) -> Residual:
        """The residual stream after the attention add, [1, tokens, hidden_size]: the sum of the MLP norm's two inputs."""
        return value

    mlp_norm_output = Layer.mlp_norm_output

    @summed_output("output")
    def layer_output(self, value) -> Residual:
        """The residual stream leaving the block, [1, tokens, hidden_size]: the sum of its two outputs."""
        return value

    @classmethod
    def unavailable(cls, value: str) -> str | None:
        return cls.UNAVAILABLE.get(value)

    def _skipped(self, stream: torch.Tensor) -> Any:
        # The next norm adds the two halves: an empty hidden half and the stream as residual.
        return (torch.zeros_like(stream), stream)


class Contributing(StandardEnvoy):
    """A sublayer whose contribution to the residual stream is a standard value.

    Declarations: ``CONTRIBUTION``, where the contribution is read: the
    module's ``"output"`` by default, or a sibling's where a norm follows the
    sublayer (``"../post_attention_layernorm.output"``, Gemma 2); and
    ``MULTIPLIER``, the name of an attribute of the block module by which the
    block scales the sublayer's output before adding it (Granite's
    ``residual_multiplier``), None when it adds it as it is. A written
    contribution is divided back by the multiplier.
    """

    CONTRIBUTION: ClassVar[str] = "output"
    MULTIPLIER: ClassVar[str | None] = None

    @property
    def contribution_factor(self) -> float:
        """The block's multiplier of this sublayer's output (1 where there is none)."""
        if self.MULTIPLIER is None:
            return 1.0
        return float(getattr(self.parent._module, self.MULTIPLIER))


class Attention(Contributing):
    """A vLLM attention module: its contribution, what goes into and comes out of the engine's attention layer, and the pattern.

    The module projects (and, on a rotary family, rotates and norms) its
    queries, keys and values and calls vLLM's attention layer on them,
    ``self.attn(q, k, v)``, which returns the per-head outputs the output
    projection then mixes. Those four are that child's inputs and output,
    each ``[tokens, heads * head_dim]``, served with the heads split out by
    the layer's own ``head_size``. They are this step's rows: on a decode step
    the keys and values are the new token's alone (the earlier ones are in
    the engine's cache, which only the kernel reads).

    The scores and the pattern are computed inside the kernel, so they are
    recomputed from the queries and keys (`vlenvoys.values.attention.scores`):
    read-only, and there on the prefill only; a decode step raises
    `Unavailable` (``DECODE_STEP``).

    Declarations: ``KERNEL``, the attention layer's child name; ``OUT_PROJ``,
    the output projection's; ``CONTRIBUTION`` and ``MULTIPLIER``, see
    `Contributing`.
    """

    OWNER = "self_attn"
    KERNEL: ClassVar[str] = "attn"
    OUT_PROJ: ClassVar[str] = "o_proj"

    @property
    def head_dim(self) -> int:
        """The width of one head, from vLLM's attention layer (``head_size``)."""
        return int(self._module.get_submodule(self.KERNEL).head_size)

    @Flat("{KERNEL}.input", select=(0, "query"), heads="head_dim", batch=False)
    def attention_queries(self, value) -> Heads:
        """The queries the attention layer receives, [1, tokens, heads, head_dim]: after projection, any query norm and rotary."""
        return value

    @Flat("{KERNEL}.input", select=(1, "key"), heads="head_dim", batch=False)
    def attention_keys(self, value) -> KeyValueHeads:
        """This step's keys as the attention layer receives them, [1, tokens, kv_heads, head_dim]."""
        return value

    @Flat("{KERNEL}.input", select=(2, "value"), heads="head_dim", batch=False)
    def attention_values(self, value) -> KeyValueHeads:
        """This step's values as the attention layer receives them, [1, tokens, kv_heads, head_dim]."""
        return value

    @Derived("{KERNEL}.input", dynamic=on_decode_step, read_only=_PATTERN_READ_ONLY)
    def attention_scores(self, inputs) -> Pattern:
        """The scores entering the softmax, [1, heads, query, key], float32, masked entries -inf; prefill only, read-only."""
        return scores(self._module.get_submodule(self.KERNEL), inputs)

    @Derived("{KERNEL}.input", dynamic=on_decode_step, read_only=_PATTERN_READ_ONLY)
    def attention_probabilities(self, inputs) -> Pattern:
        """The attention pattern, [1, heads, query, key], float32: softmax of the scores; prefill only, read-only."""
        return scores(self._module.get_submodule(self.KERNEL), inputs).softmax(-1)

    @Flat("{KERNEL}.output", heads="head_dim", batch=False)
    def attention_head_outputs(self, value) -> Heads:
        """Each head's output as the attention layer returns it, [1, tokens, heads, head_dim]."""
        return value

    @Flat("{OUT_PROJ}.input", select=(0, "input_"), heads="head_dim")
    def attention_premix(self, value) -> Heads:
        """The output projection's input split by head, [1, tokens, heads, head_dim]; the head outputs where no gate sits between."""
        return value

    @Flat("{CONTRIBUTION}", factor="contribution_factor")
    def attention_output(self, value) -> Residual:
        """What the attention adds to the residual stream, [1, tokens, hidden_size]: its output, after any post-norm and multiplier."""
        return value


class Mlp(Contributing):
    """A vLLM feed-forward module: its neurons and what it adds to the residual stream.

    The neurons are the down projection's input, as on transformers. On a
    plain MLP (GPT-2's GELU) that is also the activation's output, and it is
    read there for both: vLLM builds an activation module once and shares it
    between every block, so the activation's own output cannot say which
    block called it. A gated MLP is different on vLLM: its gate and up
    projections are one ``gate_up_proj`` and its ``act_fn`` (``SiluAndMul``,
    ``GeluAndMul``) computes ``act(gate) * up`` in one kernel, so ``act(gate)``
    alone is never a tensor: ``mlp_activation`` is unavailable (``GATED``) and
    ``mlp_neurons`` is that kernel's output. A mixture of experts has neither
    (``ROUTED``); its ``mlp_output`` is served.

    A mixture of experts serves its router's logits, ``mlp_router_logits``
    (``[1, tokens, num_experts]``, before any softmax or top-k), read at the
    router module's output; a write replaces what the routing uses, and a
    written ``-inf`` bans that expert for that token (softmax weight 0 on
    vLLM and transformers alike) as long as each token keeps
    ``experts_per_token`` finite logits (`vlenvoys.values.layouts.check_masked`). It also
    serves the routing itself: ``mlp_router_experts`` (each token's chosen
    experts' indices, int64) and ``mlp_router_weights`` (their weights in the
    MLP's output, float32), both ``[1, tokens, experts_per_token]``, each
    token's sorted by weight, highest first, as transformers' top-k returns
    them. vLLM's FusedMoE layer picks them in its router, a plain Python
    object; core passes the router's result through an identity child of the
    layer (`vlenvoys.values.routing.Routes`, ``experts.routes``) where they are read,
    on the prefill and every decode step, and a write changes which experts
    the token goes to, or with what weight. Where vLLM's experts' kernel is
    monolithic (it routes inside itself from the logits: some quantized or
    vendor kernels on a GPU) they exist nowhere and are refused
    (``FUSED_ROUTING``), decided per loaded model. A dense MLP refuses all
    three (``NOT_ROUTED``).

    Declarations: ``KIND`` (``"plain"``, ``"gated"`` or ``"routed"``),
    ``DOWN``, the down projection's child name, ``ROUTER``, the router's
    child name (a linear layer returning ``(logits, bias)``), ``ROUTES``, the
    location of a module returning ``(weights, expert ids)``: by default the
    ``routes`` child core gives the FusedMoE layer named ``experts`` (a
    family whose layer is named otherwise declares ``"<name>.routes.output"``;
    None refuses both values, ``FUSED_ROUTING``), and ``CONTRIBUTION`` /
    ``MULTIPLIER`` (see `Contributing`).
    """

    OWNER = "mlp"
    KIND: ClassVar[str] = "gated"
    DOWN: ClassVar[str] = "down_proj"
    ROUTER: ClassVar[str] = "gate"
    ROUTES: ClassVar[str | None] = "experts.routes.output"

    @property
    def experts_per_token(self) -> int | None:
        """How many experts the loaded router sends each token to (its top-k), from the `Routes` child at
        ``ROUTES``; None where there is none (a written -inf logit is then refused as any non-finite write)."""
        routes = routes_of(self, self.ROUTES) if self.ROUTES is not None else None
        return getattr(routes, "experts_per_token", None)

    @Flat("{ROUTER}.output", top_k="experts_per_token")
    def mlp_router_logits(self, value) -> Experts:
        """The router's logits, [1, tokens, num_experts]: before softmax and top-k; a write changes the routing.

        A written -inf bans that expert for that token; InvalidWrite for NaN, +inf, or a token left
        with fewer than experts_per_token finite logits.
        """
        return value

    @Chosen("{ROUTES}", select=1)
    def mlp_router_experts(self, value) -> Routes:
        """The experts each token is sent to, [1, tokens, experts_per_token]: their indices (int64), by weight, highest first.

        Read at the FusedMoE layer's ``routes`` child (vLLM's router's choice); a
        write changes which experts each token goes to (distinct indices in
        [0, num_experts), int64, or InvalidWrite). Unavailable: FUSED_ROUTING on a
        monolithic kernel, NOT_ROUTED on a dense MLP.
        """
        return value

    @Chosen("{ROUTES}", select=0)
    def mlp_router_weights(self, value) -> Routes:
        """The weights of each token's experts in its output, [1, tokens, experts_per_token]: float32, highest first.

        Beside ``mlp_router_experts`` entry for entry (softmax of the logits, top-k,
        renormalized where the model does); a write changes the weights the experts'
        outputs are summed with. Unavailable as ``mlp_router_experts``.
        """
        return value

    @Flat("{DOWN}.input", select=(0, "input_"))
    def mlp_activation(self, value) -> Neurons:
        """act(up_proj(x)) on a plain MLP, [1, tokens, intermediate_size]: read as the down projection's input, which it is."""
        return value

    @Flat("{DOWN}.input", select=(0, "input_"))
    def mlp_neurons(self, value) -> Neurons:
        """The neurons, [1, tokens, intermediate_size]: the down projection's input."""
        return value

    @classmethod
    def unavailable(cls, value: str) -> str | None:
        if value.startswith("mlp_router_"):
            if cls.KIND != "routed":
                return NOT_ROUTED
            if value != "mlp_router_logits" and cls.ROUTES is None:
                return FUSED_ROUTING
        if cls.KIND == "routed" and value in ("mlp_activation", "mlp_neurons"):
            return ROUTED
        if cls.KIND == "gated" and value == "mlp_activation":
            return GATED
        return super().unavailable(value)

    def unavailable_here(self, value: str) -> str | None:
        """`unavailable`, and ``FUSED_ROUTING`` for the routing where this loaded layer's kernel is monolithic."""
        reason = type(self).unavailable(value)
        if reason is None and value in ("mlp_router_experts", "mlp_router_weights"):
            routes = routes_of(self, self.ROUTES)
            if routes is None:
                return (
                    f"{type(self).__name__} reads the routing at ROUTES = {self.ROUTES!r}, and this MLP has no such "
                    "module (vLLM's FusedMoE layer is named otherwise, or its router is not one vlenvoys.values.routing "
                    "routes through); read mlp_router_logits, the router's output the routing is computed from"
                )
            if isinstance(routes, RoutesModule) and not routes.computed:
                return FUSED_ROUTING
        return reason

    @Flat("{CONTRIBUTION}", factor="contribution_factor")
    def mlp_output(self, value) -> Residual:
        """What the MLP adds to the residual stream, [1, tokens, hidden_size]: its output, after any post-norm and multiplier."""
        return value


class TransformersLayer(Layer):
    """A transformers decoder block run inside vLLM by its transformers backend.

    vLLM's ``model_impl="transformers"`` runs transformers' own modules, so a
    block is called with the whole stream first and returns it, every
    activation carries the batch axis (``BATCHED``), and the residual adds
    are transformers' unfused ones. A family states ``MID`` (the forward's
    add after the attention, a ``source.`` operation) and any other names.
    """

    BATCHED = True
    STREAM = (0, "hidden_states")


class TransformersAttention(Attention):
    """A transformers attention module on vLLM's transformers backend.

    vLLM mounts its attention layer as the module's ``attn`` child and calls it
    with flat ``[tokens, heads * head_dim]`` queries, keys and values, so the
    kernel's values are read exactly as on vLLM's own models; the projections
    around it carry the batch axis.
    """

    BATCHED = True


class TransformersMlp(Mlp):
    """A transformers MLP on vLLM's transformers backend: activations carry the batch axis."""

    BATCHED = True
