"""vLLM workers that run nnsight's model runner with a family's envoys.

vLLM names its worker class by path (``worker_cls``), so one of these is
imported in every worker process: `vlenvoys.workers.cpu.CPUWorker` on vLLM's
CPU engine, `vlenvoys.workers.gpu.GPUWorker` on CUDA/ROCm. nnsight's runner
builds its own envoy tree over the loaded module with the default envoys; the
user's block runs against that tree, so the family's envoys and names are
installed there, right after the model loads, on the same interleaver.
"""

from __future__ import annotations

from typing import Any


class StandardRunner:
    """Mixin for nnsight's runner: rebuilds its envoy tree with the model's family declarations."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        from ..engine import StandardizedVLLM
        from ..family import resolve

        _, _, architecture = resolve(self.model_config.hf_config.architectures)
        plain = self.nnsight_model
        interleaver = plain.interleaver
        # The plain tree registered every module; a module already registered
        # would become an alias of the plain envoy instead of getting ours.
        interleaver.envoys.clear()
        model = StandardizedVLLM(self.get_model(), interleaver=interleaver, architecture=architecture)
        model.tokenizer = plain.tokenizer
        self.nnsight_model = model
        self.nnsight_persistent_objects = model._remoteable_persistent_objects()
