"""Tiny random transformers checkpoints for oracle tests.

:func:`tiny_model` writes a small randomly initialised model of a given
architecture, plus a byte-level BPE tokenizer trained on a few built-in
English paragraphs, to a folder that both ``AutoModelForCausalLM.from_pretrained`` and ``vllm.LLM`` load.

Default shapes: hidden 128, 4 query heads of head dim 32 (vLLM's CPU attention
refuses head dim 16), 2 key/value heads where the
architecture has grouped-query attention, MLP intermediate 256, 3 layers,
vocabulary 512, 256 positions, float32. GPT-NeoX and GPT-J rotate a
quarter of each head (partial rotary). OLMo 2's and Cohere's norm weights
are drawn around 1, not left at transformers' ones. Architectures with interleaved
sliding-window layers (Gemma2, Gemma3, Exaone4) alternate sliding (window 16
tokens) and full attention, so the longer :data:`PROMPTS` cross the window.
Weights are drawn with std ``hidden_size ** -0.5`` instead of the usual 0.02
so that attention scores and logits have unit scale: attention is not uniform
and next-token distributions are not flat.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import shutil
import tempfile
from typing import Any

import torch

__all__ = ["PROMPTS", "architectures", "tiny_model"]

# Bump when the defaults or the tokenizer change, to invalidate cached builds.
_BUILDER_VERSION = 1
_MARKER = "vlenvoys-tiny.json"

_PAD, _BOS, _EOS, _UNK = "<pad>", "<s>", "</s>", "<unk>"
_SPECIAL_TOKENS = [_PAD, _BOS, _EOS, _UNK]  # ids 0, 1, 2, 3
_VOCAB = 512

_TEXT = """\
The quick brown fox jumps over the lazy dog. The dog does not move; it only \
opens one eye and goes back to sleep in the warm afternoon sun.

Once upon a time there was a small village at the edge of a great forest. \
Every morning the baker opened his shop, and the smell of fresh bread filled \
the street. Children ran to school, farmers drove their carts to the market, \
and the old clock in the tower struck eight.

The capital of France is Paris, a city on the river Seine. Paris is known for \
its museums, its cafes and the tall iron tower built for a world fair. Many \
people visit the city every year to see the paintings, walk along the river \
and eat good food.

Water boils at one hundred degrees and freezes at zero. The sun is a star, \
and the moon goes around the earth once a month. Light from the sun takes \
about eight minutes to reach us.

To make a cup of tea, boil some water, pour it over the leaves and wait for \
three or four minutes. Add milk or lemon if you like. Some people drink their \
tea with honey, others with nothing at all.

A language model reads a sequence of tokens and predicts the next one. It \
learns from a large amount of text, one word at a time. When it is small and \
random, its answers make no sense, but its numbers can still be checked.

One, two, three, four, five, six, seven, eight, nine, ten. Monday, Tuesday, \
Wednesday, Thursday, Friday, Saturday and Sunday are the days of the week.
"""

#: Test prompts of 3, 10, 21 and 24 tokens on the tiny tokenizer (BOS included).
PROMPTS: tuple[str, ...] = (
    "The sun",
    "The capital of France is",
    "Once upon a time there was a small village at the edge of",
    "To make a cup of tea, boil some water and pour it over the leaves",
)

_BASE: dict[str, Any] = {
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_hidden_layers": 3,
    "vocab_size": _VOCAB,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_DECODER = _BASE | {"num_key_value_heads": 2, "intermediate_size": 256}
# Gemma and Qwen3 configs default to a large explicit head_dim.
_HEAD_DIM = {"head_dim": 32}
_GEMMA_LOCAL = _HEAD_DIM | {"query_pre_attn_scalar": 32, "sliding_window": 16}

# Per-architecture config defaults, keyed by canonical or aliased config names.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": _DECODER,
    "MistralForCausalLM": _DECODER | {"sliding_window": None},
    "Qwen2ForCausalLM": _DECODER,
    "Qwen3ForCausalLM": _DECODER | _HEAD_DIM,
    "GPT2LMHeadModel": _BASE
    | {"n_inner": 256, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "GemmaForCausalLM": _DECODER | _HEAD_DIM,
    # Keeps Gemma2's logit soft caps (attention 50, final 30).
    "Gemma2ForCausalLM": _DECODER | _GEMMA_LOCAL,
    # Pattern 2: sliding, full, sliding, ... (the default 6 makes 3 layers all local).
    "Gemma3ForCausalLM": _DECODER | _GEMMA_LOCAL | {"sliding_window_pattern": 2},
    "Exaone4ForCausalLM": _DECODER | {"sliding_window": 16, "sliding_window_pattern": 2},
    # Non-trivial muP-style multipliers, so that forgetting one changes the output.
    "GraniteForCausalLM": _DECODER
    | {
        "embedding_multiplier": 8.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.25,
        "logits_scaling": 0.5,
    },
    "Qwen2MoeForCausalLM": _DECODER
    | {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 128,
    },
    "MixtralForCausalLM": _DECODER | {"num_local_experts": 4, "num_experts_per_tok": 2},
    # The pretraining context (the long-context rope's threshold; 4096 by default) set to the
    # tiny one; _BASE's pad id replaces Phi-3's 32000, outside the tiny vocabulary.
    "Phi3ForCausalLM": _DECODER | {"original_max_position_embeddings": 256},
    # No shared expert; every block sparse (decoder_sparse_step 1, no mlp_only_layers);
    # renormalized top-k weights, as the released Qwen3-MoE checkpoints.
    "Qwen3MoeForCausalLM": _DECODER
    | _HEAD_DIM
    | {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    },
    # OLMo 2: norms after the sublayers, q/k norms over the whole projection (vLLM 0.32: transformers
    # backend); norm weights drawn around 1 (_norm_weights).
    "Olmo2ForCausalLM": _DECODER,
    # Pythia's block: attention and MLP both read the block input (parallel residual), a quarter
    # of each head rotated (rotary_pct 0.25, 8 of 32 dimensions), rotate-half (NeoX) style.
    # use_parallel_residual=False gives the sequential block.
    "GPTNeoXForCausalLM": _BASE | {"intermediate_size": 256, "rotary_pct": 0.25, "use_parallel_residual": True},
    # GPT-J: parallel block with one norm for both sublayers, 8 of each head's 32 dimensions rotated,
    # interleaved (GPT-J) style.
    "GPTJForCausalLM": _BASE | {"n_inner": 256, "rotary_dim": 8},
    # Cohere (Command-R): parallel block under one bias-free LayerNorm, tied embeddings, q/k norms per
    # head (Command-R+'s use_qk_norm), logits scaled by 0.5 (not the default 0.0625, which flattens
    # the tiny model's next-token distributions); norm weights drawn around 1 (_norm_weights).
    "CohereForCausalLM": _DECODER | {"use_qk_norm": True, "logit_scale": 0.5},
}


def _gptj_unembedding_bias(model: Any) -> None:
    # transformers initialises GPT-J's unembedding bias to zeros: drawn instead, so that a
    # logit lens (project_on_vocab) that left it out would differ from the engine's logits.
    torch.nn.init.normal_(model.lm_head.bias, std=1.0)


def _norm_weights(model: Any) -> None:
    # transformers initialises norm weights to ones: drawn around 1 instead, so that a norm weight
    # vLLM loaded in the wrong place (OLMo 2's whole-projection q/k norms, its post-norms) shows.
    for name, parameter in model.named_parameters():
        if name.endswith("norm.weight"):
            parameter.copy_(1 + 0.2 * torch.randn_like(parameter))


#: Weights drawn after the model's own initialisation, per architecture.
_AFTER_INIT = {
    "GPTJForCausalLM": _gptj_unembedding_bias,
    "Olmo2ForCausalLM": _norm_weights,
    "CohereForCausalLM": _norm_weights,
}


def architectures() -> tuple[str, ...]:
    """Return the architecture names :func:`tiny_model` accepts."""
    return tuple(_DEFAULTS)


def tiny_model(
    architecture: str,
    directory: str | os.PathLike[str],
    *,
    seed: int = 0,
    dtype: str = "float32",
    **overrides: Any,
) -> pathlib.Path:
    """Build and save a tiny random model of ``architecture`` with a tokenizer.

    The same (architecture, seed, overrides) always gives the same weights. A
    finished build is marked by ``vlenvoys-tiny.json`` in ``directory``; if it
    records the same arguments the call returns at once, otherwise the folder
    is rebuilt. Builds go to a temporary sibling folder moved into place at the
    end, under a sibling file lock ``.<name>.lock``, so concurrent callers are safe.

    Args:
        architecture: A transformers class name from :func:`architectures`.
        directory: Output folder; must be absent, empty or a previous build.
        seed: Seed of the weight initialisation (the tokenizer does not vary).
        dtype: The saved weights' and config's dtype (a torch dtype name such
            as ``"bfloat16"``); the weights are drawn in float32 and cast.
        **overrides: Config attributes replacing the defaults, e.g.
            ``sliding_window=8`` or ``num_hidden_layers=2``; aliases such as
            GPT-2's ``n_layer`` or Mixtral's ``num_experts`` are understood.
            Values must be JSON-serialisable. ``initializer_range`` defaults to
            ``hidden_size ** -0.5``.

    Returns:
        The absolute path of ``directory``, holding ``config.json`` (``dtype``),
        ``model.safetensors``, ``generation_config.json``, ``tokenizer.json``
        and ``tokenizer_config.json``.

    Raises:
        ValueError: Unknown architecture, or a vocabulary smaller than the
            tokenizer's 512 tokens.
        FileExistsError: ``directory`` holds files that are not a tiny build.
        TypeError: An override value is not JSON-serialisable.
    """
    if architecture not in _DEFAULTS:
        raise ValueError(
            f"unknown architecture {architecture!r}; expected one of {architectures()}"
        )
    target = pathlib.Path(directory).absolute()
    marker = json.loads(
        json.dumps(
            {
                "builder": _BUILDER_VERSION,
                "architecture": architecture,
                "seed": seed,
                "overrides": overrides,
                # Only when not the default, so that float32 builds made before it stay valid.
                **({"dtype": dtype} if dtype != "float32" else {}),
            },
            sort_keys=True,
        )
    )
    if _read_marker(target) == marker:
        return target

    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(target.with_name(f".{target.name}.lock")):
        if _read_marker(target) == marker:  # built by another process meanwhile
            return target
        _build(target, architecture, seed, overrides, marker, dtype)
    return target


def _read_marker(directory: pathlib.Path) -> Any:
    try:
        return json.loads((directory / _MARKER).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def _build(
    target: pathlib.Path,
    architecture: str,
    seed: int,
    overrides: dict[str, Any],
    marker: dict[str, Any],
    dtype: str = "float32",
) -> None:
    """Write the model into ``target``; the caller holds the lock."""
    import transformers

    if target.exists() and any(target.iterdir()) and not (target / _MARKER).is_file():
        raise FileExistsError(f"{target} is not empty and is not a tiny_model build")

    model_cls = getattr(transformers, architecture)
    config_cls = model_cls.config_class
    aliases = config_cls.attribute_map
    # Canonical names on both sides, so that an alias override replaces its default.
    kwargs = {aliases.get(k, k): v for k, v in _DEFAULTS[architecture].items()}
    kwargs |= {aliases.get(k, k): v for k, v in overrides.items()}
    hidden = kwargs[aliases.get("hidden_size", "hidden_size")]
    kwargs.setdefault("initializer_range", hidden**-0.5)
    kwargs["dtype"] = dtype
    config = config_cls(**kwargs)

    tokenizer = _tokenizer(config.max_position_embeddings)
    if config.vocab_size < len(tokenizer):
        raise ValueError(
            f"vocab_size {config.vocab_size} < {len(tokenizer)} tokenizer tokens"
        )

    try:
        from .oracle import built  # here, not at the top: compat/nnterp_side.py loads this file alone
    except ImportError:  # loaded as a lone file (compat/nnterp_side.py), where no vLLM ran
        def built(make: Any) -> Any:
            return make()

    def make() -> Any:
        torch.manual_seed(seed)
        model = model_cls(config)
        with torch.no_grad():
            _AFTER_INIT.get(architecture, lambda model: None)(model)
        return model

    # A private RNG state keeps the caller's global torch RNG untouched.
    with torch.random.fork_rng(devices=[]):
        model = built(make).to(torch.float32)
    model = model.to(getattr(torch, dtype))

    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
        if target.exists():
            shutil.rmtree(target)  # empty, or a build of other arguments
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@functools.cache
def _tokenizer_json() -> str:
    """Train the byte-level BPE once per process (about 10 ms, deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=_UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB,
        special_tokens=_SPECIAL_TOKENS,
        # All 256 bytes, so any text encodes without <unk>.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TEXT.split("\n\n"), trainer)
    return tokenizer.to_str()


def _tokenizer(max_length: int) -> Any:
    """Return a PreTrainedTokenizerFast that prepends BOS, like Llama's."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        bos_token=_BOS,
        eos_token=_EOS,
        unk_token=_UNK,
        pad_token=_PAD,
        add_bos_token=True,
        model_max_length=max_length,
    )
