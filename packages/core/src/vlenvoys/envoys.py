"""The base envoys of a vLLM family: nnterp's values, read where vLLM keeps them.

A family states how its modules differ as class attributes (declarations)
on subclasses of these; the values themselves are declared once, here.
Every value is a private ``[1, tokens, ...]`` copy (see `vlenvoys.values`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from nnsight.intervention.envoy import Envoy

from .values import Flat, Residual, Slot, summed, summed_output

__all__ = ["Attention", "FusedLayer", "Layer", "Mlp", "StandardEnvoy"]


class StandardEnvoy(Envoy):
    """An envoy that serves standard values and can name the ones it cannot.

    ``UNAVAILABLE`` maps a value's name to the reason this kind of module
    cannot serve it (`vlenvoys.errors.GATED`, ...); reading such a value raises
    `vlenvoys.Unavailable` before anything is read.
    """

    UNAVAILABLE: ClassVar[Mapping[str, str]] = {}

    def unavailable(self, value: str) -> str | None:
        """Why ``value`` cannot be served here, or None when it can."""
        return self.UNAVAILABLE.get(value)


class Layer(StandardEnvoy):
    """A vLLM block that is called with the residual stream and returns it.

    Declarations a family states where its block differs:

    - ``STREAM``: where the stream sits in the block's call, ``(position,
      keyword)``; most blocks take the positions first, GPT-2's takes the
      stream alone (``(0, "hidden_states")``).
    - ``OUTPUT``: which element of a tuple the block returns is the stream
      (a block returning ``(stream, other)`` keeps the default 0).
    - ``ATTENTION_NORM`` / ``MLP_NORM``: the child names of the norms before
      the attention and the MLP.
    - ``MID`` / ``MID_SELECT``: where the stream after the attention add is
      held, as a location key and a selection (None where the block holds it
      in no tensor of its own).
    """

    STREAM: ClassVar[Slot] = (1, "hidden_states")
    OUTPUT: ClassVar[int] = 0
    ATTENTION_NORM: ClassVar[str] = "input_layernorm"
    MLP_NORM: ClassVar[str] = "post_attention_layernorm"
    MID: ClassVar[str | None] = None
    MID_SELECT: ClassVar[Slot | int | None] = None

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

    def unavailable(self, value: str) -> str | None:
        if value == "layer_mid" and self.MID is None:
            return (
                f"{type(self).__name__} declares no place where the stream after the attention add "
                "is held; read layer_input + attention_output"
            )
        return super().unavailable(value)


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

    def unavailable(self, value: str) -> str | None:
        return StandardEnvoy.unavailable(self, value)


class Attention(StandardEnvoy):
    """A vLLM attention module: what it adds to the residual stream."""

    @Flat("output")
    def attention_output(self, value) -> Residual:
        """What the attention adds to the residual stream, [1, tokens, hidden_size]: the module's output."""
        return value


class Mlp(StandardEnvoy):
    """A vLLM feed-forward module: what it adds to the residual stream."""

    @Flat("output")
    def mlp_output(self, value) -> Residual:
        """What the MLP adds to the residual stream, [1, tokens, hidden_size]: the module's output."""
        return value
