"""vlenvoys-exaone: EXAONE 4 on vLLM.

vLLM's ``Exaone4DecoderLayer.forward(positions, hidden_states, residual)``
takes the whole stream (the residual argument is ignored) and norms *after*
each sublayer: attention on the raw stream, ``post_attention_layernorm`` on
its output, add; MLP on the mid-layer stream, ``post_feedforward_layernorm``
on its output, add; it returns ``(stream, mid)``. So the sublayers'
contributions are the post norms' outputs, the mid-layer stream is the first
add inside the forward, and there is no pre-sublayer norm output to serve.

Hybrid models alternate sliding-window layers (rotary) with full-attention
layers (no rotary); the queries and keys are read as the kernel receives
them and the pattern with each kernel's own window, so neither needs a
declaration.
"""

from vlenvoys import Architecture, Attention, Family, Layer, Mlp

from .version import __version__

__all__ = ["EXAONE4", "FAMILY", "NO_PRE_ATTENTION_NORM", "NO_PRE_MLP_NORM", "Exaone4Attention", "Exaone4Layer",
           "Exaone4Mlp", "__version__"]

NO_PRE_ATTENTION_NORM = (
    "EXAONE 4 norms after the attention, not before: the attention reads the raw stream, "
    "so its input is layer_input; read layer_input instead (the post-attention norm's output is attention_output)"
)
NO_PRE_MLP_NORM = (
    "EXAONE 4 norms after the MLP, not before: the MLP reads the mid-layer stream as it is; "
    "read layer_mid instead (the post-feedforward norm's output is mlp_output)"
)


class Exaone4Layer(Layer):
    """``Exaone4DecoderLayer.forward(positions, hidden_states, residual) -> (stream, mid)``."""

    RETURNS_TUPLE = True
    # The forward's `hidden_states = residual + hidden_states` after the attention:
    # the MLP and the second add both take what this assignment holds.
    MID = "source.hidden_states_2.output"
    UNAVAILABLE = {"attention_norm_output": NO_PRE_ATTENTION_NORM, "mlp_norm_output": NO_PRE_MLP_NORM}


class Exaone4Attention(Attention):
    """The attention's contribution is ``post_attention_layernorm(self_attn(...))``, read at that sibling norm."""

    CONTRIBUTION = "../post_attention_layernorm.output"


class Exaone4Mlp(Mlp):
    """The MLP's contribution is ``post_feedforward_layernorm(mlp(...))``, read at that sibling norm."""

    CONTRIBUTION = "../post_feedforward_layernorm.output"


EXAONE4 = Architecture(
    layer=Exaone4Layer,
    attention=Exaone4Attention,
    mlp=Exaone4Mlp,
    rename={"model.layers": "layers", "model.norm": "ln_final", "model.embed_tokens": "embed_tokens"},
)

FAMILY = Family(name="exaone", vllm=">=0.32,<0.33", architectures={"Exaone4ForCausalLM": EXAONE4})
