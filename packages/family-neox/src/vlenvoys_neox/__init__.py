"""vlenvoys-neox: GPT-NeoX (Pythia), GPT-J and Cohere (Command-R) on vLLM: the parallel blocks.

Both rotate part of each head (``rotary_pct`` / ``rotary_dim``): the
queries and keys are read as vLLM's attention kernel receives them, after
the rotary, and the pattern is recomputed from those, so nothing here
depends on how much of a head is rotated.

GPT-J's vLLM block (``transformer.h[i]``) is parallel: ``ln_1`` feeds both
the attention ``attn`` (whose kernel child is also ``attn``; ``qkv_proj``,
``out_proj``) and the plain MLP (``fc_in``, GELU, ``fc_out``), and the block
adds both to its input.

vLLM 0.32 has no GPT-NeoX model of its own: it runs on vLLM's transformers
backend, transformers' ``GPTNeoXLayer`` with vLLM's attention kernel mounted
as ``attention.attn``. The config's ``use_parallel_residual`` chooses the
block: parallel (Pythia: attention and MLP both read the block input) or
sequential (the MLP reads the stream after the attention add,
``attn_output = attn_output + hidden_states`` in the forward).

Cohere's vLLM block (``CohereDecoderLayer``, vLLM's own ``commandr.py``) is
GPT-J's parallel block under Llama's names: ``input_layernorm`` (a LayerNorm
without bias) feeds both ``self_attn`` (``qkv_proj``, per-head ``q_norm`` /
``k_norm`` with ``use_qk_norm``, ``attn``, ``o_proj``) and the gated ``mlp``
(``gate_up_proj``, ``down_proj``), and ``forward(positions, hidden_states,
residual)`` returns ``(stream, layer input)``. It unembeds with
``embed_tokens`` (no ``lm_head`` child), and its logits processor holds
``logit_scale``, which `project_on_vocab` applies as the engine does.
"""

from vllm.model_executor.models.gpt_j import GPTJAttention

from vlenvoys import (
    TIED_BACKBONE_NAMES,
    Architecture,
    Attention,
    ByConfig,
    Family,
    Mlp,
    ParallelLayer,
    TransformersAttention,
    TransformersLayer,
    TransformersMlp,
)

from .version import __version__

__all__ = ["COHERE", "FAMILY", "GPTJ", "NEOX", "__version__"]


class GptjLayer(ParallelLayer):
    """``GPTJBlock.forward(position_ids, hidden_states) -> hidden_states``: one norm for both sublayers."""

    ATTENTION_NORM = "ln_1"
    MLP_NORM = "ln_1"


class GptjAttention(Attention):
    OUT_PROJ = "out_proj"


class GptjMlp(Mlp):
    KIND = "plain"
    DOWN = "fc_out"


class CohereLayer(ParallelLayer):
    """``CohereDecoderLayer.forward(positions, hidden_states, residual) -> (stream, layer input)``."""

    RETURNS_TUPLE = True
    MLP_NORM = "input_layernorm"


class NeoxParallelLayer(ParallelLayer, TransformersLayer):
    """transformers' ``GPTNeoXLayer`` with ``use_parallel_residual`` (Pythia)."""


class NeoxSequentialLayer(TransformersLayer):
    """transformers' ``GPTNeoXLayer`` without ``use_parallel_residual``."""

    # The forward's `attn_output = attn_output + hidden_states`.
    MID = "source.attn_output_1.output"


class NeoxAttention(TransformersAttention):
    OUT_PROJ = "dense"


class NeoxMlp(TransformersMlp):
    KIND = "plain"
    DOWN = "dense_4h_to_h"


GPTJ = Architecture(
    layer=GptjLayer,
    attention=GptjAttention,
    mlp=GptjMlp,
    # A class key: the attention's kernel child is also named "attn".
    rename={
        "transformer.h": "layers",
        "transformer.ln_f": "ln_final",
        "transformer.wte": "embed_tokens",
        GPTJAttention: "self_attn",
    },
)

# Llama's attention and gated MLP (core's defaults); the embedding is also the unembedding.
COHERE = Architecture(layer=CohereLayer, rename=TIED_BACKBONE_NAMES)

_NEOX_NAMES = {
    "model.layers": "layers",
    "model.final_layer_norm": "ln_final",
    "model.embed_in": "embed_tokens",
    "attention": "self_attn",
}
# transformers' GPTNeoXConfig defaults use_parallel_residual to True.
NEOX = ByConfig(
    "use_parallel_residual",
    {
        True: Architecture(layer=NeoxParallelLayer, attention=NeoxAttention, mlp=NeoxMlp, rename=_NEOX_NAMES),
        False: Architecture(layer=NeoxSequentialLayer, attention=NeoxAttention, mlp=NeoxMlp, rename=_NEOX_NAMES),
    },
    default=True,
)

FAMILY = Family(
    name="neox",
    vllm=">=0.32,<0.33",
    architectures={"GPTJForCausalLM": GPTJ, "CohereForCausalLM": COHERE},
    transformers_backend={"GPTNeoXForCausalLM": NEOX},
)
