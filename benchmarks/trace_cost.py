"""Where a trace's time goes (#48 item 2): each trace's phases, beside plain vLLM on the same model.

    python benchmarks/trace_cost.py [--prompts 512] [--per-trace 64] [--rounds 3] [--spy DIR]

Two engines up at once on the gate's model (the random 1B-shape Llama in bfloat16 on a GPU, a tiny
Llama on the CPU): plain vLLM in its default configuration and `vlenvoys.load`. Per round, in turn:
plain vLLM with every prompt at once (the gate's baseline), plain vLLM in slices of ``--per-trace``
(a trace's batch, without the trace), a trace reading nothing and a trace reading `layer_output` at 3
blocks (``--per-trace`` invokes a trace, as the gate's rows). Each trace is cut into phases by timing
the methods it passes through, and the phases' medians over all traces are printed per prompt:

- ``invokes``: the block's invokes made (nnsight's capture of each ``tracer.invoke``), until `_call`;
- ``attach``: the invokes' blocks pickled onto their requests (`_attach_mediators`);
- ``add``: vLLM's ``add_request`` of each request (its tokenizing, the send to the engine core);
- ``engine``: vLLM's own ``LLMEngine.step`` (waiting for the engine core's outputs);
- ``saves rpc``: the call that brings finished requests' saves from the workers;
- ``saves merge``: nnsight's merge of them into the block's variables;
- ``rest``: what is left of the trace's wall time (the exit, its pushes).

``--spy DIR`` also samples the client and the engine core with py-spy over one more run of the trace
reading nothing (collapsed stacks, ``DIR/trace_empty.{client,core}.txt``). ``--idle N`` starts N more
plain vLLM engines that serve nothing, as the gate has engines and servers up beside each row: whether
the trace's client work slows with them (the trace rows measured 0.30 in the full gate, 0.40 alone).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PHASES = ("invokes", "attach", "add", "engine", "saves rpc", "saves merge", "rest")


class Timeline:
    """Seconds per phase of the trace running now, and of every finished trace."""

    def __init__(self) -> None:
        self.current: collections.Counter | None = None
        self.traces: list[dict] = []
        self.started = 0.0

    def begin(self) -> None:
        self.current, self.started = collections.Counter(), time.perf_counter()

    def end(self) -> None:
        whole = time.perf_counter() - self.started
        spent = dict(self.current)
        steps = spent.pop("step count", 0)
        spent["rest"] = whole - sum(spent.values())
        spent["whole"], spent["steps"] = whole, steps
        self.traces.append(spent)
        self.current = None

    def add(self, phase: str, seconds: float) -> None:
        if self.current is not None:
            self.current[phase] += seconds

    @contextlib.contextmanager
    def timed(self, phase: str):
        began = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - began)


def instrument(timeline: Timeline, engine) -> None:
    """Time the methods a trace passes through (this process only; the classes are vlenvoys' and nnsight's), and
    ``engine``'s calls into its core (the saves' call)."""
    from vlenvoys.engine import model as model_module
    from vlenvoys.engine import stepping
    from vllm.v1.engine.llm_engine import LLMEngine

    cls, engine_cls = model_module.StandardizedVLLM, stepping.StandardLLMEngine
    attach, collect, call, add = cls._attach_mediators, cls._collect, cls._call, engine_cls.add_request
    plain_step = LLMEngine.step

    def _call(self, *args, **kwargs):
        timeline.add("invokes", time.perf_counter() - timeline.started)
        return call(self, *args, **kwargs)

    def _attach_mediators(self, *args, **kwargs):
        with timeline.timed("attach"):
            return attach(self, *args, **kwargs)

    def _collect(*args, **kwargs):
        with timeline.timed("saves merge"):
            return collect(*args, **kwargs)

    def add_request(self, *args, **kwargs):
        with timeline.timed("add"):
            return add(self, *args, **kwargs)

    def step(self):
        with timeline.timed("engine"):
            outputs = plain_step(self)
        timeline.add("step count", 1)
        return outputs

    cls._call, cls._attach_mediators, cls._collect = _call, _attach_mediators, staticmethod(_collect)
    engine_cls.add_request = add_request
    # `StandardLLMEngine.step` calls `LLMEngine.step(self)` by name: time that, and the saves' call apart.
    stepping.LLMEngine = type("TimedLLMEngine", (), {"step": step})
    core_rpc = engine.engine_core.collective_rpc

    def collective_rpc(*args, **kwargs):
        with timeline.timed("saves rpc"):
            return core_rpc(*args, **kwargs)

    engine.engine_core.collective_rpc = collective_rpc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--per-trace", type=int, default=64, help="invokes a trace, and plain vLLM's slices")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after a warm-up round")
    parser.add_argument("--spy", type=Path, help="py-spy's samples of one more trace_empty run into this folder")
    parser.add_argument("--idle", type=int, default=0, help="more plain vLLM engines up, serving nothing")
    args = parser.parse_args()

    import torch
    import vlenvoys
    from bench import MAX_MODEL_LEN, core_pid, gate_checkpoint, requests, stop
    from vllm import LLM
    from workloads import prompts

    cuda = torch.cuda.is_available()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    path = gate_checkpoint(cuda)
    if cuda:
        sized = {"dtype": "bfloat16", "kv_cache_memory_bytes": 4 << 30, "gpu_memory_utilization": 0.1}
    else:
        sized = {"dtype": "float32", "kv_cache_memory_bytes": vlenvoys.engine.CPU_KV_CACHE_BYTES}
    sized |= {"max_model_len": MAX_MODEL_LEN, "enable_prefix_caching": False}
    texts = prompts(args.prompts, 16, 120, seed=1)
    timeline = Timeline()
    plain = LLM(path, **sized)
    model = vlenvoys.load(path, **sized)
    idle = [LLM(path, **sized) for _ in range(args.idle)]
    instrument(timeline, model.vllm_entrypoint.llm_engine)
    count = model.config.num_hidden_layers
    layers = sorted({count // 4, count // 2, 3 * count // 4})
    per = args.per_trace

    def trace_run(reads: bool):
        # As bench.traced, one trace per slice, each cut into the timeline's phases.
        kept = []
        for start in range(0, len(texts), per):
            timeline.begin()
            with model.trace(temperature=0.0, max_tokens=1) as tracer:
                saved = list().save()
                for text in texts[start : start + per]:
                    with tracer.invoke(text):
                        if reads:
                            saved.append([model.layers[i].layer_output for i in layers])
            timeline.end()
            kept.extend(saved)
        return kept

    runs = {
        "plain, all at once": lambda: requests(plain, texts, 1),
        f"plain, {per} at a time": lambda: [requests(plain, texts[s : s + per], 1) for s in range(0, len(texts), per)],
        "trace reading nothing": lambda: trace_run(False),
        "trace, 3 reads": lambda: trace_run(True),
    }
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    phases: dict[str, list[dict]] = {name: [] for name in runs}
    for round_number in range(args.rounds + 1):
        for name, run in runs.items():
            timeline.traces.clear()
            began = time.perf_counter()
            run()
            took = time.perf_counter() - began
            if round_number:  # the first round warms up
                seconds[name].append(took)
                phases[name].extend(timeline.traces)
    base = statistics.median(seconds["plain, all at once"])
    print(f"\n{args.prompts} prompts of 16-120 words, {per} a trace, {'GPU ' + torch.cuda.get_device_name() if cuda else 'CPU'}, "
          f"{args.idle} idle engines beside")
    print(f"{'run':28} {'s':>7} {'ms/prompt':>10} {'of plain':>9}")
    for name, taken in seconds.items():
        median = statistics.median(taken)
        print(f"{name:28} {median:7.3f} {median / args.prompts * 1e3:10.3f} {base / median:9.2f}")
    for name, found in phases.items():
        if not found:
            continue
        print(f"\n{name}: median ms a trace of {per} ({len(found)} traces), and per invoke")
        for phase in (*PHASES, "whole"):
            median = statistics.median(trace.get(phase, 0.0) for trace in found) * 1e3
            print(f"  {phase:12} {median:8.2f} ms  {median / per:7.3f} ms/invoke")
        print(f"  {'steps':12} {statistics.median(trace['steps'] for trace in found):8.0f}")
    if args.spy is not None:
        import shutil
        import subprocess

        spy = shutil.which("py-spy")
        if spy is None:
            print("no py-spy on PATH: --spy skipped")
        else:
            args.spy.mkdir(parents=True, exist_ok=True)
            samplers = [
                subprocess.Popen([spy, "record", "--pid", str(pid), *extra, "--rate", "500", "--format", "raw",
                                  "--nonblocking", "--output", str(args.spy / f"trace_empty.{side}.txt"), "--duration", "60"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                for side, pid, extra in (("client", os.getpid(), []), ("core", core_pid(model), ["--subprocesses"]))
            ]
            time.sleep(1.0)
            for _ in range(3):
                trace_run(False)
            for sampler in samplers:
                sampler.send_signal(2)
                sampler.wait(30)
            print(f"py-spy: {args.spy}/trace_empty.*.txt")
    for engine in (model, plain, *idle):
        stop(engine)


if __name__ == "__main__":
    main()
