"""The "cpu" backend's compiler: none (Triton's interpreter runs the kernels; see the package's docstring)."""

from __future__ import annotations

from triton.backends.compiler import BaseBackend

__all__ = ["InterpreterBackend"]


class InterpreterBackend(BaseBackend):
    """Compiles nothing: under ``TRITON_INTERPRET=1`` a kernel is never compiled."""

    @staticmethod
    def supports_target(target):
        return getattr(target, "backend", None) == "cpu"

    def hash(self) -> str:
        return "vlenvoys-triton-interpreter"

    def _refused(self, *args, **kwargs):
        raise NotImplementedError("this Triton 'cpu' backend only interprets (TRITON_INTERPRET=1): it compiles nothing")

    parse_options = add_stages = load_dialects = get_module_map = _refused
