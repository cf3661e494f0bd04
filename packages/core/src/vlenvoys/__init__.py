"""vlenvoys: nnterp's standardized values on models served by vLLM.

    import vlenvoys
    model = vlenvoys.load()            # the built-in SmolLM2-135M-Instruct
    with model.trace("The Eiffel Tower is in", temperature=0.0):
        stream = model.layers[10].layer_output.save()     # [1, tokens, hidden]
"""

from .collect import collect
from .engine import StandardizedVLLM, load, on_transformers_backend, shutdown
from .errors import DECODE_STEP, FUSED_ROUTING, GATED, NOT_ROUTED, PARALLEL, ROUTED, BlockExit, InvalidWrite, NoSuchBlock, Preempted, RawOutputWarning, ReadOnly, SkipRefused, Unavailable, UnknownArchitecture, UnsupportedVLLM
from .steer import Steering, generate
from .values import Derived, Experts, Flat, Heads, KeyValueHeads, Neurons, Pattern, Residual, Routes, argument, batched, summed, summed_output, unbatched, with_argument
from .values.envoys import (
    Attention,
    FusedLayer,
    Layer,
    Mlp,
    ParallelLayer,
    StandardEnvoy,
    TransformersAttention,
    TransformersLayer,
    TransformersMlp,
)
from .values.family import BACKBONE_NAMES, TIED_BACKBONE_NAMES, Architecture, ByConfig, Family, InstalledFamily, families
from .values.support import Support, support
from .version import __version__

__all__ = [
    "BACKBONE_NAMES",
    "DECODE_STEP",
    "FUSED_ROUTING",
    "GATED",
    "NOT_ROUTED",
    "PARALLEL",
    "ROUTED",
    "TIED_BACKBONE_NAMES",
    "Architecture",
    "Attention",
    "ByConfig",
    "Family",
    "Derived",
    "Experts",
    "Flat",
    "FusedLayer",
    "Heads",
    "InstalledFamily",
    "InvalidWrite",
    "KeyValueHeads",
    "NoSuchBlock",
    "Layer",
    "Mlp",
    "Neurons",
    "ParallelLayer",
    "Pattern",
    "Preempted",
    "BlockExit",
    "RawOutputWarning",
    "ReadOnly",
    "Residual",
    "Routes",
    "SkipRefused",
    "StandardEnvoy",
    "StandardizedVLLM",
    "Steering",
    "Support",
    "TransformersAttention",
    "TransformersLayer",
    "TransformersMlp",
    "Unavailable",
    "UnknownArchitecture",
    "UnsupportedVLLM",
    "__version__",
    "activations",
    "argument",
    "batched",
    "capturing",
    "collect",
    "families",
    "generate",
    "load",
    "on_transformers_backend",
    "shutdown",
    "summed",
    "support",
    "summed_output",
    "unbatched",
    "with_argument",
]

# nnsight mounts ``.save`` on every object when imported, and anyio then refuses to define its
# typed-attribute classes (imported by httpx's async transport, so by openai's AsyncOpenAI): an
# async client in a process that imported vlenvoys failed. They are defined here with the mount lifted.
from .serve.server import anyio_classes_first as _anyio_classes_first  # noqa: E402

_anyio_classes_first()

# The two modules the README has users reach from the package (#49): ``import vlenvoys`` then
# ``vlenvoys.activations.collect_dataset(...)`` or ``vlenvoys.capturing.fetch(...)``. Both are light (a corpus's
# optional package, datasets, is imported where a source needs it), and imported after the classes above,
# as anything that may reach anyio.
from . import activations, capturing  # noqa: E402
