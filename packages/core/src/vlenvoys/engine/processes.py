"""The engine's processes from the client: how they start (spawned, in a process group of their own, with the
worker class for the platform), how a Ctrl-C is held while work on them must not stop half done, and how they stop."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

import psutil
from nnsight.modeling.vllm import VLLM

from ..wire.requests import sited_graphs_asked
from ..wire.shm import sweep
from .handover import SAVES_MAPS

__all__ = [
    "RUNNER_CHOICE", "interrupts_held", "interrupts_held_while_starting", "interrupts_stay_with_the_caller",
    "has_v1_runner", "runner_choice", "shutdown", "spawn_on_a_gpu", "worker_class",
]

#: The environment variable that chooses vLLM's model runner: ``v1`` or ``v2`` (#50). Unset, `runner_choice` decides.
RUNNER_CHOICE = "VLENVOYS_MODEL_RUNNER"


def has_v1_runner() -> bool:
    """Whether the installed vLLM has its V1 model runner (``vllm.v1.worker.gpu_model_runner``; 0.33 is the last)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm.v1.worker.gpu_model_runner")
    return spec is not None and spec.origin is not None  # not the worker's stand-in (`vlenvoys.worker.v1_stand_in`)


def runner_choice() -> str:
    """The model runner this process's engines run: ``"v1"`` or ``"v2"``, as ``VLENVOYS_MODEL_RUNNER`` says;
    unset, ``"v2"`` on a vLLM without V1 (0.34) and on a CUDA device (vLLM's own default there, which generates
    faster: benchmarks/results/rows-v2-5d60eab-h100.json), unless ``VLENVOYS_SITED_GRAPHS`` asks for sited graphs,
    which are captured through V1's seams alone (`vlenvoys.worker.sited`); ``"v1"`` elsewhere (the CPU engine's V2
    needs triton-cpu).

    Raises:
        ValueError: ``VLENVOYS_MODEL_RUNNER`` is neither ``v1`` nor ``v2``.
    """
    chosen = os.environ.get(RUNNER_CHOICE, "").strip().lower()
    if chosen not in ("", "v1", "v2"):
        raise ValueError(f"{RUNNER_CHOICE}={chosen!r}: set it to v2 (vLLM's V2 model runner) or v1, or unset it")
    if chosen:
        return chosen
    if not has_v1_runner():
        return "v2"
    from vllm.platforms import current_platform

    return "v2" if current_platform.is_cuda() and not sited_graphs_asked() else "v1"


def worker_class() -> str:
    """The vLLM worker class for the platform vLLM reports: nnsight's runner on CPU or GPU."""
    from vllm.platforms import current_platform

    v2 = runner_choice() == "v2"
    if current_platform.is_cpu():
        return "vlenvoys.worker.v2.cpu.CPUWorker" if v2 else "vlenvoys.worker.cpu.CPUWorker"
    if current_platform.is_cuda():
        return "vlenvoys.worker.v2.gpu.GPUWorker" if v2 else "vlenvoys.worker.gpu.GPUWorker"
    if v2:
        raise NotImplementedError(
            f"{RUNNER_CHOICE}=v2 is served on vLLM's CPU and CUDA engines; unset it on {current_platform.device_name!r}"
        )
    if current_platform.is_cuda_alike():
        return "vlenvoys.worker.gpu.GPUWorker"
    raise NotImplementedError(
        f"vlenvoys runs on vLLM's CPU and CUDA/ROCm engines; this vLLM reports platform "
        f"{current_platform.device_name!r}, for which nnsight has no model runner"
    )


@contextlib.contextmanager
def interrupts_held_while_starting() -> Iterator[list[float]]:
    """Hold a SIGINT that comes while vLLM starts its engine; the list yielded says whether one came.

    vLLM's start-up waits in ZeroMQ polls, and pyzmq drops a KeyboardInterrupt
    raised there by the signal's handler (it retries the poll): a Ctrl-C
    during `load` was lost, or left the caller and the engine each waiting for
    the other. So the handler only notes it here, vLLM finishes starting, and
    the caller (`_load`) shuts the engine down and raises KeyboardInterrupt.
    Off the main thread (no signal reaches it) nothing changes.
    """
    with interrupts_held("vlenvoys: interrupted; the engine is shut down as soon as it has started") as heard:
        yield heard


@contextlib.contextmanager
def interrupts_held(message: str) -> Iterator[list[int]]:
    """Note a SIGINT that comes inside the block instead of raising KeyboardInterrupt; the list yielded holds them.

    For work that must not stop half done: an engine's start, and the calls
    that wind up an interrupted request (a second Ctrl-C there left requests
    on the engine, and a thread still calling it beside the caller's next
    call). ``message`` goes to stderr at the first one. On a thread other than
    the main one (no signal reaches it) nothing changes.
    """
    heard: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield heard
        return

    def hold(signum: int, frame: Any) -> None:
        if not heard:
            print(message, file=sys.stderr, flush=True)
        heard.append(signum)

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield heard
    finally:
        signal.signal(signal.SIGINT, previous)


#: True while `interrupts_stay_with_the_caller` starts an engine (read in a forked child, see `_own_group`).
_STARTING_ENGINE = False


@contextlib.contextmanager
def interrupts_stay_with_the_caller() -> Iterator[None]:
    """Start vLLM's engine processes inside the block in a process group of their own: an interrupt stops the caller alone.

    A terminal's Ctrl-C (and Jupyter's interrupt) sends SIGINT to the whole
    foreground process group, and vLLM's engine core and workers shut down on
    it: the caller's next call raised ``EngineDeadError``. An engine process
    started here leads a process group of its own (its workers join it), so
    the interrupt reaches the caller alone, where it is a KeyboardInterrupt;
    the engine stops on `shutdown` or the caller's exit, as before. Neither a
    blocked nor an ignored SIGINT would do: a spawned child starts with an
    empty signal mask, and vLLM's processes set their own SIGINT handlers.

    Out of the caller's group, the engine no longer hears the signals that
    ended it with its caller (a closed terminal's SIGHUP, a Ctrl-C that ends
    the program), and vLLM's engine process does not notice its caller's exit:
    a caller killed outright would leave the engine holding its memory. So
    each engine process also watches its parent (`ORPHAN_WATCH`) and
    shuts down (SIGTERM, which vLLM handles) once it is gone.

    A spawned process (vLLM's default where CUDA is set up, and the CPU
    engine's) runs ``os.setpgid(0, 0)`` and the watch first in its command
    line; a forked one at fork (`_own_group`).
    """
    global _STARTING_ENGINE
    from multiprocessing import spawn

    command_line = spawn.get_command_line

    def own_group(**kwargs: Any) -> list[str]:
        line = command_line(**kwargs)
        program = line.index("-c") + 1
        line[program] = f"import os; os.setpgid(0, 0); exec({ORPHAN_WATCH!r}, {{}}); {line[program]}"
        return line

    spawn.get_command_line, _STARTING_ENGINE = own_group, True
    try:
        yield
    finally:
        spawn.get_command_line, _STARTING_ENGINE = command_line, False


def _own_group() -> None:
    if _STARTING_ENGINE:  # a child forked while an engine starts: vLLM's engine core
        os.setpgid(0, 0)
        exec(ORPHAN_WATCH, {})


#: Run first in an engine process (stdlib only: nothing else is imported yet): a daemon thread that sends
#: the process SIGTERM once its parent, the caller, has gone (the process is then adopted: its parent pid
#: changes), and SIGKILL to its process group (it and its workers) if it is still there 10 s later: a
#: SIGTERM that comes while vLLM waits in a ZeroMQ poll (its start-up handshake) is lost there.
ORPHAN_WATCH = """
import os, signal, threading, time

def _vlenvoys_watch(parent=os.getppid()):
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10.0)
    os.killpg(os.getpgid(0), signal.SIGKILL)

threading.Thread(target=_vlenvoys_watch, name="vlenvoys-orphan-watch", daemon=True).start()
"""


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_own_group)


def spawn_on_a_gpu() -> None:
    """Start a GPU engine's process by spawning it, as vLLM's CPU engine does, unless the user chose a method.

    vLLM forks its engine process unless ``torch.cuda`` is initialized here. On an
    H200 (vLLM 0.32) the tiny Mixtral and Qwen2-MoE engines then failed to start,
    forked: "CUDA error: initialization error", or a hang, while every other
    family's started; the client already held the driver open (``/dev/nvidia-uvm``)
    from its imports on, in every case, so no check here can tell when a fork is safe.
    Spawned, every family's engine started and passed its suite. A script that
    starts an engine needs ``if __name__ == "__main__":`` either way.
    """
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike():
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def shutdown(model: VLLM) -> None:
    """Stop ``model``'s engine and its worker processes."""
    engine = getattr(model.vllm_entrypoint, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None:
        try:
            core.shutdown()
        except psutil.NoSuchProcess:
            # vLLM names each worker process before it kills it, and one that exits in between raises
            # (seen in CI, on a loaded machine): finish what its shutdown left.
            _stop_leftovers(core)
    # Collected rows' files of a worker killed before it removed them (vLLM kills an engine that has not
    # stopped 5 s after its SIGTERM); a worker just killed may hold its lock a moment longer.
    sweep(engine=getattr(model, "_engine_name", None), wait=10.0)
    SAVES_MAPS.drop_stale()  # this process's mappings of the engine's trace saves: their files are gone now
    model.vllm_entrypoint = None
    model._shut_down = True


def _stop_leftovers(core: Any) -> None:
    """Kill the engine processes (and theirs) still alive, then release the client's resources."""
    resources = getattr(core, "resources", None)
    manager = getattr(resources, "engine_manager", None)
    for process in getattr(manager, "processes", ()):
        if process.pid is None or not process.is_alive():
            continue
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in psutil.Process(process.pid).children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
        with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
            process.kill()
            process.join(5)
    if resources is not None:
        resources()  # the sockets and threads vLLM's shutdown releases after the processes
