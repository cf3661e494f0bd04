"""A terminal's Ctrl-C stops the caller's work, never the engine (#46 item 1).

A terminal (and a shell's job control) sends SIGINT to the whole foreground process group; vLLM's
engine processes used to be in it and shut down, and the next call raised EngineDeadError. Here a
script in a process group of its own (`interrupted_engine.py`) runs each kind of long work, the test
signals its whole group while the work runs, and the script must get a KeyboardInterrupt, then
collect values equal to those it collected before, on the same engine.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from vlenvoys_testing import tiny_model

KINDS = ["collect", "trace", "collect_dataset", "generate"]
#: Interrupted twice: the second Ctrl-C comes while the first one's requests are wound up.
TWICE = ["collect_twice", "trace_twice"]
#: What the script is interrupted in: its engine's start, then each kind of work.
STEPS = ["load", *KINDS, *TWICE]


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> dict[str, list[str]]:
    """The script's lines per kind of work, each interrupted by SIGINT to the script's whole process group."""
    folder = tmp_path_factory.mktemp("interrupts")
    checkpoint = tiny_model("LlamaForCausalLM", folder / "tiny", max_position_embeddings=512)
    script = Path(__file__).with_name("interrupted_engine.py")
    process = subprocess.Popen([sys.executable, str(script), str(checkpoint), str(folder), *KINDS, *TWICE], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    killer = threading.Timer(600, lambda: os.killpg(process.pid, signal.SIGKILL))
    killer.start()
    lines: dict[str, list[str]] = {kind: [] for kind in STEPS}
    lines["orphaned"] = []
    log = []
    try:
        for line in process.stdout:
            log.append(line)
            if line.startswith("engine "):
                engine = [int(pid) for pid in line.split()[1:]]
                os.kill(process.pid, signal.SIGKILL)  # the caller alone, killed outright; its engine is in another group
                lines["orphaned"] = still_running(engine, within=30.0)
                break
            # The script's own lines; a progress bar may have left no newline before one.
            for found in re.finditer(rf"\b(start|interrupted|finished|alive|stopped|changed|late|busy) ({'|'.join(STEPS)})\b( [0-9.]+)?", line):
                lines[found.group(2)].append(found.group(0))
                if found.group(1) == "start" and found.group(2) == "load":
                    engine_started(process.pid, within=300.0)  # vLLM's engine process runs: the start is under way
                    os.killpg(process.pid, signal.SIGINT)
                elif found.group(1) == "start":
                    time.sleep(2.0)  # well into the work
                    os.killpg(process.pid, signal.SIGINT)  # the whole group, as a terminal's Ctrl-C
        process.wait(60)
    finally:
        killer.cancel()
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == -signal.SIGKILL and "engine" not in lines["orphaned"], "".join(log[-60:])
    return lines


def engine_started(pid: int, within: float) -> None:
    """Wait until a vLLM engine process runs under ``pid``."""
    import psutil

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if any("VLLM" in child.name() for child in psutil.Process(pid).children(recursive=True)):
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.05)


def still_running(pids: list[int], within: float) -> list[str]:
    """Those of ``pids`` still running (zombies aside) ``within`` seconds from now, or "engine" if none were given."""
    import psutil

    if not pids:
        return ["engine"]
    deadline = time.monotonic() + within
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            for pid in alive:
                os.kill(pid, signal.SIGKILL)  # no engine left behind by a failing test
            return [str(pid) for pid in alive]
        time.sleep(0.5)


@pytest.mark.parametrize("kind", KINDS)
def test_an_interrupt_of_the_whole_process_group_leaves_the_engine_serving(interrupted, kind):
    lines = interrupted[kind]
    assert lines[0] == f"start {kind}"
    assert lines[1].startswith(f"interrupted {kind} "), f"the work was not interrupted: {lines}"
    assert lines[2] == f"alive {kind}", f"after the interrupt the engine gave other values, or none: {lines}"
    print(f"{kind}: the KeyboardInterrupt came {float(lines[1].split()[-1]):.3f} s after the signal")


@pytest.mark.parametrize("kind", TWICE)
def test_a_second_interrupt_while_the_first_is_wound_up_leaves_the_engine_serving(interrupted, kind):
    """Pressed twice, Ctrl-C's second signal used to stop the winding up of the first half done (its requests left on
    the engine, a thread still calling it); now it waits for the wind-up and ends in one KeyboardInterrupt."""
    lines = interrupted[kind]
    assert lines[0] == f"start {kind}"
    assert lines[1].startswith(f"interrupted {kind} "), f"the work was not interrupted: {lines}"
    assert lines[2:] == [f"alive {kind}"], f"after two interrupts: the wind-up still ran (busy), an interrupt came late, or the engine gave other values or none: {lines}"


def test_an_engine_whose_caller_is_killed_outright_shuts_down(interrupted):
    """The engine's processes lead a group of their own (no terminal's signal reaches them), so they watch
    their caller: killed with SIGKILL, it leaves no engine holding memory behind."""
    assert interrupted["orphaned"] == [], f"engine processes still running 30 s after their caller was killed: {interrupted['orphaned']}"


def test_an_interrupt_while_the_engine_starts_stops_the_start_and_the_engine(interrupted):
    """vLLM's start-up waits in ZeroMQ polls, where pyzmq drops a KeyboardInterrupt: the interrupt was lost (the model
    loaded anyway) or left caller and engine waiting for each other. Now the start is wound up and interrupted."""
    lines = interrupted["load"]
    assert lines[:1] == ["start load"]
    assert lines[1] == "interrupted load", f"the start was not interrupted: {lines}"
    assert lines[2] == "stopped load", f"engine processes outlived the interrupted start: {lines}"
