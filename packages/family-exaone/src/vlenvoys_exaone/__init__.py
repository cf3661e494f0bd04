"""vlenvoys-exaone: EXAONE 4 and EXAONE 3 on vLLM.

EXAONE 4: vLLM's ``Exaone4DecoderLayer.forward(positions, hidden_states, residual)``
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

EXAONE 3 (``ExaoneForCausalLM``) is Llama's fused block under GPT-2-like
names: ``transformer.h[i]`` with ``ln_1``/``ln_2``, the attention one level
down at ``attn.attention`` (``out_proj``), the MLP's down projection ``c_proj``.

OLMo 2 (``Olmo2ForCausalLM``) is EXAONE 4's block: no norm before either
sublayer, ``post_attention_layernorm`` / ``post_feedforward_layernorm`` on
their outputs before each add, q/k norms (over the whole projection) inside
the attention. vLLM 0.32 has no OLMo 2 model of its own and runs it on its
transformers backend: transformers' ``Olmo2DecoderLayer``, called with the
whole stream and returning it, activations with the batch axis, vLLM's
kernel mounted as ``self_attn.attn`` (it gets the normed, rotated queries and
keys). `vlenvoys.load` chooses the backend by itself.
"""

from vlenvoys import (
    Architecture,
    Attention,
    Family,
    FusedLayer,
    Layer,
    Mlp,
    TransformersAttention,
    TransformersLayer,
    TransformersMlp,
)

from .version import __version__

__all__ = [
    "EXAONE3",
    "EXAONE4",
    "FAMILY",
    "NO_PRE_ATTENTION_NORM",
    "NO_PRE_MLP_NORM",
    "OLMO2",
    "Exaone3Attention",
    "Exaone3Layer",
    "Exaone3Mlp",
    "Exaone4Attention",
    "Exaone4Layer",
    "Exaone4Mlp",
    "Olmo2Attention",
    "Olmo2Layer",
    "Olmo2Mlp",
    "__version__",
]

NO_PRE_ATTENTION_NORM = (
    "this block (EXAONE 4, OLMo 2) norms after the attention, not before: the attention reads the raw stream, "
    "so its input is layer_input; read layer_input instead (the post-attention norm's output is attention_output)"
)
NO_PRE_MLP_NORM = (
    "this block (EXAONE 4, OLMo 2) norms after the MLP, not before: the MLP reads the mid-layer stream as it is; "
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
)


class Exaone3Layer(FusedLayer):
    """``ExaoneDecoderLayer.forward(positions, hidden_states, residual) -> (hidden_states, residual)``."""

    ATTENTION_NORM = "ln_1"
    MLP_NORM = "ln_2"


class Exaone3Attention(Attention):
    """vLLM's ``ExaoneAttention``, at ``attn.attention`` (the block's ``attn`` only forwards to it)."""

    OUT_PROJ = "out_proj"


class Exaone3Mlp(Mlp):
    """vLLM's ``ExaoneGatedMLP``: ``gate_up_proj``, ``SiluAndMul``, down projection ``c_proj``."""

    DOWN = "c_proj"


EXAONE3 = Architecture(
    layer=Exaone3Layer,
    attention=Exaone3Attention,
    mlp=Exaone3Mlp,
    rename={
        "transformer.h": "layers",
        "transformer.ln_f": "ln_final",
        "transformer.wte": "embed_tokens",
        "attn.attention": "self_attn",
    },
)


class Olmo2Layer(TransformersLayer):
    """transformers' ``Olmo2DecoderLayer.forward(hidden_states, ...) -> hidden_states``, on vLLM's backend."""

    # The forward's `hidden_states = residual + hidden_states` after the attention's post-norm.
    MID = "source.hidden_states_1.output"
    UNAVAILABLE = Exaone4Layer.UNAVAILABLE


class Olmo2Attention(TransformersAttention):
    CONTRIBUTION = Exaone4Attention.CONTRIBUTION


class Olmo2Mlp(TransformersMlp):
    CONTRIBUTION = Exaone4Mlp.CONTRIBUTION


OLMO2 = Architecture(layer=Olmo2Layer, attention=Olmo2Attention, mlp=Olmo2Mlp)

FAMILY = Family(
    name="exaone",
    vllm=">=0.32,<0.33",
    architectures={"Exaone4ForCausalLM": EXAONE4, "ExaoneForCausalLM": EXAONE3},
    # vLLM 0.32 runs OLMo 2 on its transformers backend alone.
    transformers_backend={"Olmo2ForCausalLM": OLMO2},
)
