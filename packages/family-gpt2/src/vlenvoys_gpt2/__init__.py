"""vlenvoys-gpt2: GPT-2 on vLLM.

GPT-2's vLLM block is called with the stream alone and returns it (it adds
inside), norms with ``ln_1``/``ln_2``, and its attention ``attn`` wraps the
kernel, also named ``attn``, between ``c_attn`` and ``c_proj``. Its MLP is
plain (``c_fc``, GELU, ``c_proj``), so the activation is served. Positions
are learned embeddings added before block 0, so ``token_embeddings`` (block
0's input) is ``wte + wpe``.
"""

from vllm.model_executor.models.gpt2 import GPT2Attention

from vlenvoys import Architecture, Attention, Family, Layer, Mlp

from .version import __version__

__all__ = ["FAMILY", "Gpt2Attention", "Gpt2Layer", "Gpt2Mlp", "__version__"]


class Gpt2Layer(Layer):
    """``GPT2Block.forward(hidden_states) -> hidden_states``."""

    STREAM = (0, "hidden_states")
    ATTENTION_NORM = "ln_1"
    MLP_NORM = "ln_2"
    # No module boundary holds the stream after the attention add: it is the
    # forward's `hidden_states = attn_output + residual`.
    MID = "source.hidden_states_1.output"


class Gpt2Attention(Attention):
    OUT_PROJ = "c_proj"


class Gpt2Mlp(Mlp):
    KIND = "plain"
    DOWN = "c_proj"


FAMILY = Family(
    name="gpt2",
    vllm=">=0.32,<0.33",
    architectures={
        "GPT2LMHeadModel": Architecture(
            layer=Gpt2Layer,
            attention=Gpt2Attention,
            mlp=Gpt2Mlp,
            # A class key: the attention's kernel child is also named "attn".
            rename={
                "transformer.h": "layers",
                "transformer.ln_f": "ln_final",
                "transformer.wte": "embed_tokens",
                GPT2Attention: "self_attn",
            },
        )
    },
)
