"""Benchmarks: what vlenvoys costs and what it buys, measured side by side in one run.

Runs on the built-in SmolLM2-135M-Instruct (float32) on vLLM's engine and
writes benchmarks/results/results.md (medians and ratios) and results.png.
Run with `nox -s bench`. Timings are wall-clock medians over repeats; every
row's ratio compares runs made in this process, on this machine, minutes apart.

Where torch sees a CUDA device (or with --gpu) it runs the CUDA suite instead:
a random Llama of a 1B model's shape in bfloat16, on plain vLLM (CUDA graphs,
eager), the vlenvoys engine, raw nnsight and nnsight's taps=, one engine at a
time, writing benchmarks/results/results-h200.md and results-h200.json.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import inspect
import json
import math
import os
import platform
import statistics
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil
import torch
import vlenvoys

# This file's own folder is on the path when it runs as a script (`python benchmarks/bench.py`).
import workloads
from vlenvoys.collect import collect as _collect
from workloads import median_time, prompts


def _bar_off(function: Callable) -> dict:
    """The argument that turns ``function``'s progress bar off, at this commit or an older one (--paired)."""
    parameters = inspect.signature(function).parameters
    if "progress" in parameters and parameters["progress"].default is True:  # since #49: a bar by default
        return {"progress": False}
    return {"use_tqdm": False} if "use_tqdm" in parameters else {}


#: `vlenvoys.collect` and `vlenvoys.generate` without their bars: a timed run draws nothing.
collect = functools.partial(_collect, **_bar_off(_collect))
generate_quietly = functools.partial(vlenvoys.generate, **_bar_off(vlenvoys.generate))


def interleaved(runs: dict[str, Callable[[], object]], repeats: int, rounds: list | None = None) -> dict[str, float]:
    """Median seconds of each run, timed in rounds that run each once (after one warm-up round).

    ``rounds``, when given, receives each round's seconds by run name (for ratios within a round).
    """
    times: dict[str, list[float]] = {name: [] for name in runs}
    for repeat in range(repeats + 1):
        measured = {}
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            measured[name] = time.perf_counter() - start
        if repeat:
            for name, seconds in measured.items():
                times[name].append(seconds)
            if rounds is not None:
                rounds.append(measured)
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def client_mib() -> float:
    """Resident memory of this process, where collected values arrive."""
    return psutil.Process(os.getpid()).memory_info().rss / 2**20


def engine_mib(model) -> float:
    """Resident memory of vLLM's engine and worker processes in use: after a full garbage
    collection and malloc_trim in the worker (run there by a trace).

    Without them the engine's RSS grows over rounds of plain vLLM too (glibc
    keeps freed memory in its arenas), and more with nnsight, whose
    per-request blocks leave reference cycles until Python's next full collection.
    """
    if platform.system() == "Linux":
        with model.trace("trim", temperature=0.0, max_tokens=1):
            import ctypes
            import gc

            gc.collect()  # nnsight's per-request blocks leave reference cycles until a full collection
            ctypes.CDLL("libc.so.6").malloc_trim(0)
    return sum(child.memory_info().rss for child in psutil.Process(os.getpid()).children(recursive=True)) / 2**20


class PeakMemory:
    """The largest memory of this process and vLLM's together, sampled every 20 ms while in the block (MiB).

    Each process's proportional set size where Linux gives it (``/proc/PID/smaps_rollup``): a page
    shared by several processes counts once in their sum. The engine's rows reach this process
    through shared memory (`vlenvoys.wire.shm`), and a sum of resident sizes counted those pages twice.
    Elsewhere the resident size.
    """

    def __enter__(self) -> PeakMemory:
        self.peak, self.cpu, self._done = 0.0, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    @staticmethod
    def _bytes(process: psutil.Process) -> int:
        try:
            with open(f"/proc/{process.pid}/smaps_rollup") as rollup:
                return next(int(line.split()[1]) << 10 for line in rollup if line.startswith("Pss:"))
        except (OSError, StopIteration):
            return process.memory_info().rss

    def _sample(self) -> None:
        started = time.thread_time()
        me = psutil.Process(os.getpid())
        # The engine's processes are up before the block: listed once (a scan of /proc every sample
        # held the interpreter's lock long enough to slow the client being measured).
        processes = [me, *me.children(recursive=True)]
        while True:
            total = 0
            for process in processes:
                with contextlib.suppress(psutil.NoSuchProcess):
                    total += self._bytes(process)
            self.peak = max(self.peak, total / 2**20)
            if self._done.wait(0.02):
                self.cpu = time.thread_time() - started  # the sampling's own CPU seconds, for a caller timing the process
                return

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


# -- what is timed --------------------------------------------------------------


def plain_vllm(model, texts, max_tokens=1):
    from vllm import SamplingParams

    model.vllm_entrypoint.generate(texts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)


def plain_vllm_windowed(model, texts, window=64):
    """Plain vLLM with at most ``window`` requests in flight, as `collect` submits them."""
    from vllm import SamplingParams

    engine = model.vllm_entrypoint.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=1)
    run = uuid.uuid4().hex[:12]
    following, in_flight = 0, set()
    while following < len(texts) or in_flight:
        while following < len(texts) and len(in_flight) < window:
            request_id = f"plain.{run}.{following}"
            engine.add_request(request_id, texts[following], params)
            in_flight.add(request_id)
            following += 1
        for output in engine.step():
            if output.finished:
                in_flight.discard(output.request_id)


def collected(model, texts, layers=(5, 15, 25), batch=64):
    """What `vlenvoys collect` runs: one block installed on the engine, ``batch`` prompts in flight."""
    return collect(model, texts, "layer_output", layers, batch_size=batch)


def traced(model, texts, body, max_tokens=1, batch=32):
    """One invoke per prompt, ``batch`` invokes per trace; ``body(model)`` returns what to keep."""
    kept = []
    for start in range(0, len(texts), batch):
        with model.trace(temperature=0.0, max_tokens=max_tokens) as tracer:
            saved = list().save()
            for text in texts[start : start + batch]:
                with tracer.invoke(text):
                    saved.append(body(model))
        kept.extend(saved)
    return kept


def every_layer_standard(model):
    out = []
    for layer in model.layers:
        out.append(layer.self_attn.attention_output)
        out.append(layer.mlp.mlp_neurons)
        out.append(layer.layer_output)
    return out


def every_layer_raw(model):
    out = []
    for layer in model.model.layers:
        out.append(layer.self_attn.output.clone())
        out.append(layer.mlp.down_proj.input.clone())
        hidden, residual = layer.output
        out.append((hidden + residual).clone())
    return out


def three_layers_standard(model):
    return [model.layers[i].layer_output for i in (5, 15, 25)]


def three_layers_raw(model):
    out = []
    for i in (5, 15, 25):
        hidden, residual = model.model.layers[i].output
        out.append((hidden + residual).clone())
    return out


def transformers_collect(reference, tokenizer, texts, layers=(5, 15, 25), batch=16):
    kept = []
    tokenizer.padding_side = "left"
    with torch.no_grad():
        for start in range(0, len(texts), batch):
            encoded = tokenizer(texts[start : start + batch], return_tensors="pt", padding=True)
            out = reference(**encoded, output_hidden_states=True)
            kept.append([out.hidden_states[i + 1] for i in layers])
    return kept


def transformers_steered(reference, tokenizer, texts, vector, layer, tokens=32, batch=16):
    def hook(module, args, output):
        return output + vector if isinstance(output, torch.Tensor) else (output[0] + vector, *output[1:])

    handle = reference.model.layers[layer].register_forward_hook(hook)
    tokenizer.padding_side = "left"
    try:
        with torch.no_grad():
            for start in range(0, len(texts), batch):
                encoded = tokenizer(texts[start : start + batch], return_tensors="pt", padding=True)
                reference.generate(**encoded, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    finally:
        handle.remove()


def steered(model, texts, vector, layer, tokens=32, batch=32):
    for start in range(0, len(texts), batch):
        with model.trace(temperature=0.0, max_tokens=tokens, ignore_eos=True) as tracer:
            for text in texts[start : start + batch]:
                with tracer.invoke(text):
                    for _ in tracer.iter[0:tokens]:
                        model.steer(layer, vector)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--repeats", type=int, help="timed runs per measurement after a warm-up (3; CUDA suite 2)")
    parser.add_argument("--quick", action="store_true", help="fewer prompts, for a smoke run")
    parser.add_argument("--only", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6], help="sections to run (CPU suite)")
    parser.add_argument("--nnterp", type=Path, help="compat/bench_nnterp.py's JSON: adds nnterp rows (CPU suite)")
    parser.add_argument("--gpu", action="store_true", help="CUDA suite on the CPU engine (a smoke run)")
    parser.add_argument("--size", choices=sorted(SIZES), help="CUDA suite's model: 1b (default on CUDA) or tiny")
    parser.add_argument("--tag", default="h200", help="CUDA suite's files: results-TAG.md and results-TAG.json")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=ENGINES, help="CUDA suite's engines to run")
    parser.add_argument("--taps-mode", choices=("default", "piecewise"), default="default",
                        help="CUDA suite's taps engine: vLLM's default graph mode, or PIECEWISE graphs only")
    parser.add_argument("--profile", type=Path,
                        help="with --paired: py-spy's samples of each engine's core process over one more run of each "
                             "workload, one collapsed-stack file per workload in this folder (needs py-spy on PATH)")
    parser.add_argument("--paired", action="store_true",
                        help="CUDA suite with plain vLLM and the vlenvoys engines up at once, runs interleaved in "
                             "rounds: each ratio is the median of its rounds' ratios (results-TAG-paired.*)")
    args = parser.parse_args()
    if args.gpu or torch.cuda.is_available():
        cuda_suite(args)
        return
    if args.repeats is None:
        args.repeats = 3
    scale = 4 if args.quick else 1

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vlenvoys.weights import smollm2_path

    path = smollm2_path()
    # Prefix caching off: the sections run the same prompts again and again, and a plain run that read
    # the cache would be timed against collections and traces that never do. Section 6 measures it.
    model = vlenvoys.load(path, enable_prefix_caching=False)
    rows: list[tuple[str, str, float, str, float, str]] = []

    def row(name, ours_label, ours, base_label, base, unit="prompts/s", paired=None):
        rows.append((name, ours_label, ours, base_label, base, unit, paired))
        print(f"{name}: {ours_label} {ours:.3g} vs {base_label} {base:.3g} {unit} (ratio {ratio(ours, base, paired)})",
              flush=True)

    try:
        # 1. Overhead of the envoys: every layer's stream, attention output and neurons.
        if 1 in args.only:
            texts = prompts(16)
            runs = {
                "ours": lambda: traced(model, texts, every_layer_standard),
                "raw": lambda: traced(model, texts, every_layer_raw),
            }
            rounds: list[dict[str, float]] = []
            seconds = interleaved(runs, 5 * args.repeats, rounds)
            # The ratio within each round, then their median: the machine's drift over the
            # minute this takes moves both runs of a round alike.
            paired = statistics.median(r["ours"] / r["raw"] for r in rounds)
            row("1. envoy overhead (every layer, 3 values)", "vlenvoys s", seconds["ours"],
                "raw nnsight + clone s", seconds["raw"], "s", paired)

        tokenizer = AutoTokenizer.from_pretrained(path)
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

        # 2. Collection throughput: layer_output at three layers, as `vlenvoys collect` reads it.
        if 2 in args.only:
            texts = prompts(256 // scale)
            # Interleaved rounds, so that load from elsewhere on the machine hits every contender alike.
            runs = {
                "plain": lambda: plain_vllm(model, texts),
                "window": lambda: plain_vllm_windowed(model, texts),
                "ours": lambda: collected(model, texts),
                "raw": lambda: traced(model, texts, three_layers_raw),
            }
            rates = {name: len(texts) / seconds for name, seconds in interleaved(runs, args.repeats).items()}
            ours = rates["ours"]
            row("2a. collection vs plain vLLM (no reads)", "vlenvoys", ours, "plain vLLM", rates["plain"])
            row("2b. collection vs raw nnsight trace", "vlenvoys", ours, "raw nnsight", rates["raw"])
            row("2c. collection vs plain vLLM, 64 in flight", "vlenvoys", ours, "plain vLLM", rates["window"])
            hf = len(texts) / median_time(lambda: transformers_collect(reference, tokenizer, texts), args.repeats)
            row("2d. collection vs transformers (batch 16)", "vlenvoys", ours, "transformers", hf)

        # 3. Steered generation: 32 tokens, a vector added at one layer every step.
        if 3 in args.only:
            texts = prompts(64 // scale)
            vector = torch.randn(model.hidden_size) * 4
            ours = len(texts) / median_time(lambda: steered(model, texts, vector, 10), 1)
            plain = len(texts) / median_time(lambda: plain_vllm(model, texts, 32), 1)
            hf = len(texts) / median_time(lambda: transformers_steered(reference, tokenizer, texts, vector, 10), 1)
            row("3a. steered generation vs plain vLLM", "vlenvoys", ours, "plain vLLM (unsteered)", plain)
            row("3b. steered generation vs transformers", "vlenvoys", ours, "transformers steered", hf)

        # 4. Scaling: prompt count and length; pattern recompute against length.
        # Count at short prompts, length at few prompts (256 long prompts would take minutes per run).
        if 4 in args.only:
            grid = [(16, 16), (64, 16), (256 // scale, 16), (16, 64), (16, 256)]
            for count, words in grid:
                texts = prompts(count, words, words, seed=count + words)
                ours = count / median_time(lambda texts=texts: collected(model, texts), 1)
                plain = count / median_time(lambda texts=texts: plain_vllm(model, texts), 1)
                row(f"4. collection, {count} prompts of {words} words", "vlenvoys", ours, "plain vLLM", plain)
            for words in (16, 64, 256):
                texts = prompts(1, words, words)
                # One line: nnsight ships a lambda by its source, and one on a line that does not parse
                # alone costs it a parse of this whole file per request.
                patterns = median_time(
                    lambda texts=texts: traced(model, texts, lambda m: [layer.self_attn.attention_probabilities for layer in m.layers]),  # noqa: E501
                    args.repeats,
                )
                streams = median_time(lambda texts=texts: traced(model, texts, three_layers_standard), args.repeats)
                row(f"4. every layer's pattern, {words} words", "patterns s", patterns, "3 streams s", streams, "s")

        # 5. Memory, this process (where the values arrive) and vLLM's processes apart, against
        # plain vLLM submitting the same prompts the same way (64 in flight). Both first run 20
        # warm-up rounds: step shapes vary with the window, and the engine's RSS climbs with
        # each new one before it levels off (plain vLLM too); then 10 rounds are measured.
        if 5 in args.only:
            texts = prompts(64 // scale)
            growth, warm_up, peak = {}, {}, {}
            contenders = (
                ("plain", lambda: plain_vllm_windowed(model, texts)),
                ("ours", lambda: collected(model, texts)),
            )
            for name, run in contenders:
                start = engine_mib(model)
                for _ in range(20):
                    run()
                gc.collect()
                before = (client_mib(), engine_mib(model))
                warm_up[name] = before[1] - start
                for _ in range(10):
                    with PeakMemory() as sampled:
                        kept = run()
                    del kept
                    gc.collect()
                    peak[name] = max(peak.get(name, 0.0), sampled.peak - before[0] - before[1])
                growth[name] = (client_mib() - before[0], engine_mib(model) - before[1])
            ours_mib, plain_mib = "collect MiB", "plain vLLM MiB"
            engine_growth = (growth["ours"][1], growth["plain"][1])
            client_growth = (growth["ours"][0], growth["plain"][0])
            row("5a. engine memory growth, 10 rounds", ours_mib, engine_growth[0], plain_mib, engine_growth[1], "MiB")
            row("5b. client memory growth, 10 rounds", ours_mib, client_growth[0], plain_mib, client_growth[1], "MiB")
            row("5c. engine memory, 20 warm-up rounds", ours_mib, warm_up["ours"], plain_mib, warm_up["plain"], "MiB")
            row("5d. peak memory above idle, one round", ours_mib, peak["ours"], plain_mib, peak["plain"], "MiB")
        # 6. Prefix caching, on by default (traced, collected and steered requests salt themselves out of
        # it): time to the first token of 32 requests sharing a long prefix, the prefix cached or not.
        if 6 in args.only:
            cached = vlenvoys.load(path)
            try:
                shared = " ".join(prompts(1, 600, 600, seed=7)[0].split()[:600])
                texts = [f"{shared} {tail}" for tail in prompts(32 // scale, 4, 8, seed=8)]
                plain_vllm(cached, texts)  # the prefix is in the cache now

                def uncached():
                    cached.vllm_entrypoint.reset_prefix_cache()
                    plain_vllm(cached, texts)

                seconds = interleaved({"cached": lambda: plain_vllm(cached, texts), "uncached": uncached}, args.repeats)
                row("6. time to first token, 600-word prefix cached vs not (32 requests)", "cached s",
                    seconds["cached"], "recomputed s", seconds["uncached"], "s")
            finally:
                vlenvoys.shutdown(cached)
    finally:
        vlenvoys.shutdown(model)

    if args.nnterp is not None and args.nnterp.is_file():
        add_nnterp(rows, json.loads(args.nnterp.read_text()))
    write(args.out, rows)


def add_nnterp(rows: list, measured: dict) -> None:
    """A row against nnterp 1.3 on transformers for each workload both measured (same prompts, same machine)."""
    nnterp = {row["name"]: row["value"] for row in measured["rows"]}
    ours = {name.split(".")[0]: (label, value) for name, label, value, *_ in rows}
    pairs = [("1", "every_layer", "1. every layer, 16 prompts, vs nnterp", "s"),
             ("2a", "collection", "2e. collection vs nnterp (batch 16)", "prompts/s"),
             ("3a", "steered", "3c. steered generation vs nnterp (batch 16)", "prompts/s")]
    for key, workload, name, unit in pairs:
        if key in ours and workload in nnterp:
            label, value = ours[key]
            rows.append((name, label, value, "nnterp on transformers", nnterp[workload], unit, None))


def ratio(ours: float, base: float, paired: float | None = None) -> str:
    if paired is not None:
        return f"{paired:.2f} (paired)"
    # A ratio of memory growths near zero, or of opposite signs, says nothing.
    return f"{ours / base:.2f}" if base > 0 and ours >= 0 else "n/a"


def checkout() -> str:
    """The commit the benchmarked code was installed from (with "+changes" for uncommitted changes to it)."""
    return workloads.checkout(("packages", "benchmarks/bench.py", "benchmarks/workloads.py"))


def write(out: Path, rows) -> None:
    from tabulate import tabulate

    table = tabulate(
        [
            (name, f"{a:.3g} ({al})", f"{b:.3g} ({bl})", ratio(a, b, paired), unit)
            for name, al, a, bl, b, unit, paired in rows
        ],
        headers=("benchmark", "vlenvoys", "baseline", "ratio", "unit"),
        tablefmt="github",
    )
    memory = psutil.virtual_memory().total / 2**30
    machine = f"{platform.machine()}, {os.cpu_count()} cores, {memory:.0f} GiB, torch {torch.__version__}"
    header = f"Machine: {machine}; vlenvoys-core {vlenvoys.__version__} at {checkout()}"
    (out / "results.md").write_text(f"{header}\n\n{table}\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.5))
    names = [name for name, *_ in rows]
    ratios = [p if p is not None else a / b if b > 0 and a >= 0 else 0.0 for _, _, a, _, b, _, p in rows]
    axis.barh(names, ratios, color="tab:blue")
    axis.axvline(1.0, color="black", linewidth=0.8)
    axis.invert_yaxis()
    axis.set_xlabel("ratio (vlenvoys / baseline; for seconds and MiB lower is better, for prompts/s higher)")
    axis.set_title(f"vlenvoys benchmarks ({machine})", fontsize=9)
    figure.tight_layout()
    figure.savefig(out / "results.png", dpi=110)
    print((out / "results.md").read_text())


# -- the CUDA suite -------------------------------------------------------------

#: Model shapes of the CUDA suite: a real 1B model's (Llama 3.2 1B's layout, 32k vocabulary; random weights, as
#: the GPU machine reaches no hub), or tiny_model's own defaults (hidden 128, 3 layers) for a smoke run on the CPU.
SIZES: dict[str, dict[str, int]] = {
    "1b": {
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 8192,
        "vocab_size": 32768,
    },
    "tiny": {},
}
#: Llama-3.1-8B's shape, for the gate's 8b rows (#48): drawn by vLLM on the device (`load_format="dummy"`), never saved.
SHAPE_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "intermediate_size": 14336, "vocab_size": 128256, "rope_theta": 500000.0}
MAX_MODEL_LEN = 1024
TOKENS = 64  # generated per prompt, every one steered
# --paired: a longer generation (about 1.5 s of plain vLLM on an H200), and each engine's share of the GPU.
PAIRED_PROMPTS, PAIRED_TOKENS, PAIRED_SHARE = 256, 128, 0.22
# --profile: the workloads whose engine core py-spy samples.
PROFILED = ["graphs.prefill", "vl.collect", "vl.trace", "vl.empty", "graphs.generate", "vg.generate", "vg.generate_steered"]
#: --paired: plain vLLM with the graph engine's compilation (`vlenvoys.load(cuda_graphs=True)` sets the same).
SAME_GRAPHS = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
SAME_LABEL = "plain vLLM, the graph engine's graphs"
PER_TRACE = 64  # invokes per trace, and collect's requests in flight
TAPS = ["model.layers.*.output"]
ENGINES = ["graphs", "eager", "vlenvoys", "vlgraphs", "raw", "taps"]

#: (row, ours, baseline): measurement keys, "engine.workload"; a row is formed once both sides are measured.
CUDA_ROWS = [
    ("1. collection vs plain vLLM, CUDA graphs", "vl.collect", "graphs.prefill"),
    ("2. collection vs plain vLLM, eager", "vl.collect", "eager.prefill"),
    ("3. collection vs raw nnsight trace", "vl.collect", "raw.trace"),
    ("4. collection vs nnsight taps trace", "vl.collect", "taps.trace"),
    ("5. trace, 3 reads vs plain vLLM, CUDA graphs", "vl.trace", "graphs.prefill"),
    ("6. trace, 3 reads vs raw nnsight trace", "vl.trace", "raw.trace"),
    ("7. trace reading nothing vs plain vLLM, CUDA graphs", "vl.empty", "graphs.prefill"),
    ("8. steered generation vs plain vLLM, CUDA graphs", "vl.steer", "graphs.generate"),
    ("9. steered generation vs plain vLLM, eager", "vl.steer", "eager.generate"),
    ("10. steered generation vs raw nnsight steering", "vl.steer", "raw.steer"),
    ("11. steered generation vs nnsight taps steering", "vl.steer", "taps.steer"),
    ("12. vlenvoys engine, plain prefill vs plain vLLM, eager", "vl.prefill", "eager.prefill"),
    ("13. vlenvoys engine, plain generation vs plain vLLM, eager", "vl.generate", "eager.generate"),
    # What the baselines cost against each other, for reading the rows above.
    ("14. plain vLLM eager vs CUDA graphs, generation", "eager.generate", "graphs.generate"),
    ("15. nnsight taps, plain prefill vs CUDA graphs", "taps.prefill", "graphs.prefill"),
    ("16. nnsight taps, plain generation vs CUDA graphs", "taps.generate", "graphs.generate"),
    # vlenvoys.generate: each request's steering added by one hook per block per step (vlenvoys.worker.steerer).
    ("17. vlenvoys.generate steered vs plain vLLM, CUDA graphs", "vl.generate_steered", "graphs.generate"),
    ("18. vlenvoys.generate steered vs plain vLLM, eager", "vl.generate_steered", "eager.generate"),
    ("19. vlenvoys.generate steered vs steering in a trace", "vl.generate_steered", "vl.steer"),
    ("20. vlenvoys.generate, half the requests steered vs plain vLLM, eager", "vl.generate_half", "eager.generate"),
    # On one engine, so measured in any run that has it (--engines vlenvoys alone).
    ("21. collection vs the vlenvoys engine's plain prefill", "vl.collect", "vl.prefill"),
    ("22. vlenvoys.generate steered vs the vlenvoys engine's plain generation", "vl.generate_steered", "vl.generate"),
    # vlenvoys.load(cuda_graphs=True): decode steps replay graphs with the steering hooks in them.
    ("23. graph engine: vlenvoys.generate steered vs plain vLLM, CUDA graphs", "vg.generate_steered", "graphs.generate"),
    ("24. graph engine: half the requests steered vs plain vLLM, CUDA graphs", "vg.generate_half", "graphs.generate"),
    ("25. graph engine: vlenvoys.generate, none steered vs plain vLLM, CUDA graphs", "vg.generate_none", "graphs.generate"),
    ("26. graph engine: collection vs plain vLLM, CUDA graphs", "vg.collect", "graphs.prefill"),
    ("27. graph engine: plain generation vs plain vLLM, CUDA graphs", "vg.generate", "graphs.generate"),
    ("28. graph engine: steered vs its own plain generation, measured after", "vg.generate_steered", "vg.generate_again"),
    ("29. graph engine: none steered vs its own plain generation, measured after", "vg.generate_none", "vg.generate_again"),
    ("30. graph engine: collection vs its own plain prefill", "vg.collect", "vg.prefill"),
    # --paired: plain vLLM configured as the graph engine is (no torch.compile, graphs of pure decode steps only),
    # so a generation row compares the same kernels and the same graphs, with and without vlenvoys.
    ("31. graph engine: steered vs plain vLLM with the same graphs", "vg.generate_steered", "same.generate"),
    ("32. graph engine: half the requests steered vs plain vLLM with the same graphs", "vg.generate_half", "same.generate"),
    ("33. graph engine: none steered vs plain vLLM with the same graphs", "vg.generate_none", "same.generate"),
    ("34. graph engine: collection vs plain vLLM with the same graphs", "vg.collect", "same.prefill"),
    ("35. plain vLLM: the graph engine's configuration vs vLLM's default, generation", "same.generate", "graphs.generate"),
]


def cache_root() -> Path:
    """Where the benchmarks build their models: $VLENVOYS_CACHE, or ~/.cache/vlenvoys."""
    return Path(os.environ.get("VLENVOYS_CACHE") or Path.home() / ".cache" / "vlenvoys").expanduser()


def cuda_checkpoint(size: str) -> Path:
    """The suite's random Llama in bfloat16, built once into `cache_root`."""
    from vlenvoys_testing import tiny_model

    root = cache_root()
    # tiny_model's 256 positions are fewer than a 120-word prompt and its 64 generated tokens may need.
    shape = SIZES[size] | {"max_position_embeddings": MAX_MODEL_LEN}
    return tiny_model("LlamaForCausalLM", root / f"bench-llama-{size}-bfloat16", dtype="bfloat16", **shape)


def gate_checkpoint(cuda: bool) -> str:
    """The gate's model (and trace_cost.py's): the 1B-shape Llama on a GPU; on the CPU engine a tiny Llama of six blocks
    (serve.py's requests steer and capture blocks 2 and 5)."""
    if cuda:
        return str(cuda_checkpoint("1b"))
    from vlenvoys_testing import tiny_model

    return str(tiny_model("LlamaForCausalLM", cache_root() / "gate-smoke-llama", num_hidden_layers=6,
                          max_position_embeddings=MAX_MODEL_LEN))


def raw_streams(model, layers) -> list:
    """Raw nnsight's read of each block's residual stream at ``layers``: vLLM's (hidden, residual) summed, cloned
    (the next step overwrites the buffers)."""
    out = []
    for i in layers:
        hidden, residual = model.model.layers[i].output
        out.append((hidden + residual).clone())
    return out


def shaped_checkpoint(shape: dict, name: str) -> Path:
    """A folder with a Llama config of ``shape`` in bfloat16 and the tiny tokenizer, and no weights: load it with
    ``load_format="dummy"`` (vLLM draws the weights where the model lives, in seconds on a GPU)."""
    import json
    import shutil

    from vlenvoys_testing import tiny_model

    root = cache_root()
    source = tiny_model("LlamaForCausalLM", root / "bench-llama-tokenizer", num_hidden_layers=1,
                        max_position_embeddings=MAX_MODEL_LEN)
    folder = root / f"bench-llama-{name}-shape"
    config = json.loads((source / "config.json").read_text()) | shape | {"dtype": "bfloat16", "torch_dtype": "bfloat16"}
    if folder.is_dir() and json.loads((folder / "config.json").read_text()) == config:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.name.startswith("tokenizer") or file.name in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(file, folder / file.name)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def requests(llm, texts, tokens, detokenize=True):
    """Plain vLLM requests on ``llm`` (a ``vllm.LLM``): greedy, exactly ``tokens`` generated each."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=detokenize)
    llm.generate(texts, params, use_tqdm=False)


def plain_prefill(model, cut: list[list[int]], in_flight: int, detokenize: bool = True) -> None:
    """Plain vLLM requests for ``cut``'s windows, one token each, at most ``in_flight`` at once, as collect submits them.

    ``model``: a vlenvoys model (its engine's plain requests; datasets.py's baseline) or a plain ``vllm.LLM``
    (gate.py's).
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = getattr(model, "vllm_entrypoint", model).llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY, detokenize=detokenize)
    following, running = 0, set()
    while following < len(cut) or running:
        while following < len(cut) and len(running) < in_flight:
            engine.add_request(f"plain-window-{following}", {"prompt_token_ids": cut[following]}, params)
            running.add(f"plain-window-{following}")
            following += 1
        for output in engine.step():
            if output.finished:
                running.discard(output.request_id)


def worker_stats(model) -> dict[str, float]:
    """A vlenvoys engine's worker figures since it began (`vlenvoys.worker.collector.stats`: its row memory, the time its
    collections took in hooks, takes and copies off the device)."""
    return model.vllm_entrypoint.llm_engine.collective_rpc("vlenvoys_collect_stats")[0]


def steered_every_step(model, texts, vector, device, edit, tokens=TOKENS, batch=PER_TRACE):
    """``edit(model, vector)`` at every step of each prompt's generation, ``batch`` invokes per trace.

    The vector travels on the CPU and is moved to ``device`` once per invoke, in the block, on the
    engine: raw nnsight's in-place add needs it on the stream's device (``steer`` would move it
    itself), and every contender pays the same move.
    """
    for start in range(0, len(texts), batch):
        with model.trace(temperature=0.0, max_tokens=tokens, ignore_eos=True) as tracer:
            for text in texts[start : start + batch]:
                with tracer.invoke(text):
                    on_device = vector.to(device)
                    for _ in tracer.iter[0:tokens]:
                        edit(model, on_device)


def steps_served(model, text, read, tokens=TOKENS) -> int:
    """At how many of a generation's ``tokens`` steps a block reached ``read(model)``.

    All of them on an eager engine; fewer where a step replays a CUDA graph that passes no tap,
    which nnsight reports only as a warning (the loop is cut short), so a steering rate measured
    there would not be every step's.
    """
    with model.trace(temperature=0.0, max_tokens=tokens, ignore_eos=True) as tracer:
        seen = list().save()
        with tracer.invoke(text):
            for _ in tracer.iter[0:tokens]:
                read(model)
                seen.append(1)
    return len(seen)


def core_pid(engine) -> int:
    """The process id of an engine's core (where a one-GPU engine's worker runs too)."""
    llm = engine.vllm_entrypoint if hasattr(engine, "vllm_entrypoint") else engine
    return llm.llm_engine.engine_core.resources.engine_manager.processes[0].pid


def profile(folder: Path, engines: dict, runs: dict[str, Callable[[], object]]) -> None:
    """py-spy's samples of the engine core serving each run, as collapsed stacks in ``folder/KEY.txt``."""
    import shutil
    import subprocess

    spy = shutil.which("py-spy")
    if spy is None:
        print("  profile: no py-spy on PATH, skipped", flush=True)
        return
    folder.mkdir(parents=True, exist_ok=True)
    for key, run in runs.items():
        # The engine core (and its worker processes), and this process: the client's side of the run.
        sampled = {"core": (core_pid(engines[key.split(".")[0]]), ["--subprocesses"]), "client": (os.getpid(), [])}
        samplers = [
            subprocess.Popen([spy, "record", "--pid", str(pid), *extra, "--rate", "250", "--format", "raw", "--nonblocking",
                              "--output", str(folder / f"{key}.{side}.txt"), "--duration", "120"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for side, (pid, extra) in sampled.items()
        ]
        time.sleep(1.0)  # py-spy attaches
        run()
        for sampler in samplers:
            sampler.send_signal(2)  # SIGINT: py-spy writes what it sampled and exits
            sampler.wait(30)
        print(f"  profile: {folder}/{key}.*.txt", flush=True)


def github_table(rows, headers) -> str:
    try:
        from tabulate import tabulate
    except ImportError:  # the GPU bundle (tools/gpu-bundle) ships no tabulate
        lines = [headers, ["---"] * len(headers), *rows]
        return "\n".join("| " + " | ".join(map(str, line)) + " |" for line in lines)
    return tabulate(rows, headers=headers, tablefmt="github")


class Board:
    """The CUDA suite's measurements, the rows formed from them, and results-TAG.md/json written from both."""

    def __init__(self, out: Path, tag: str, header: str, repeats: int) -> None:
        self.md, self.json = out / f"results-{tag}.md", out / f"results-{tag}.json"
        self.header, self.repeats = header, repeats
        self.measured: dict[str, tuple[str, float, str]] = {}  # key -> (label, value, unit)
        self.rounds: dict[str, list[float]] = {}  # key -> seconds of each round (paired runs)
        self.notes: list[str] = []
        self.engines: list[str] = []
        self.printed: set[str] = set()

    def note(self, text: str) -> None:
        print(f"  note: {text}", flush=True)
        self.notes.append(text)

    def measure(self, key: str, label: str, unit: str, amount: int, run: Callable[[], object]) -> None:
        """``amount`` (prompts or tokens) over the median seconds of ``run``; a failure is noted, not raised."""
        try:
            value = amount / median_time(run, self.repeats)
        except Exception as error:  # one workload failing should not lose the rest of a one-shot GPU run
            traceback.print_exc()
            self.note(f"{key} ({label}) failed: {type(error).__name__}: {error}")
            return
        self.measured[key] = (label, value, unit)
        self.write()  # a run killed later keeps this
        print(f"  {key}: {label} {value:.4g} {unit}", flush=True)
        for name, row in self.rows().items():
            if name not in self.printed:
                self.printed.add(name)
                print(f"{name}: {row['ours_label']} {row['ours']:.4g} vs {row['baseline_label']} "
                      f"{row['baseline']:.4g} {row['unit']} (ratio {row['ratio']:.3f})", flush=True)

    def measure_rounds(self, key: str, label: str, unit: str, amount: int, seconds: list[float]) -> None:
        """``amount`` over the median of ``seconds``, one per round; rows between two such keys are paired."""
        self.rounds[key] = list(seconds)
        self.measured[key] = (label, amount / statistics.median(seconds), unit)
        self.write()
        print(f"  {key}: {label} {self.measured[key][1]:.4g} {unit} (rounds: "
              f"{', '.join(f'{amount / each:.4g}' for each in seconds)})", flush=True)

    def ratio(self, ours: str, base: str) -> float:
        """The median over rounds of each round's ratio where both were measured in the same rounds, else of medians."""
        paired = self.rounds.get(ours), self.rounds.get(base)
        if paired[0] and paired[1] and len(paired[0]) == len(paired[1]):
            return statistics.median(base_s / ours_s for ours_s, base_s in zip(*paired))
        return self.measured[ours][1] / self.measured[base][1]

    def rows(self) -> dict[str, dict]:
        rows = {}
        for name, ours, base in CUDA_ROWS:
            if ours in self.measured and base in self.measured:
                (ours_label, value, unit), (base_label, baseline, _) = self.measured[ours], self.measured[base]
                rows[name] = {
                    "ours": value,
                    "baseline": baseline,
                    "ratio": self.ratio(ours, base),
                    "unit": unit,
                    "ours_label": ours_label,
                    "baseline_label": base_label,
                }
        return rows

    def write(self, final: bool = False) -> None:
        rows = self.rows()
        self.json.write_text(json.dumps(rows, indent=2) + "\n")
        table = github_table(
            [(name, f"{r['ours']:.4g} ({r['ours_label']})", f"{r['baseline']:.4g} ({r['baseline_label']})",
              f"{r['ratio']:.3f}", r["unit"]) for name, r in rows.items()],
            ("benchmark", "vlenvoys", "baseline", "ratio", "unit"),
        )
        measured = github_table(
            [(key, label, f"{value:.4g}", unit) for key, (label, value, unit) in self.measured.items()],
            ("measurement", "what", "value", "unit"),
        )
        state = "complete run" if final else f"partial run, engines done: {', '.join(self.engines) or 'none'}"
        missing = [name for name, *_ in CUDA_ROWS if name not in rows]
        notes = self.notes + ([f"rows not formed (a side not measured): {', '.join(missing)}"] if missing else [])
        text = (f"# vlenvoys benchmarks on CUDA ({state})\n\n{self.header}\n\n{table}\n\n"
                f"Every measurement (ratios above are between these):\n\n{measured}\n")
        if notes:
            text += "\nNotes:\n\n" + "".join(f"- {note}\n" for note in notes)
        self.md.write_text(text)


def cuda_header(path: Path, config: dict, layers, steer_layer: int, counts: tuple[int, int], repeats: int,
                taps_mode: str, paired: bool = False, tokens: int = TOKENS) -> str:
    import nnsight
    import vllm
    from safetensors import safe_open

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        device = f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"
    else:
        device = "no CUDA device, vLLM's CPU engine (a smoke run of the CUDA suite)"
    memory = psutil.virtual_memory().total / 2**30
    parameters = 0
    for shard in path.glob("*.safetensors"):
        with safe_open(shard, "pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 (safe_open is not a mapping)
                parameters += math.prod(tensors.get_slice(name).get_shape())
    environment = ", ".join(
        f"{name}={os.environ[name]}"
        for name in ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_USE_FLASHINFER_SAMPLER", "VLLM_WORKER_MULTIPROC_METHOD",
                     "VLLM_ATTENTION_BACKEND", "VLLM_USE_BREAKABLE_CUDAGRAPH")
        if name in os.environ
    )
    prefill, generate = counts
    if paired:
        how = (f"Medians over {repeats} rounds after a warm-up round; each round runs every workload of its group once, "
               "and each row's ratio is the median of its rounds' ratios. Engines up at once in one process: plain "
               f"vLLM with CUDA graphs, the vlenvoys engine, the graph engine and {SAME_LABEL} (no torch.compile, "
               f"graphs of pure decode steps only), gpu_memory_utilization {PAIRED_SHARE} "
               f"each, max_model_len {MAX_MODEL_LEN}, prefix caching off (repeats of the same prompts would otherwise "
               "be served from it).")
    else:
        how = (f"Medians of {repeats} runs after a warm-up. Engines one at a time in one process, each shut down "
               f"before the next: gpu_memory_utilization 0.5, max_model_len {MAX_MODEL_LEN}, prefix caching off "
               f"(repeats of the same prompts would otherwise be served from it); nnsight's taps={TAPS} on "
               + ("vLLM's default graph mode." if taps_mode == "default" else
                  "PIECEWISE graphs only (--taps-mode piecewise)"))
    return "\n".join((
        f"Machine: {device}, {os.cpu_count()} cores, {memory:.0f} GiB; torch {torch.__version__}, "
        f"vLLM {vllm.__version__}, nnsight {nnsight.__version__}; vlenvoys-core {vlenvoys.__version__} at {checkout()}",
        "",
        "Model: random-weight LlamaForCausalLM (vlenvoys_testing.tiny_model, seed 0): "
        f"hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, "
        f"{config['num_attention_heads']} query / {config['num_key_value_heads']} kv heads "
        f"of {config.get('head_dim') or config['hidden_size'] // config['num_attention_heads']}, "
        f"intermediate {config['intermediate_size']}, vocab {config['vocab_size']}, bfloat16, "
        f"{parameters / 1e9:.3g}B parameters",
        "",
        f"Workloads: prefill = {prefill} prompts of 16-120 words, one token each (prompts/s); generation = {generate} "
        f"prompts x {tokens} tokens, greedy, ignore_eos{', not detokenized' if paired else ''} (tokens/s). Reads: layer_output (raw: hidden + residual, "
        f"cloned) at layers {', '.join(map(str, layers))}; steering at layer {steer_layer}, every step; "
        f"{PER_TRACE} invokes per trace, collect with its default requests in flight (the engine's max_num_seqs). "
        + how,
        "",
        f"Environment for the engines: {environment or 'no vLLM variables set'}",
    ))


def gpu_free_bytes() -> int:
    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0


def wait_for_release(free_before: int, timeout: float = 60.0) -> bool:
    """Wait until the GPU memory an engine held is free again (its process may take a moment to go)."""
    if not torch.cuda.is_available():
        return True
    torch.cuda.empty_cache()
    deadline = time.monotonic() + timeout
    while gpu_free_bytes() < free_before - 2 * 2**30:  # within 2 GiB of before the first engine
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def stop(engine) -> None:
    """Shut an engine's core (and its worker processes) down: nnsight's VLLM (ours or raw) or a plain vllm.LLM."""
    if hasattr(engine, "vllm_entrypoint"):
        vlenvoys.shutdown(engine)
    else:
        engine.llm_engine.engine_core.shutdown()


def cuda_suite(args) -> None:
    """Five engines one after another on the suite's model; each row is printed once both its sides are measured."""
    cuda = torch.cuda.is_available()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the checkpoint is local; the GPU machine reaches no hub
    if cuda:
        # vLLM 0.32's sampler imports flashinfer unguarded on CUDA; the GPU bundle ships none (GPU_NOTES.md).
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    # This process sets up CUDA (torch.cuda calls here; traced values come home as CUDA tensors), after which
    # an engine started by fork fails ("Cannot re-initialize CUDA in forked subprocess"): pin spawn, so that
    # every engine starts alike and a tapped engine's worker imports vLLM's attention with breakable graphs on.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    size = args.size or ("1b" if cuda else "tiny")
    repeats = args.repeats or 2
    scale = 4 if args.quick else 1
    began = time.perf_counter()

    print(f"checkpoint: random Llama, size {size} (built on first use; a 1b build takes a minute)", flush=True)
    path = cuda_checkpoint(size)
    config = json.loads((path / "config.json").read_text())
    count = config["num_hidden_layers"]
    layers = sorted({count // 4, count // 2, 3 * count // 4})
    steer_layer = count // 2
    prefill = prompts(512 // scale, 16, 120, seed=1)
    generate = prompts(128 // scale, 16, 120, seed=2)
    vector = (torch.randn(config["hidden_size"], generator=torch.Generator().manual_seed(0)) * 4).to(torch.bfloat16)
    device = "cuda" if cuda else "cpu"
    engine_args = {"dtype": "bfloat16", "max_model_len": MAX_MODEL_LEN, "enable_prefix_caching": False}
    if cuda:
        engine_args["gpu_memory_utilization"] = 0.5
    # vLLM's CPU engine would reserve a share of the machine's memory for its KV cache (vlenvoys.load sets its own).
    plain_args = engine_args | ({} if cuda else {"kv_cache_memory_bytes": vlenvoys.engine.CPU_KV_CACHE_BYTES})

    if args.paired:
        generate, tokens = prompts(PAIRED_PROMPTS // scale, 16, 120, seed=2), PAIRED_TOKENS // scale
        repeats = args.repeats or 6
    else:
        tokens = TOKENS
    counts = (len(prefill), len(generate))
    header = cuda_header(path, config, layers, steer_layer, counts, repeats, args.taps_mode, args.paired, tokens)
    board = Board(args.out, args.tag, header, repeats)
    free = gpu_free_bytes()

    def standard_reads(model):
        return [model.layers[i].layer_output for i in layers]

    def raw_reads(model):
        return raw_streams(model, layers)

    # What runs in the blocks is named functions, not lambdas: nnsight ships a function of this script by its
    # source, and a lambda's source inside a call spanning lines costs a parse of this whole file per request.
    def no_reads(model):
        return []

    def steer(model, vector):
        model.steer(steer_layer, vector)

    def raw_steer(model, vector):
        model.model.layers[steer_layer].output[0].add_(vector)  # in place: a tap's replay keeps only in-place edits

    def stream(model):
        return model.layers[steer_layer].layer_output

    def raw_stream(model):
        return model.model.layers[steer_layer].output

    def plain(prefix: str, label: str, llm) -> None:
        board.measure(f"{prefix}.prefill", label, "prompts/s", len(prefill), lambda: requests(llm, prefill, 1))
        board.measure(f"{prefix}.generate", label, "tokens/s", len(generate) * TOKENS,
                      lambda: requests(llm, generate, TOKENS))

    def served(label: str, model, read) -> str:
        """"N/64 steps": how many generation steps a block reaches the steered layer at (see `steps_served`)."""
        try:
            steps = steps_served(model, generate[0], read)
        except Exception as error:
            traceback.print_exc()
            board.note(f"{label}: the steps check failed: {type(error).__name__}: {error}")
            return "steps unchecked"
        if steps < TOKENS:
            board.note(f"{label}: a block reached layer {steer_layer} at {steps} of {TOKENS} generation steps only, "
                       "so its steering rate is not every step's")
        return f"{steps}/{TOKENS} steps"

    def raw(prefix: str, label: str, model) -> None:
        """Raw nnsight on vLLM's modules: 3 stream reads; steering by an in-place add to the layer's hidden output."""
        board.measure(f"{prefix}.trace", f"{label} trace", "prompts/s", len(prefill),
                      lambda: traced(model, prefill, raw_reads, batch=PER_TRACE))
        steps = served(label, model, raw_stream)
        board.measure(f"{prefix}.steer", f"{label} steered ({steps})", "tokens/s", len(generate) * TOKENS,
                      lambda: steered_every_step(model, generate, vector, device, raw_steer))

    def ours(model) -> None:
        plain("vl", "vlenvoys engine, plain", model.vllm_entrypoint)
        board.measure("vl.collect", "vlenvoys collect", "prompts/s", len(prefill),
                      lambda: collect(model, prefill, "layer_output", layers))
        board.measure("vl.trace", "vlenvoys trace", "prompts/s", len(prefill),
                      lambda: traced(model, prefill, standard_reads, batch=PER_TRACE))
        board.measure("vl.empty", "vlenvoys trace, no reads", "prompts/s", len(prefill),
                      lambda: traced(model, prefill, no_reads, batch=PER_TRACE))
        every_step = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
        steering = vlenvoys.Steering(steer_layer, vector)
        board.measure("vl.generate_steered", "vlenvoys.generate, every request steered", "tokens/s",
                      len(generate) * TOKENS,
                      lambda: generate_quietly(model, generate, every_step, steering=steering))
        half = [steering if number % 2 == 0 else None for number in range(len(generate))]
        board.measure("vl.generate_half", "vlenvoys.generate, every other request steered", "tokens/s",
                      len(generate) * TOKENS,
                      lambda: generate_quietly(model, generate, every_step, steering=half))
        steps = served("vlenvoys", model, stream)
        board.measure("vl.steer", f"vlenvoys steered ({steps})", "tokens/s", len(generate) * TOKENS,
                      lambda: steered_every_step(model, generate, vector, device, steer))
        if not cuda and "raw" in args.engines:
            # nnsight's own worker refuses vLLM's CPU runner: its raw paths run on our engine's modules here.
            raw("raw", "raw nnsight (vlenvoys engine)", model)

    def graph_engine(model) -> None:
        plain("vg", "vlenvoys graph engine, plain", model.vllm_entrypoint)
        every_step = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
        steering = vlenvoys.Steering(steer_layer, vector)
        half = [steering if number % 2 == 0 else None for number in range(len(generate))]
        for key, label, each in [("steered", "every request steered", steering), ("half", "every other request steered", half),
                                 ("none", "no request steered", None)]:
            board.measure(f"vg.generate_{key}", f"graph engine: vlenvoys.generate, {label}", "tokens/s",
                          len(generate) * TOKENS,
                          lambda each=each: generate_quietly(model, generate, every_step, steering=each))
        board.measure("vg.collect", "graph engine: vlenvoys collect", "prompts/s", len(prefill),
                      lambda: collect(model, prefill, "layer_output", layers))
        # Plain generation again, last: a drift of the machine over the engine's run shows against the first.
        board.measure("vg.generate_again", "vlenvoys graph engine, plain (measured last)", "tokens/s",
                      len(generate) * TOKENS, lambda: requests(model.vllm_entrypoint, generate, TOKENS))

    def engine(name: str, start: Callable[[], object], work: Callable[[object], None]) -> None:
        """Start one engine, measure on it, shut it down and wait for its GPU memory; a failure is noted."""
        print(f"\n== {name} ({time.perf_counter() - began:.0f} s into the run)", flush=True)
        environ = dict(os.environ)  # nnsight sets VLLM_USE_V2_MODEL_RUNNER, and for taps VLLM_USE_BREAKABLE_CUDAGRAPH
        started = time.perf_counter()
        model = None
        try:
            model = start()
            print(f"  up in {time.perf_counter() - started:.0f} s", flush=True)
            work(model)
            board.engines.append(name)
        except Exception as error:
            traceback.print_exc()
            board.note(f"{name}: {type(error).__name__}: {error}")
        finally:
            if model is not None:
                stop(model)
            del model
            gc.collect()
            os.environ.clear()
            os.environ.update(environ)
            if not wait_for_release(free):
                board.note(f"after {name}, the GPU memory had not come back within 60 s")
            board.write()
            print(f"  {name} done in {time.perf_counter() - started:.0f} s", flush=True)

    from nnsight.modeling.vllm import VLLM
    from vllm import LLM, SamplingParams

    def paired() -> None:
        """Plain vLLM with CUDA graphs, the vlenvoys engine and the graph engine up at once; workloads in rounds.

        The machine's speed drifts between runs minutes apart (plain vLLM's generation measured 14,220 and
        19,600 tokens/s in two runs of one session), so each round runs every contender once, back to back,
        and a row's ratio is the median of its rounds' ratios.
        """
        share = {"gpu_memory_utilization": PAIRED_SHARE} if cuda else {}
        engines: dict[str, object] = {}
        started = time.perf_counter()
        try:
            engines["graphs"] = LLM(str(path), **(plain_args | share))
            engines["vl"] = vlenvoys.load(str(path), **(engine_args | share))
            engines["vg"] = vlenvoys.load(str(path), cuda_graphs=True, **(engine_args | share))
            engines["same"] = LLM(str(path), compilation_config=SAME_GRAPHS, **(plain_args | share))
            print(f"  four engines up in {time.perf_counter() - started:.0f} s", flush=True)
            plain_llm, vl, vg, same = engines["graphs"], engines["vl"], engines["vg"], engines["same"]
            # Not detokenized, on every side: turning token ids into text is the client's work, the same for any
            # engine, and it bounded the run (half of the client's time went to it) where the engine's is measured.
            every_step = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
            steering = vlenvoys.Steering(steer_layer, vector)
            half = [steering if number % 2 == 0 else None for number in range(len(generate))]

            def steered(model, each):
                return lambda: generate_quietly(model, generate, every_step, steering=each)

            groups = [
                ("prompts/s", len(prefill), {
                    "graphs.prefill": ("plain vLLM graphs", lambda: requests(plain_llm, prefill, 1)),
                    "vl.prefill": ("vlenvoys engine, plain", lambda: requests(vl.vllm_entrypoint, prefill, 1)),
                    "vl.collect": ("vlenvoys collect", lambda: collect(vl, prefill, "layer_output", layers)),
                    "vl.trace": ("vlenvoys trace", lambda: traced(vl, prefill, standard_reads, batch=PER_TRACE)),
                    "vl.empty": ("vlenvoys trace, no reads", lambda: traced(vl, prefill, no_reads, batch=PER_TRACE)),
                    "vg.prefill": ("vlenvoys graph engine, plain", lambda: requests(vg.vllm_entrypoint, prefill, 1)),
                    "vg.collect": ("graph engine: vlenvoys collect", lambda: collect(vg, prefill, "layer_output", layers)),
                    "same.prefill": (SAME_LABEL, lambda: requests(same, prefill, 1)),
                }),
                ("tokens/s", len(generate) * tokens, {
                    "graphs.generate": ("plain vLLM graphs", lambda: requests(plain_llm, generate, tokens, False)),
                    "vg.generate": ("vlenvoys graph engine, plain",
                                    lambda: requests(vg.vllm_entrypoint, generate, tokens, False)),
                    "vg.generate_steered": ("graph engine: vlenvoys.generate, every request steered", steered(vg, steering)),
                    "vg.generate_half": ("graph engine: vlenvoys.generate, every other request steered", steered(vg, half)),
                    "vg.generate_none": ("graph engine: vlenvoys.generate, no request steered", steered(vg, None)),
                    "vl.generate": ("vlenvoys engine, plain", lambda: requests(vl.vllm_entrypoint, generate, tokens, False)),
                    "vl.generate_steered": ("vlenvoys.generate, every request steered", steered(vl, steering)),
                    "same.generate": (SAME_LABEL, lambda: requests(same, generate, tokens, False)),
                    # Last in each round, the graph engine's plain generation again: rows 28 and 29 show whether
                    # the place in the round moves the rate.
                    "vg.generate_again": ("vlenvoys graph engine, plain (measured last)",
                                          lambda: requests(vg.vllm_entrypoint, generate, tokens, False)),
                }),
            ]
            for unit, amount, runs in groups:
                rounds: list[dict[str, float]] = []
                interleaved({key: run for key, (_, run) in runs.items()}, repeats, rounds)
                for key, (label, _) in runs.items():
                    board.measure_rounds(key, label, unit, amount, [measured[key] for measured in rounds])
            if args.profile is not None:
                every = {key: run for _, _, runs in groups for key, (_, run) in runs.items()}
                profile(args.profile, engines, {key: every[key] for key in PROFILED})
            board.engines.extend(["plain vLLM, CUDA graphs", "vlenvoys", "vlenvoys, CUDA graphs", SAME_LABEL])
        finally:
            for model in engines.values():
                stop(model)
        board.write(final=True)
        print(f"\n{board.md.read_text()}\nwrote {board.md} and {board.json} in {time.perf_counter() - began:.0f} s")

    if args.paired:
        paired()
        return

    # With vLLM's default FULL_AND_PIECEWISE, a pure decode step replays a FULL graph, which nnsight's taps do not
    # break (they break only vLLM's breakable PIECEWISE graphs); PIECEWISE alone puts every step through them.
    piecewise = {"compilation_config": {"cudagraph_mode": "PIECEWISE"}}
    taps_args = engine_args | (piecewise if args.taps_mode == "piecewise" else {})
    if "graphs" in args.engines and not cuda:
        board.note("plain vLLM with CUDA graphs: skipped, no CUDA device")
    elif "graphs" in args.engines:
        engine("plain vLLM, CUDA graphs", lambda: LLM(str(path), **plain_args),
               lambda llm: plain("graphs", "plain vLLM graphs", llm))
    if "eager" in args.engines:
        engine("plain vLLM, eager", lambda: LLM(str(path), enforce_eager=True, **plain_args),
               lambda llm: plain("eager", "plain vLLM eager", llm))
    if "vlenvoys" in args.engines:
        engine("vlenvoys", lambda: vlenvoys.load(str(path), **engine_args), ours)
    if "vlgraphs" in args.engines:
        engine("vlenvoys, CUDA graphs", lambda: vlenvoys.load(str(path), cuda_graphs=True, **engine_args), graph_engine)
    if "raw" in args.engines and not cuda:
        board.note("raw nnsight's own engine: skipped, its worker refuses vLLM's CPU runner "
                   "(its raw reads and steering ran on the vlenvoys engine's modules instead)")
    elif "raw" in args.engines:
        engine("raw nnsight", lambda: VLLM(str(path), dispatch=True, **engine_args),
               lambda model: raw("raw", "raw nnsight", model))
    if "taps" in args.engines and not cuda:
        board.note("nnsight taps=: skipped, CUDA graphs only")
    elif "taps" in args.engines:
        # Last: taps= turns vLLM's breakable graphs on through this process's environment (restored after).
        engine("nnsight taps", lambda: VLLM(str(path), dispatch=True, taps=TAPS, **taps_args),
               lambda model: (plain("taps", "nnsight taps, plain", model.vllm_entrypoint),
                              raw("taps", "nnsight taps", model)))
    board.write(final=True)
    print(f"\n{board.md.read_text()}\nwrote {board.md} and {board.json} in {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
