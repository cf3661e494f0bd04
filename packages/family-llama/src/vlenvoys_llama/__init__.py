"""vlenvoys-llama: Llama and the architectures vLLM runs through the same fused-block code.

Every block here is a `vlenvoys.FusedLayer` with vLLM's Llama names
(``input_layernorm``, ``self_attn``, ``post_attention_layernorm``, ``mlp``),
so the declarations are the architecture names and the standard renames.
"""

from vlenvoys import Architecture, Family, FusedLayer

from .version import __version__

__all__ = ["FAMILY", "LlamaLayer", "__version__"]

#: vLLM's backbone is ``model.model``; nnterp's names sit on the root.
RENAME = {"model.layers": "layers", "model.norm": "ln_final", "model.embed_tokens": "embed_tokens"}


class LlamaLayer(FusedLayer):
    """vLLM's ``LlamaDecoderLayer`` and its kin: ``forward(positions, hidden_states, residual)``."""


LLAMA = Architecture(layer=LlamaLayer, rename=RENAME)

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
    },
)
