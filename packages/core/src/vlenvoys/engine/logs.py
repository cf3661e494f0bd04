"""vLLM's log level, set alike by `vlenvoys.load` and the ``vlenvoys`` command: its INFO lines only when asked for."""

from __future__ import annotations

import logging
import os

__all__ = ["LEVEL", "vllm_logging"]

#: The environment variable vLLM reads its log level from, in this process (when vLLM is imported) and in every
#: engine process it starts.
LEVEL = "VLLM_LOGGING_LEVEL"

#: The value `vllm_logging` last put in `LEVEL`: one it may change again (any other value is the user's).
_set: str | None = None


def vllm_logging(verbose: bool | None = None) -> None:
    """vLLM's log at WARNING and above (quiet: its start-up and shutdown INFO lines gone), or at INFO if ``verbose``.

    Sets ``VLLM_LOGGING_LEVEL``, which the engine's processes started after
    this read, and the level of this process's ``vllm`` logger (vLLM
    configured it when it was imported). ``verbose=None`` keeps the level an
    earlier call set (the command's ``--verbose``, an earlier `load`), quiet
    if none did. A level the user chose is kept: ``VLLM_LOGGING_LEVEL`` set
    otherwise than by this function, or ``VLLM_CONFIGURE_LOGGING=0`` (the user
    configures vLLM's logging).
    """
    global _set
    if os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
        return
    current = os.environ.get(LEVEL)
    if current is None or (current == _set and verbose is not None):
        _set = os.environ[LEVEL] = "INFO" if verbose else "WARNING"
    level = os.environ[LEVEL].upper()
    logging.getLogger("vllm").setLevel(int(level) if level.isdigit() else level)
