"""The requests the client adds to the engine: prompts checked, tokenized together, each with a cache salt of its own
where it must."""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

__all__ = ["check_engine", "checked_prompts", "salted", "shared_call_path", "tokenized_together"]

#: A tokenizer's call path: where a class defines one of these outside transformers' shared tokenizer code
#: (and vLLM's wrappers, which delegate), it may prepare text in Python, and is called as it is.
CALL_PATH = ("__call__", "_call_one", "_encode_plus", "_batch_encode_plus", "encode", "tokenize", "prepare_for_tokenization")
#: Texts of a renderer's first batch also tokenized one by one, as vLLM does: a difference ends batching there.
CHECKED_PROMPTS = 8
#: renderer -> its `_Batching`, or False where its texts go to vLLM one by one.
_batching: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class _Batching:
    """A renderer's settings for a completion's text, read once: they are fixed for the renderer's life."""

    params: Any  # vLLM's TokenizeParams: its checks of a text, the tokenizer's arguments
    tokenizer: Any
    kwargs: dict
    checked: bool = False  # a first batch gave the ids of its texts tokenized one by one


def _batching_of(renderer: Any) -> _Batching | None:
    found = _batching.get(renderer)
    if found is None:
        try:
            params = renderer.default_cmpl_tok_params
            tokenizer = renderer.get_tokenizer()
            found = _Batching(params, tokenizer, params.get_encode_kwargs())
            usable = (getattr(renderer, "mm_processor", None) is None and params.truncate_prompt_tokens is None
                      and not getattr(params, "return_token_offsets", False)
                      and getattr(tokenizer, "is_fast", False) and shared_call_path(tokenizer))
        except Exception:  # noqa: BLE001 - another vLLM's renderer, or none to tokenize with: vLLM tokenizes each
            usable = False
        _batching[renderer] = found = found if usable else False
    return found or None


def shared_call_path(tokenizer: Any) -> bool:
    """Whether every method of ``tokenizer``'s call path is transformers' shared code or a vLLM wrapper's."""
    for name in CALL_PATH:
        owner = next((cls for cls in type(tokenizer).__mro__ if name in vars(cls)), None)
        module = getattr(owner, "__module__", "") or ""
        if owner is not None and not module.startswith(("transformers.tokenization_utils", "vllm.")):
            return False
    return True


def tokenized_together(engine: Any, prompts: list) -> list:
    """``prompts`` with each text's token ids, from one call of the engine's tokenizer for all of them.

    vLLM tokenizes a request's text alone as the request is added. The Python
    of each tokenizer call (a dict of lists built per call) costs as much as
    the tokenizing: a quarter of a 64-invoke trace's client time on an H100
    (benchmarks/results/trace-cost-5b257ef-h100.md). One call for a trace's,
    a collection's or a generation's texts gives each the ids vLLM would:
    vLLM's own settings for a completion's text (the renderer's
    ``default_cmpl_tok_params``: its checks of the text, then the tokenizer's
    arguments), a fast tokenizer whose call path is transformers' shared code,
    and each renderer's first batch checked against the texts tokenized one
    by one (a difference, and it never batches again). The ids go in a
    ``TokensPrompt`` beside the text (``prompt``), as vLLM's renderer builds it.

    ``engine``: a ``vllm.LLM`` or its ``LLMEngine``. ``prompts``: strings,
    vLLM prompt dicts (only ``{"prompt": text}`` with at most a ``cache_salt``
    is tokenized) or token ids. What is not tokenized here goes as it came, for
    vLLM to tokenize or refuse by itself: token ids and other dicts, a text
    vLLM's checks refuse (too long), a lone text, a multimodal model's, a
    tokenizer of its own call path, a vLLM without these settings.
    """
    texts = {index: text for index, prompt in enumerate(prompts) if (text := _text_of(prompt)) is not None}
    renderer = getattr(engine, "renderer", None)
    batching = None if len(texts) < 2 or renderer is None else _batching_of(renderer)
    if batching is None:
        return prompts
    checked = {}
    for index, text in texts.items():
        try:  # vLLM's checks of a text (its length in characters, lowercasing where the model asks for it)
            checked[index] = batching.params.apply_pre_tokenization(batching.tokenizer, {"prompt": text})["prompt"]
        except Exception:  # noqa: BLE001 - vLLM refuses it by itself, in its place among the requests
            continue
    if len(checked) < 2:
        return prompts
    tokenizer, kwargs = batching.tokenizer, batching.kwargs
    ids = tokenizer(list(checked.values()), **kwargs)["input_ids"]
    if not batching.checked:
        first = list(checked.values())[:CHECKED_PROMPTS]
        same = [tokenizer(text, **kwargs)["input_ids"] for text in first] == ids[: len(first)]
        _batching[renderer] = replace(batching, checked=True) if same else False
        if not same:
            return prompts
    tokenized = list(prompts)
    for index, token_ids in zip(checked, ids, strict=True):
        prompt = tokenized[index]
        tokenized[index] = {**(prompt if isinstance(prompt, dict) else {}), "prompt": checked[index],
                            "prompt_token_ids": list(token_ids)}
    return tokenized


def _text_of(prompt: Any) -> str | None:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str) and set(prompt) <= {"prompt", "cache_salt"}:
        return prompt["prompt"]
    return None


EMPTY = "prompt is empty (no tokens): a trace reads at least one token"


def refuse_empty(engine: Any, prompts: list) -> None:
    """Raise ValueError naming the first of a trace's ``prompts`` that has no tokens, before any is sent.

    vLLM refuses such a request by itself, in words of its own; a text is
    tokenized here only when it is blank (an empty text is one token where the
    tokenizer adds a BOS, as on transformers, and none where it adds nothing).
    """
    for index, prompt in enumerate(prompts):
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        text = _text_of(prompt)
        if ids is None and text is not None and not text.strip():
            ids = engine.get_tokenizer()(text)["input_ids"]
        if ids is not None and len(ids) == 0:
            raise ValueError(f"invoke {index}'s {EMPTY}")


def salted(prompt: Any, kind: str, unique: str | None = None) -> Any:
    """``prompt`` (a string or a vLLM prompt dict) with a cache salt of its own: its key/value cache is its alone.

    ``unique``: a name no other request carries (a run's random id and the
    prompt's index), which spares a random UUID per request; default: a new UUID.

    With prefix caching on, a traced or collected request never reads a cached
    prefix (it would skip the prefix's forward, and its values would be short)
    and never leaves one that a plain request could read (its edits would
    spill into another request's output). A salt only this request carries
    keeps it out of the cache both ways; plain requests share the cache as on
    stock vLLM. A salt the caller set is kept.
    """
    if isinstance(prompt, str):
        prompt = {"prompt": prompt}
    elif not isinstance(prompt, dict) or prompt.get("cache_salt") is not None:
        return prompt
    return {**prompt, "cache_salt": f"vlenvoys-{kind}-{unique or uuid.uuid4().hex}"}


def checked_prompts(prompts: Any) -> list[str | list[int]]:
    if isinstance(prompts, str):
        raise TypeError("prompts is a list of prompts, got one string; pass [prompt]")
    checked = []
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            if isinstance(prompt, torch.Tensor):
                prompt = prompt.tolist()
            if not isinstance(prompt, Sequence):
                kind = type(prompt).__name__
                raise TypeError(f"prompt {index} is a {kind}; a prompt is a string or a list of token ids")
            wrong = next((token for token in prompt if not isinstance(token, int) or isinstance(token, bool)), None)
            if wrong is not None:
                raise TypeError(f"prompt {index} holds {wrong!r}, a {type(wrong).__name__}; token ids are ints")
            prompt = list(prompt)
        if len(prompt) == 0:
            raise ValueError(f"prompt {index} is empty")
        checked.append(prompt)
    return checked


def check_engine(model: Any) -> None:
    if getattr(model, "_async_engine", False):
        raise NotImplementedError(
            "collect drives the synchronous engine; load the model without mode='async' "
            "(on an async engine, trace the prompts instead)"
        )
    if getattr(model, "vllm_entrypoint", None) is None:
        raise RuntimeError("this model's engine is not running (it was shut down)")
