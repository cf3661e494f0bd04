"""vlenvoys-llama: Llama and the architectures vLLM runs through the same fused-block code.

Every block here is a `vlenvoys.FusedLayer` with vLLM's Llama names
(``input_layernorm``, ``self_attn``, ``post_attention_layernorm``, ``mlp``),
so the declarations are the architecture names and the standard renames.
"""

from vlenvoys import Architecture, Family, FusedLayer, Mlp

from .version import __version__

__all__ = ["FAMILY", "LlamaLayer", "RoutedMlp", "__version__"]

#: vLLM's backbone is ``model.model``; nnterp's names sit on the root.
RENAME = {"model.layers": "layers", "model.norm": "ln_final", "model.embed_tokens": "embed_tokens"}


class LlamaLayer(FusedLayer):
    """vLLM's ``LlamaDecoderLayer`` and its kin: ``forward(positions, hidden_states, residual)``."""


class RoutedMlp(Mlp):
    """A mixture of experts (Qwen2-MoE's sparse block, Mixtral's): no neurons shared by a token's experts."""

    KIND = "routed"


LLAMA = Architecture(layer=LlamaLayer, rename=RENAME)
# Every block of the tiny test configs is sparse; a Qwen2-MoE checkpoint with dense
# blocks (mlp_only_layers) would need those declared gated.
QWEN2_MOE = Architecture(layer=LlamaLayer, mlp=RoutedMlp, rename=RENAME)
MIXTRAL = Architecture(layer=LlamaLayer, mlp=RoutedMlp, rename={**RENAME, "block_sparse_moe": "mlp"})

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
        "Qwen2MoeForCausalLM": QWEN2_MOE,
        "MixtralForCausalLM": MIXTRAL,
    },
)
