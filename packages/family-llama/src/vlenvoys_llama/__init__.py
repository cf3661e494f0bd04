"""vlenvoys-llama: Llama and the architectures vLLM runs through the same fused-block code.

Every block here is a `vlenvoys.FusedLayer` with vLLM's Llama names
(``input_layernorm``, ``self_attn``, ``post_attention_layernorm``, ``mlp``),
so the declarations are the architecture names and the standard renames.
"""

from vlenvoys import (
    BACKBONE_NAMES,
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

__all__ = ["FAMILY", "GraniteAttention", "GraniteLayer", "GraniteMlp", "LlamaLayer", "RoutedMlp", "__version__"]



class LlamaLayer(FusedLayer):
    """vLLM's ``LlamaDecoderLayer`` and its kin: ``forward(positions, hidden_states, residual)``."""


class RoutedMlp(Mlp):
    """A mixture of experts (Qwen2-MoE's sparse block, Mixtral's): no neurons shared by a token's experts.

    Its router is the ``gate`` child on all three (Qwen3-MoE's FusedMoE layer calls it
    itself), so ``mlp_router_logits`` is served from core's default ``ROUTER``; its
    FusedMoE layer is the ``experts`` child on all three, so each token's chosen experts
    and their weights are served from core's default ``ROUTES``.
    """

    KIND = "routed"


class GraniteLayer(Layer):
    """``GraniteDecoderLayer.forward(positions, hidden_states) -> hidden_states``: the whole stream,
    each sublayer's output added times ``residual_multiplier``."""

    # No module boundary holds the stream after the attention add: it is the forward's
    # `hidden_states = residual + hidden_states * self.residual_multiplier`.
    MID = "source.hidden_states_2.output"


class GraniteAttention(Attention):
    MULTIPLIER = "residual_multiplier"


class GraniteMlp(Mlp):
    MULTIPLIER = "residual_multiplier"


LLAMA = Architecture(layer=LlamaLayer)
# Granite's embedding multiplier is applied before block 0 (token_embeddings is
# block 0's input), its attention scale is the kernel's, and its logits scaling
# is the logits processor's: all read where vLLM keeps them, no declaration needed.
GRANITE = Architecture(layer=GraniteLayer, attention=GraniteAttention, mlp=GraniteMlp)
# Qwen2-MoE and Qwen3-MoE (q/k norms inside attention, no shared expert): Llama's block
# with a sparse MLP. Every block of the tiny test configs is sparse; a checkpoint with
# dense blocks (mlp_only_layers, decoder_sparse_step > 1) would need those declared gated.
QWEN_MOE = Architecture(layer=LlamaLayer, mlp=RoutedMlp)
MIXTRAL = Architecture(layer=LlamaLayer, mlp=RoutedMlp, rename={**BACKBONE_NAMES, "block_sparse_moe": "mlp"})

class LlamaTransformersLayer(TransformersLayer):
    """transformers' ``LlamaDecoderLayer`` on vLLM's transformers backend."""

    # transformers' `hidden_states = residual + hidden_states` after the attention.
    MID = "source.hidden_states_1.output"


LLAMA_ON_TRANSFORMERS = Architecture(
    layer=LlamaTransformersLayer, attention=TransformersAttention, mlp=TransformersMlp
)

FAMILY = Family(
    name="llama",
    vllm=">=0.32,<0.33",
    architectures={
        "LlamaForCausalLM": LLAMA,
        # MistralDecoderLayer subclasses Llama's and adds an unused keyword.
        "MistralForCausalLM": LLAMA,
        # Qwen2/Qwen3 blocks have Llama's call and names; qkv bias and q/k norms are inside attention.
        "Qwen2ForCausalLM": LLAMA,
        "Qwen3ForCausalLM": LLAMA,
        # vLLM's Phi3ForCausalLM is its LlamaForCausalLM: it loads the checkpoint's fused
        # qkv_proj/gate_up_proj into Llama's (already fused) projections.
        "Phi3ForCausalLM": LLAMA,
        "Qwen2MoeForCausalLM": QWEN_MOE,
        "Qwen3MoeForCausalLM": QWEN_MOE,
        "MixtralForCausalLM": MIXTRAL,
        "GraniteForCausalLM": GRANITE,
    },
    transformers_backend={"LlamaForCausalLM": LLAMA_ON_TRANSFORMERS},
)
