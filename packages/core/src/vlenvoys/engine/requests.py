"""The requests the client adds to the engine: prompts checked, each with a cache salt of its own where it must."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["check_engine", "checked_prompts", "salted"]


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
