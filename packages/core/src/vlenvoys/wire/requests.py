"""What a request carries in ``SamplingParams.extra_args`` for the worker: the one table of keys both sides read."""

from __future__ import annotations

import os
from typing import Any

__all__ = [
    "COLLECT_GENERATED_KEY", "COLLECT_ID_KEY", "COLLECT_KEY", "EAGER_KEY", "PRIVATE", "SITED_GRAPHS", "SITES_KEY",
    "STEER_KEY", "carries_nnsight_work", "sited_graphs_asked",
]

#: ``SamplingParams.extra_args`` key whose value names the collector that reads the request.
COLLECT_KEY = "vlenvoys_collect"
#: ``SamplingParams.extra_args`` key of the id the caller takes the request's values by, where it
#: cannot know the engine's request id (`vlenvoys serve`: vLLM's server names its requests itself).
COLLECT_ID_KEY = "vlenvoys_collect_id"
#: ``SamplingParams.extra_args`` key: read the request's decode steps' rows too, not its prompt's alone
#: (each generated token fed back, at its position; an engine replaying graphs of decode steps runs no hooks there).
COLLECT_GENERATED_KEY = "vlenvoys_collect_generated"
#: ``SamplingParams.extra_args`` key holding a request's steering (`vlenvoys.wire.steering`).
STEER_KEY = "vlenvoys_steer"
#: vLLM's ``additional_config`` key (an engine's, not a request's): a graph engine's declared sites, {value: blocks},
#: for the workers' sited graphs (`vlenvoys.worker.sited`).
SITES_KEY = "vlenvoys_sites"
#: The environment variable that turns sited graphs on (`vlenvoys.worker.sited`; off by default until the gate has
#: measured them): read by the client, which picks the model runner they are captured on, and by the engine's
#: processes, which inherit it.
SITED_GRAPHS = "VLENVOYS_SITED_GRAPHS"
#: ``SamplingParams.extra_args`` key: the request's block waits where a sited graph has no break (``input_ids``,
#: ``skip_layer``, ``tracer.cache()``), so its steps run eagerly (`vlenvoys.worker.sited`).
EAGER_KEY = "vlenvoys_eager"
#: Registrations named with this prefix run only on requests that list them in ``edits=[...]``.
PRIVATE = "vlenvoys-private:"


def carries_nnsight_work(params: Any) -> bool:
    """Whether a request with these sampling params carries a block or names edits (its workers may hold saves)."""
    extra = getattr(params, "extra_args", None) or {}
    return "nnsight_mediator" in extra or "nnsight_edits" in extra


def sited_graphs_asked() -> bool:
    """Whether this process's environment turns sited graphs on (``VLENVOYS_SITED_GRAPHS`` set, and not to 0)."""
    return os.environ.get(SITED_GRAPHS, "").strip() not in ("", "0")
