"""vlenvoys-gemma: Gemma, Gemma 2 and Gemma 3 (text) on vLLM.

Every block is a `vlenvoys.FusedLayer`, called ``(positions, hidden_states,
residual)`` and returning ``(hidden_states, residual)``. What differs is
declared here:

- Embeddings: vLLM multiplies them by ``sqrt(hidden_size)`` in the backbone,
  outside ``embed_tokens``; ``token_embeddings`` is block 0's input, so it is
  the scaled stream the blocks see, as on transformers.
- Gemma 2 and 3 norm each sublayer's output before adding it
  (``post_attention_layernorm(h)``, ``post_feedforward_layernorm(h)``, one
  argument, a tensor back): ``attention_output`` and ``mlp_output`` are read
  there. The stream after the attention add goes into
  ``pre_feedforward_layernorm(h, residual)``, the MLP's norm.
- Gemma 2 has no ``lm_head`` module: it unembeds with ``embed_tokens``, which
  is therefore also named ``lm_head``. Its final logit soft cap is in vLLM's
  logits processor, which ``project_on_vocab`` applies.
- The query scale (``query_pre_attn_scalar``), Gemma 2's attention soft cap,
  Gemma 3's q/k norms and the alternating sliding and global layers are all
  inside the attention module or its kernel (``impl.scale``,
  ``impl.logits_soft_cap``, ``sliding_window``): the queries and keys are read
  as the kernel receives them and the pattern is recomputed with its own
  settings, so nothing is declared for them.
- The gated MLP's ``GeluAndMul`` is one module shared by every block (Gemma,
  Gemma 3); the neurons are read at each block's ``down_proj`` input.
- vLLM 0.34 has no Gemma 1 of its own and runs it on its transformers
  backend, where `vlenvoys.load` takes the declarations below
  (``transformers_backend``): transformers' ``GemmaDecoderLayer``, whose
  embedding module scales inside itself, so ``embed_tokens``' output is the
  scaled stream there. ``token_embeddings`` is the same on both.
"""

from vlenvoys import (
    TIED_BACKBONE_NAMES,
    Architecture,
    Attention,
    Family,
    FusedLayer,
    Mlp,
    TransformersAttention,
    TransformersLayer,
    TransformersMlp,
)

from .version import __version__

__all__ = ["FAMILY", "Gemma2Attention", "Gemma2Layer", "Gemma2Mlp", "GemmaLayer", "GemmaTransformersLayer", "__version__"]

#: Gemma 2 ties its unembedding to the embedding module itself (no ``lm_head``
#: child), so the embedding carries both names.
GEMMA2_RENAME = TIED_BACKBONE_NAMES


class GemmaLayer(FusedLayer):
    """``GemmaDecoderLayer.forward(positions, hidden_states, residual)``: Llama's block and names."""


class Gemma2Layer(FusedLayer):
    """``Gemma2DecoderLayer`` / ``Gemma3DecoderLayer``: a norm before and after each sublayer.

    The stream after the attention add is the sum of ``pre_feedforward_layernorm``'s
    two inputs ``(hidden_states, residual)``; ``post_attention_layernorm`` is
    the attention's post-norm, not the MLP's norm.
    """

    MLP_NORM = "pre_feedforward_layernorm"


class Gemma2Attention(Attention):
    """The attention's contribution is its post-norm's output, the tensor added to the stream."""

    CONTRIBUTION = "../post_attention_layernorm.output"


class Gemma2Mlp(Mlp):
    """A gated MLP whose contribution is its post-norm's output."""

    CONTRIBUTION = "../post_feedforward_layernorm.output"


class GemmaTransformersLayer(TransformersLayer):
    """transformers' ``GemmaDecoderLayer`` on vLLM's transformers backend, where vLLM 0.34 runs Gemma 1 alone."""

    # The forward's `hidden_states = residual + hidden_states` after the attention (Llama's lines).
    MID = "source.hidden_states_1.output"


FAMILY = Family(
    name="gemma",
    vllm=">=0.32,<0.33",
    architectures={
        "GemmaForCausalLM": Architecture(layer=GemmaLayer),
        "Gemma2ForCausalLM": Architecture(
            layer=Gemma2Layer, attention=Gemma2Attention, mlp=Gemma2Mlp, rename=GEMMA2_RENAME
        ),
        # Gemma 3's block is Gemma 2's; it has an lm_head (tied by weight, not by module).
        "Gemma3ForCausalLM": Architecture(
            layer=Gemma2Layer, attention=Gemma2Attention, mlp=Gemma2Mlp
        ),
    },
    # vLLM 0.34 dropped its own Gemma 1 and runs it on its transformers backend (`vlenvoys.load` chooses it).
    transformers_backend={
        "GemmaForCausalLM": Architecture(layer=GemmaTransformersLayer, attention=TransformersAttention, mlp=TransformersMlp)
    },
)
