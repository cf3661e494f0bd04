"""Many prompts' values at the engine's own speed, from the client: `vlenvoys.collect` and activation datasets.

- `prompts`: `collect` (one hook per module per step on the worker, or a block installed for the run);
- `rows`: a collector's take as each request's values;
- `activations`: a corpus cut into windows, its values streamed to shards (`collect_dataset`, `Activations`);
- `exports`: such a folder of shards in another tool's layout (SAELens' cached activations: `export`).
"""

from .prompts import collect

__all__ = ["collect"]
