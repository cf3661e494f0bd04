"""Steered generation at engine speed, from the client: each request's `Steering` travels with it.

Steering in a trace (``model.steer`` in ``for _ in tracer.iter[...]``) runs
one nnsight worker per request per step; on a GPU that costs more than the
forward (measured on an H200: 0.24 of plain eager vLLM). `generate` instead
sends each request's `Steering` with the request (``SamplingParams.extra_args``,
`vlenvoys.wire.requests.STEER_KEY`), and the worker adds it with one forward
hook on each steered block (`vlenvoys.worker.steerer`), so the values are a
trace's, bit for bit on the same kernels.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..engine.requests import check_engine, checked_prompts, tokenized_together
from ..engine.stepping import abandoned_on_error
from ..errors import InvalidWrite
from ..values.reads import unsteerable
from ..wire.requests import STEER_KEY
from ..wire.steering import entry, salt_of, text

__all__ = ["Steering", "generate"]


@dataclasses.dataclass(frozen=True)
class Steering:
    """Add ``factor * vector`` to the residual stream leaving ``layers``, as nnterp's ``steer``.

    Attributes:
        layers: A block index or several (negative count from the end); the
            stream is `layer_output`, read where a trace reads it.
        vector: ``[hidden_size]`` (or ``[1, hidden_size]``), any real dtype, any device; it is moved to
            the engine's device and cast to the model's dtype, then multiplied
            by ``factor`` there, as ``model.steer`` does.
        factor: The vector's multiplier.
        positions: Which token positions of each sequence get it: None for
            every one (the prompt's and each generated token's, at the decode
            step that feeds it), a position or a list of them (0 is the
            prompt's first token; generated token ``k`` (from 0) sits at
            ``len(prompt) + k``; positions the sequence never reaches steer
            nothing), or a ``slice`` with non-negative bounds and no step
            (``slice(len(prompt), None)``: generated tokens only).
    """

    layers: int | Sequence[int]
    vector: torch.Tensor
    factor: float = 1.0
    positions: Sequence[int] | slice | None = None

    def encode(self, model: Any) -> str:
        """The request's steering as it travels to the worker (`vlenvoys.wire.steering.text`), checked against
        ``model``.

        Raises:
            NoSuchBlock: a block that does not exist (an IndexError).
            ValueError: a vector of another shape, a factor that is not
                finite, a scaled vector with non-finite entries or entries
                beyond the square root of the dtype's largest value, or
                negative or stepped positions.
            TypeError: a vector that is not a real tensor, a factor that is
                not a number, blocks that are not ints.
        """
        return self.encode_for(model.hidden_size, model.num_layers, _dtype(model))

    def encode_for(self, hidden_size: int, num_layers: int, dtype: torch.dtype) -> str:
        """`encode` for a model known by its shape alone: ``hidden_size``, ``num_layers`` blocks, ``dtype``;
        raises as `encode` (`vlenvoys.wire.steering.entry` checks it)."""
        checked = entry(
            self.layers, self.vector, self.factor, self.positions, hidden_size=hidden_size, num_layers=num_layers,
            dtype=dtype,
        )
        return text([checked])


def _dtype(model: Any) -> torch.dtype:
    return model.vllm_entrypoint.llm_engine.model_config.dtype


def generate(
    model: Any,
    prompts: Sequence[str | Sequence[int]],
    sampling_params: Any = None,
    *,
    steering: Steering | Sequence[Steering | None] | None = None,
    progress: bool | None = True,
    use_tqdm: bool | Callable | None = None,
) -> list[Any]:
    """Generate from ``prompts`` with each request's own steering; vLLM's ``LLM.generate`` otherwise.

    Args:
        model: A model from `vlenvoys.load` (the synchronous engine).
        prompts: Strings or lists of token ids, one request each.
        sampling_params: vLLM ``SamplingParams`` (one for all, or one per
            prompt); vLLM's defaults when None. Their ``extra_args`` are kept.
        steering: One `Steering` for every request, one per prompt (None:
            that request is not steered), or None.
        progress: Show vLLM's progress bar of the requests (on by default, as for `vlenvoys.collect`;
            a trace draws none unless asked). ``False`` or None for none.
        use_tqdm: Deprecated (a DeprecationWarning): vLLM's own argument, which
            this function showed by default; when given, it is passed to vLLM as
            it is, over ``progress``.

    Returns:
        vLLM's ``RequestOutput`` of each prompt, in prompt order.

    Raises:
        ValueError, TypeError, IndexError: a `Steering` the model cannot take
            (`Steering.encode`), or a steering list of another length than
            ``prompts``; nothing is submitted then.
        InvalidWrite: a request's steered stream had NaN or infinite entries
            (a factor too large for the model's dtype): those rows were left
            unsteered and the request went on without its steering; every
            output is on the error's ``outputs``.
        RuntimeError: the engine has been shut down.
        NotImplementedError: the engine runs in ``mode="async"``, or its layer
            output is not one tensor a block hands on.

    With prefix caching on, a steered request's key/value cache is salted by
    its steering (vLLM's ``cache_salt``): it is shared only between requests
    steered alike.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    check_engine(model)
    if progress is None:  # as collect's: None, no bar
        progress = False
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be True or False (vLLM's progress bars), got {progress!r}")
    if use_tqdm is None:
        use_tqdm = progress
    else:
        warnings.warn(
            "vlenvoys.generate(use_tqdm=...) is deprecated: pass progress=True for vLLM's progress bars "
            "(False for none)",
            DeprecationWarning,
            stacklevel=2,
        )
    prompts = checked_prompts(prompts)
    if steering is None or isinstance(steering, Steering):
        steering = [steering] * len(prompts)
    steering = list(steering)
    reason = unsteerable(model)
    if reason is not None and any(each is not None for each in steering):
        # Plain generation needs no block output: it goes on where steering cannot.
        raise NotImplementedError(f"steered generation needs a block output it can write: {reason}")
    if len(steering) != len(prompts):
        raise ValueError(f"steering: {len(steering)} entries for {len(prompts)} prompts")
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        sampling_params = [sampling_params or SamplingParams()] * len(prompts)
    if not isinstance(sampling_params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in sampling_params):
        raise TypeError("sampling_params: expected vLLM SamplingParams, or a list of them (one per prompt)")
    if len(sampling_params) != len(prompts):
        raise ValueError(f"sampling_params: {len(sampling_params)} entries for {len(prompts)} prompts")
    encoded: dict[int, tuple[str, str]] = {}  # one encoding per distinct Steering object
    per_request, inputs = [], []
    for prompt, each, params in zip(prompts, steering, sampling_params, strict=True):
        if each is not None and not isinstance(each, Steering):
            raise TypeError(f"steering: expected vlenvoys.Steering or None per prompt, got {type(each).__name__}")
        options = {}
        if each is not None:
            if id(each) not in encoded:
                spec = each.encode(model)
                encoded[id(each)] = spec, salt_of(spec)
            spec, salt = encoded[id(each)]
            params = params.clone()
            params.extra_args = {**(params.extra_args or {}), STEER_KEY: spec}
            # A steered request's key/value cache is its steering's: salted, a prefix cache
            # shares it only with requests steered alike, never with unsteered ones.
            options["cache_salt"] = salt
        per_request.append(params)
        if isinstance(prompt, str):
            inputs.append({"prompt": prompt, **options})
        else:
            inputs.append(TokensPrompt(prompt_token_ids=prompt, **options))
    with abandoned_on_error(model):  # an interrupted call leaves nothing running on the engine
        outputs = model.vllm_entrypoint.generate(
            tokenized_together(model.vllm_entrypoint, inputs), per_request, use_tqdm=use_tqdm
        )
    if encoded:
        _raise_failures(model, outputs)
    return outputs


def _raise_failures(model: Any, outputs: list) -> None:
    """Raise `InvalidWrite` if the engine refused some request's steering (the outputs are on the error)."""
    ids = [output.request_id for output in outputs]
    failed = {}
    for answer in model.vllm_entrypoint.llm_engine.collective_rpc("vlenvoys_steer_failures", args=(ids,)):
        failed.update(answer)
    if failed:
        number = next(index for index, request in enumerate(ids) if request in failed)
        error = InvalidWrite(
            f"steering of {len(failed)} prompt(s) was refused on the engine, prompt {number} first: "
            f"{failed[ids[number]]}; their rows were left unsteered from there on (nothing non-finite reached "
            "the key/value cache), and the other prompts' outputs are intact (on this error's .outputs)"
        )
        error.outputs = outputs
        raise error
