"""Tests of the model-runner choice (`vlenvoys.engine.loading.model_runner`) without leaking it into later tests."""

from __future__ import annotations

from typing import Any

__all__ = ["kept_runner_choice"]


def kept_runner_choice(monkeypatch: Any) -> None:
    """Undo, after the test, what `model_runner` sets behind ``monkeypatch``'s back.

    `model_runner` writes ``VLLM_USE_V2_MODEL_RUNNER`` into ``os.environ`` and
    remembers the value it wrote (``_runner_set``), so that it can tell its own
    value from the user's. monkeypatch undoes only what it set itself: a test
    could leave the variable at one value and the memory at another, and the
    next engine of the session was refused as if the user had asked for the
    other runner (on an H100, every graph test after the runner tests). Both
    go back to what they were before the test, and the test starts as a fresh
    process would: the variable unset, and nothing set by `model_runner`.
    """
    import os

    from vlenvoys.engine import loading

    monkeypatch.setattr(loading, "_runner_set", None)
    monkeypatch.setenv(loading.V2_RUNNER, os.environ.get(loading.V2_RUNNER, ""))  # recorded, to be put back
    monkeypatch.delenv(loading.V2_RUNNER)
