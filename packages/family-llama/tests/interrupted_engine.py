"""Run by test_llama_interrupts.py in a process group of its own: long work, interrupted by the test, then checked.

    python interrupted_engine.py CHECKPOINT FOLDER

First its engine's start is interrupted (``start load``, ``interrupted load SECONDS``, then
``stopped load`` once no engine process is left). For each kind of work it prints ``start KIND``, runs it until the test's SIGINT to the whole group
(a terminal's Ctrl-C) raises KeyboardInterrupt here, prints ``interrupted KIND SECONDS`` (from the
signal to the exception), then collects a few prompts and prints ``alive KIND`` if their values
equal the same prompts' collected before any interrupt. A kind ``KIND_twice`` is interrupted a
second time while the first interrupt's requests are aborted (the script signals itself there). Then it prints ``engine PIDS`` (vLLM's engine
processes) and waits to be killed outright, which must end those processes too.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SIGNALLED: list[float] = []


def main() -> None:
    import torch
    from vllm import SamplingParams

    import vlenvoys
    from vlenvoys.activations import collect_dataset
    from vlenvoys.collect import collect

    checkpoint, folder = sys.argv[1], Path(sys.argv[2])
    # Python's own Ctrl-C, whatever this process inherited: a shell's background job (CI run with `&`) starts it
    # with SIGINT ignored, and Python then installs no handler.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    previous = signal.getsignal(signal.SIGINT)

    def noted(signum, frame):  # when the signal came, then Python's own KeyboardInterrupt
        SIGNALLED.append(time.perf_counter())
        previous(signum, frame)

    signal.signal(signal.SIGINT, noted)
    import psutil

    def engine_processes() -> list:
        return [child for child in psutil.Process().children(recursive=True)
                if "VLLM" in child.name() and child.status() != psutil.STATUS_ZOMBIE]

    # First the start itself, interrupted by the test once vLLM's engine process runs.
    print("start load", flush=True)
    try:
        vlenvoys.load(checkpoint, enable_prefix_caching=False)
        print("finished load", flush=True)
    except KeyboardInterrupt:
        print("interrupted load", flush=True)  # vlenvoys held the signal until the start was wound up
    time.sleep(1.0)
    print(f"{'alive' if engine_processes() else 'stopped'} load", flush=True)
    signal.signal(signal.SIGINT, noted)
    model = vlenvoys.load(checkpoint, enable_prefix_caching=False)
    few = [[5, 17, 33, 8, 91, 4], [7, 7, 12, 250, 3]]
    before = collect(model, few, "layer_output", [0, 2])
    many = [[3 + (number * 7 + place) % 400 for place in range(200)] for number in range(4000)]
    words = "the quick brown fox jumps over a lazy dog while seven tired sailors sing".split()
    texts = [" ".join(words[(number + place) % len(words)] for place in range(300)) for number in range(4000)]

    def trace() -> None:
        for _ in range(100):
            with model.trace(temperature=0.0, max_tokens=8) as tracer:
                saved = list().save()
                for prompt in many[:32]:
                    with tracer.invoke({"prompt_token_ids": prompt}):
                        saved.append(model.layers[1].layer_output)

    work = {
        "collect": lambda: collect(model, many, "layer_output", [0, 1, 2]),
        "trace": trace,
        "collect_dataset": lambda: collect_dataset(model, texts, folder / "acts", "layer_output", [1], context_length=64,
                                                   progress=False),
        "generate": lambda: vlenvoys.generate(model, many, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
                                              steering=vlenvoys.Steering(1, torch.ones(model.hidden_size))),
    }
    engine = model.vllm_entrypoint.llm_engine
    abort = engine.abort_request

    def interrupted_again(*args, **kwargs):  # a second Ctrl-C, sure to come while the first is wound up
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.3)
        return abort(*args, **kwargs)

    for kind in sys.argv[3:] or work:
        SIGNALLED.clear()
        print(f"start {kind}", flush=True)
        if kind.endswith("_twice"):
            engine.abort_request = interrupted_again
        try:
            work[kind.removesuffix("_twice")]()
            print(f"finished {kind}", flush=True)  # the test's signal came too late: it fails on this
        except KeyboardInterrupt:
            print(f"interrupted {kind} {time.perf_counter() - SIGNALLED[0]:.3f}", flush=True)
        finally:
            engine.abort_request = abort
        if any(thread.name == "vlenvoys-collect-cleanup" for thread in threading.enumerate()):
            print(f"busy {kind}", flush=True)  # the caller goes on while its interrupted work still calls the engine
        try:
            time.sleep(0.5)
        except KeyboardInterrupt:  # an interrupt that outlived the work it was meant for
            print(f"late {kind}", flush=True)
        after = collect(model, few, "layer_output", [0, 2])
        same = all(torch.equal(a, b) for key in before for a, b in zip(before[key], after[key], strict=True))
        print(f"{'alive' if same else 'changed'} {kind}", flush=True)
    # Last, the test kills this process outright (SIGKILL, this process alone): the engine must not outlive it.
    engine = [child.pid for child in engine_processes()]
    print(f"engine {' '.join(map(str, engine))}", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
