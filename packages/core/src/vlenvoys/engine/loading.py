"""`vlenvoys.load`: vLLM started on a checkpoint with its family's envoys, and the engine settings it chooses."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ..errors import UnsupportedVLLM
from ..values.family import config_of, resolve_checkpoint
from ..weights import smollm2_path
from ..wire.requests import SITED_GRAPHS, SITES_KEY, sited_graphs_asked
from .logs import vllm_logging
from .model import StandardizedVLLM
from .processes import RUNNER_CHOICE, has_v1_runner, runner_choice
from .sites import declared

__all__ = [
    "CPU_KV_CACHE_BYTES", "PIPELINE_REFUSED", "TRITON_F32", "V2_RUNNER", "cpu_ranks", "engine_defaults", "float32_kernels", "graph_defaults",
    "load", "model_runner",
]

#: KV-cache size the CPU engine reserves unless told otherwise: vLLM's default
#: fraction of a NUMA node is more than a small machine has free.
CPU_KV_CACHE_BYTES = 1 << 30
#: Why pipeline parallelism is refused, by `load` and ``vlenvoys serve`` alike.
PIPELINE_REFUSED = (
    "pipeline parallelism (pipeline_parallel_size > 1) is not served: vlenvoys reads, steers and collects on workers "
    "that each run every block (tensor parallelism splits a block across ranks), while pipeline stages hold "
    "disjoint blocks and nnsight reports a trace's saves from the first stage only; use tensor_parallel_size"
)
#: vLLM's choice of model runner: 1 its V2 runner, 0 its V1 runner, the one vlenvoys' workers instrument.
V2_RUNNER = "VLLM_USE_V2_MODEL_RUNNER"


def load(
    model: str | os.PathLike | None = None,
    *,
    cuda_graphs: bool = False,
    sites: Mapping[str, Any] | None = None,
    verbose: bool | None = None,
    **engine_kwargs: Any,
) -> StandardizedVLLM:
    """Start vLLM on ``model`` and return it ready to trace with the standard values.

    Args:
        model: A local checkpoint folder or a hub name; None loads the built-in
            real model, SmolLM2-135M-Instruct (see `vlenvoys.weights`).
        **engine_kwargs: vLLM engine arguments (``dtype``, ``max_model_len``,
            ``tensor_parallel_size``, ...) and nnsight ``VLLM`` arguments. On
            every platform the dtype defaults to a local checkpoint's own
            (float32 where it names none; vLLM would otherwise run float32
            checkpoints in half precision) and to float32 for a hub name, the
            oracle's precision (pass ``dtype="auto"`` for the hub config's); on a GPU a float32 engine's Triton kernels run
            in full float32 (see `float32_kernels`); on the CPU engine the KV
            cache defaults to 1 GiB. Prefix caching is on, as on stock vLLM, for
            plain requests: a traced, collected or steered request carries a
            cache salt (`salted`), so it never reads a cached prefix (its
            values would be short) nor leaves one (its edits would spill).
        cuda_graphs: Replay CUDA graphs of the decode steps, as plain vLLM
            does, for `vlenvoys.generate`'s steering and `vlenvoys.collect` at
            engine speed. The forward is captured as it runs eagerly (vLLM's
            compilation mode ``NONE``, graphs of pure decode steps only:
            ``FULL_DECODE_ONLY``), with the steering hooks of every block in
            it; prefill steps run eagerly. Traces, whose hooks a replay would
            skip, run on such an engine only at the ``sites`` declared. On the
            CPU engine, which has no graphs, it changes nothing but that.
        sites: With ``cuda_graphs=True``, the standard values a trace may read
            or write, and at which blocks: ``{"layer_output": "all",
            "attention_output": [3, 7]}`` (`vlenvoys.engine.sites`). A step
            that runs a trace's block runs eagerly, so every prefill and decode
            step serves its rows; a trace reaching a site outside these is
            refused by name (ValueError) before any of its requests is sent.
            Without ``sites`` such an engine refuses traces (NotImplementedError).
        verbose: vLLM's INFO log (its engine settings, start-up and shutdown
            lines) shown (True) or not (False; its warnings stay); None keeps
            what an earlier call or the ``vlenvoys`` command chose, quiet at
            first (`vlenvoys.engine.logs.vllm_logging`; ``VLLM_LOGGING_LEVEL`` set
            in the environment wins).

    Raises:
        UnknownArchitecture: no installed family declares the model's architecture.
        UnsupportedVLLM: the installed vLLM is outside the family's verified
            range (``VLENVOYS_ALLOW_UNVERIFIED_VLLM=1`` warns instead), or the
            model runner chosen cannot run here (`model_runner`).
        ValueError: ``sites`` without ``cuda_graphs=True``, or naming no standard
            value (`vlenvoys.engine.sites.declared`); ``pipeline_parallel_size`` above 1; ``cuda_graphs=True`` with ``enforce_eager``, or with a
            compilation mode other than ``NONE`` (torch.compile would trace
            away the Python hooks that serve the values); nnsight's ``taps=``;
            ``sites`` with sited graphs asked for (``VLENVOYS_SITED_GRAPHS=1``)
            on vLLM's V2 model runner, which they are not captured on.
    """
    if engine_kwargs.get("taps"):
        # Measured on an H200 (nnsight 0.8.1): under taps= a 6-step generation's trace recorded 1 row,
        # decode-step steering vanished, and the standard values are read where no tap is.
        raise ValueError(
            "vlenvoys does not run nnsight's taps=: its graph replays skip the reads and edits of every location "
            "without a tap, so a trace would serve fewer rows than it asked for. Load with cuda_graphs=True for "
            "steered generation and collection with CUDA graphs, or without either for traces"
        )
    if int(engine_kwargs.get("pipeline_parallel_size") or 1) > 1:
        raise ValueError(PIPELINE_REFUSED)
    if sites is not None and not cuda_graphs:
        raise ValueError("sites= declares what a trace may read on an engine that replays CUDA graphs: load with "
                         "cuda_graphs=True, or drop sites (an engine without graphs serves every value to traces)")
    vllm_logging(verbose)  # before vLLM logs this process's settings and starts the engine's processes
    if cuda_graphs:
        graph_defaults(engine_kwargs)
    if model is None:
        model = smollm2_path()
    model = str(model)
    installed, name, architecture = resolve_checkpoint(model, engine_kwargs)
    declared_sites = None if sites is None else declared(sites, block_count(model, engine_kwargs.get("hf_overrides")))
    if declared_sites is not None:  # for the workers' sited graphs (`vlenvoys.worker.sited`)
        extra = dict(engine_kwargs.get("additional_config") or {})
        extra[SITES_KEY] = {name: sorted(blocks) for name, blocks in declared_sites.items()}
        engine_kwargs["additional_config"] = extra
    if declared_sites is not None and sited_graphs_asked() and runner_choice() == "v2":
        raise ValueError(
            f"{SITED_GRAPHS}=1: sited graphs are captured through vLLM's V1 model runner, and this engine would run "
            f"its V2 runner ({RUNNER_CHOICE}=v2, or a vLLM without V1): unset {SITED_GRAPHS} (traced steps then run "
            f"eagerly), or unset {RUNNER_CHOICE} on a vLLM that has V1 (0.32, 0.33)"
        )
    model_runner()
    engine_defaults(model, engine_kwargs)
    # On, as on stock vLLM: plain requests share cached prefixes; traced, collected and steered
    # requests carry cache salts of their own (`salted`), so none of them reads or leaves one.
    engine_kwargs.setdefault("enable_prefix_caching", True)
    with cpu_ranks(engine_kwargs.get("tensor_parallel_size", 1)), float32_kernels(engine_kwargs["dtype"]):
        loaded = StandardizedVLLM(
            model, dispatch=True, architecture=architecture, cuda_graphs=bool(cuda_graphs), **engine_kwargs
        )
    loaded.family, loaded.architecture_name = installed, name
    loaded.sites = declared_sites
    # The keys each envoy has as the model is handed over, as the worker's have them (`_travels_by_path`).
    loaded._built_keys = {}
    loaded._built_keys.update((envoy.path, frozenset(envoy.__dict__)) for envoy in loaded.modules())
    return loaded


def block_count(model: str, overrides: Any = None) -> int:
    """How many decoder blocks checkpoint ``model`` has, read from its config before any engine starts (or from
    vLLM's ``hf_overrides``, where a dict of them names ``num_hidden_layers``)."""
    if isinstance(overrides, dict) and isinstance(overrides.get("num_hidden_layers"), int):
        return overrides["num_hidden_layers"]
    config = config_of(model)
    if isinstance(config, dict):
        text = config.get("text_config") or config
        count = text.get("num_hidden_layers", text.get("n_layer", text.get("num_layers")))
    else:
        count = config.get_text_config().num_hidden_layers
    if not isinstance(count, int):
        raise ValueError(f"{model}: its config names no number of blocks (num_hidden_layers), which sites= needs")
    return count


#: The value `model_runner` last gave ``VLLM_USE_V2_MODEL_RUNNER``: an engine on V1 (sited graphs) after one on V2
#: in the same process found "1" there and took it for the user's. On an H100, in one pytest session.
_runner_set: str | None = None


def model_runner() -> None:
    """Ask vLLM, for the engines this process starts, for the model runner vlenvoys' worker instruments there.

    vLLM reads its choice from ``VLLM_USE_V2_MODEL_RUNNER`` in each of its
    processes, which inherit it from this one (``vlenvoys serve`` starts vLLM's
    server without nnsight's client, so this is where its choice is made too).
    vlenvoys' own choice (`vlenvoys.engine.processes.runner_choice`: V2 on
    CUDA and where vLLM has no other, V1 on the CPU engine and for sited
    graphs, or what ``VLENVOYS_MODEL_RUNNER`` says): ``VLLM_USE_V2_MODEL_RUNNER``
    is set to match, and a value that contradicts it is refused.

    Raises:
        UnsupportedVLLM: ``VLLM_USE_V2_MODEL_RUNNER`` contradicts the choice,
            V1 is chosen and this vLLM has no V1 runner, or V2 is chosen and
            vLLM found no Triton backend for the device.
    """
    global _runner_set
    chosen = os.environ.get(V2_RUNNER, "").strip()
    if chosen == _runner_set:  # set here for an earlier engine of this process, not asked for by the user
        chosen = ""
    if runner_choice() == "v2":
        if chosen not in ("", "1"):
            raise UnsupportedVLLM(
                f"{V2_RUNNER}={chosen} asks vLLM for its V1 model runner, while vlenvoys runs V2 here (its default on "
                f"CUDA, where vLLM has no V1, or as {RUNNER_CHOICE}=v2 asks): set {RUNNER_CHOICE}=v1 for V1 where vLLM "
                f"has it, or unset {V2_RUNNER} (load and serve choose the runner)"
            )
        from vllm.triton_utils import HAS_TRITON

        if not HAS_TRITON:  # vLLM's own refusal came from deep in its config, after nnsight had started building
            raise UnsupportedVLLM(
                f"vLLM's V2 model runner ({RUNNER_CHOICE}=v2) runs Triton kernels, and vLLM found no Triton backend for "
                f"this device (vLLM's CPU engine needs triton-cpu): unset {RUNNER_CHOICE} to run its V1 runner"
            )
        os.environ[V2_RUNNER] = _runner_set = "1"
        return
    if not has_v1_runner():
        import vllm

        raise UnsupportedVLLM(
            f"{RUNNER_CHOICE}=v1 asks for vLLM's V1 model runner, which vLLM {vllm.__version__} no longer has (0.33 is "
            f"the last): unset {RUNNER_CHOICE} to run its V2 runner, or pip install 'vllm>=0.32,<0.34'"
        )
    if chosen in ("", "0"):  # vLLM reads int(value): an empty one would stop its engine
        os.environ[V2_RUNNER] = _runner_set = "0"
    else:
        raise UnsupportedVLLM(
            f"{V2_RUNNER}={chosen} asks vLLM for its V2 model runner while vlenvoys runs its V1 runner: unset it "
            f"({V2_RUNNER}=0 is chosen for you), or set {RUNNER_CHOICE}=v2"
        )


def graph_defaults(engine_kwargs: dict) -> None:
    from vllm.config import CompilationConfig, CompilationMode

    if "enforce_eager" in engine_kwargs:
        raise ValueError("cuda_graphs=True replays graphs; drop enforce_eager (or load without cuda_graphs)")
    config = engine_kwargs.get("compilation_config")
    if config is None:
        config = {}
    if isinstance(config, dict):
        config = {"mode": CompilationMode.NONE, "cudagraph_mode": "FULL_DECODE_ONLY", **config}
        mode = config["mode"]
    else:
        mode = config.mode if isinstance(config, CompilationConfig) else config  # vLLM also takes a mode alone
    if _compilation_mode(mode) != CompilationMode.NONE:
        raise ValueError(
            f"cuda_graphs=True captures the eager forward (compilation mode NONE), got mode {mode!r}: "
            "torch.compile would trace away the Python hooks that steer and read the values"
        )
    engine_kwargs["compilation_config"] = config


def _compilation_mode(mode: Any) -> Any:
    """vLLM's ``CompilationMode`` named by ``mode`` (a member, its number, or its name as a string); None if none."""
    from vllm.config import CompilationMode

    if isinstance(mode, str):
        if mode.upper() in CompilationMode.__members__:
            return CompilationMode[mode.upper()]
        mode = int(mode) if mode.isdigit() else mode
    try:
        return CompilationMode(mode)
    except ValueError:
        return None


def engine_defaults(model: str, engine_kwargs: dict) -> None:
    from vllm.platforms import current_platform

    # vLLM downcasts float32 checkpoints to half precision unless told otherwise
    # (bfloat16 on the CPU, float16 or bfloat16 on a GPU): keep the checkpoint's
    # own dtype, on every platform, and float32 where it names none or the model is a hub name (read by vLLM).
    config = Path(model) / "config.json"
    settings = json.loads(config.read_text()) if config.is_file() else {}
    engine_kwargs.setdefault("dtype", settings.get("dtype") or settings.get("torch_dtype") or "float32")
    if current_platform.is_cpu() and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        engine_kwargs.setdefault("kv_cache_memory_bytes", CPU_KV_CACHE_BYTES)


#: Triton's default precision for a dot product of float32 inputs (``tl.dot``).
TRITON_F32 = "TRITON_F32_DEFAULT"


@contextlib.contextmanager
def float32_kernels(dtype: Any) -> Iterator[None]:
    """Run a float32 engine's Triton kernels in full float32, where the user chose nothing.

    vLLM's Triton attention computes its dot products with ``tl.dot``, which
    on an NVIDIA GPU rounds float32 inputs to TF32 (10 bits of mantissa)
    unless told otherwise. Measured on an H200 (tiny Llama, float32): with
    TF32 dots the stream is 1.7e-3 away from transformers' (5.6e-4 of its
    magnitude) from block 1 on; with ``TRITON_F32_DEFAULT=ieee``, which makes
    those dots full float32, every value of every family is within 3e-6 of
    its magnitude, as on the CPU engine (another attention backend set by
    environment variable changed nothing: its kernels are Triton's too). vLLM's
    engine and worker processes inherit it when they start; this process's
    environment is restored afterwards. Half-precision engines are untouched.
    """
    from vllm.platforms import current_platform

    if str(dtype).removeprefix("torch.") != "float32" or current_platform.is_cpu() or os.environ.get(TRITON_F32):
        yield
        return
    os.environ[TRITON_F32] = "ieee"
    try:
        yield
    finally:
        del os.environ[TRITON_F32]


@contextlib.contextmanager
def cpu_ranks(ranks: int) -> Iterator[None]:
    """Give each CPU rank its own cores while the engine starts, where the user set none.

    vLLM's CPU engine binds one rank per NUMA node and refuses more ranks
    than nodes; a one-node machine (a laptop, a 2-core CI runner) can still
    run two ranks with the allowed cores split between them
    (``VLLM_CPU_OMP_THREADS_BIND="0|1"``). The worker processes inherit the
    setting; this process's environment is restored afterwards.
    """
    from vllm.platforms import current_platform

    name = "VLLM_CPU_OMP_THREADS_BIND"
    if ranks <= 1 or not current_platform.is_cpu() or os.environ.get(name, "auto") != "auto":
        yield
        return
    from vllm.utils.cpu_resource_utils import get_visible_memory_node

    if len(get_visible_memory_node()) >= ranks:  # vLLM's own binding works: one node per rank
        yield
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        raise ValueError(f"tensor_parallel_size={ranks} needs at least {ranks} CPU cores; this process may use {len(cores)}")
    share = len(cores) // ranks
    groups = [cores[rank * share : (rank + 1) * share] for rank in range(ranks)]
    os.environ[name] = "|".join(",".join(map(str, group)) for group in groups)
    try:
        yield
    finally:
        del os.environ[name]
