"""The client's side of vLLM's engine: the model object, its loading, its processes and its step loop.

- `model`: `StandardizedVLLM`, an nnsight ``VLLM`` with the family's envoys (the worker builds the same tree);
- `loading`: `load` and the engine settings it chooses;
- `processes`: the engine's processes started in a group of their own, the worker class, `shutdown`;
- `stepping`: the synchronous engine's step (saves asked for only where there can be some), and the wind-up
  of an interrupted call;
- `traces`: a trace's tracer (one forward pass unless it asks for more; a pointer where a block's raw output is read);
- `logs`: vLLM's log level, quiet unless asked for (`load` and the command alike);
- `requests`: prompts checked, cache salts;
- `handover`, `saves`, `sources`: rows and saves read back from the worker, trace requests' pickling.
"""

from .loading import CPU_KV_CACHE_BYTES, load
from .model import StandardizedVLLM, on_transformers_backend
from .processes import shutdown

__all__ = ["CPU_KV_CACHE_BYTES", "StandardizedVLLM", "load", "on_transformers_backend", "shutdown"]
