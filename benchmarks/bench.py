"""Benchmarks: what vlenvoys costs and what it buys, measured side by side in one run.

Runs on the built-in SmolLM2-135M-Instruct (float32) on vLLM's engine and
writes benchmarks/results.md (medians and ratios) and benchmarks/results.png.
Run with `nox -s bench`. Timings are wall-clock medians over repeats; every
row's ratio compares runs made in this process, on this machine, minutes apart.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil
import torch

import vlenvoys
from vlenvoys.collect import collect

# This file's own folder is on the path when it runs as a script (`python benchmarks/bench.py`).
from workloads import median_time, prompts


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


class PeakRSS:
    """The largest resident memory of this process and vLLM's, sampled every 5 ms while in the block (MiB)."""

    def __enter__(self) -> "PeakRSS":
        self.peak, self._done = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        me = psutil.Process(os.getpid())
        while True:
            try:
                total = sum(p.memory_info().rss for p in (me, *me.children(recursive=True)))
            except psutil.NoSuchProcess:
                continue
            self.peak = max(self.peak, total / 2**20)
            if self._done.wait(0.005):
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
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="fewer prompts, for a smoke run")
    parser.add_argument("--only", type=int, nargs="+", default=[1, 2, 3, 4, 5], help="benchmark sections to run")
    parser.add_argument("--nnterp", type=Path, help="compat/bench_nnterp.py's JSON: adds nnterp-on-transformers rows")
    args = parser.parse_args()
    scale = 4 if args.quick else 1

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vlenvoys.weights import smollm2_path

    path = smollm2_path()
    model = vlenvoys.load(path)
    rows: list[tuple[str, str, float, str, float, str]] = []

    def row(name, ours_label, ours, base_label, base, unit="prompts/s", paired=None):
        rows.append((name, ours_label, ours, base_label, base, unit, paired))
        print(f"{name}: {ours_label} {ours:.3g} vs {base_label} {base:.3g} {unit} (ratio {ratio(ours, base, paired)})", flush=True)

    try:
        # 1. Overhead of the envoys: every layer's stream, attention output and neurons.
        if 1 in args.only:
            texts = prompts(16)
            runs = {"ours": lambda: traced(model, texts, every_layer_standard), "raw": lambda: traced(model, texts, every_layer_raw)}
            rounds: list[dict[str, float]] = []
            seconds = interleaved(runs, 5 * args.repeats, rounds)
            # The ratio within each round, then their median: the machine's drift over the
            # minute this takes moves both runs of a round alike.
            paired = statistics.median(r["ours"] / r["raw"] for r in rounds)
            row("1. envoy overhead (every layer, 3 values)", "vlenvoys s", seconds["ours"], "raw nnsight + clone s", seconds["raw"], "s", paired)

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
                ours = count / median_time(lambda: collected(model, texts), 1)
                plain = count / median_time(lambda: plain_vllm(model, texts), 1)
                row(f"4. collection, {count} prompts of {words} words", "vlenvoys", ours, "plain vLLM", plain)
            for words in (16, 64, 256):
                texts = prompts(1, words, words)
                patterns = median_time(
                    lambda: traced(model, texts, lambda m: [layer.self_attn.attention_probabilities for layer in m.layers]),
                    args.repeats,
                )
                streams = median_time(lambda: traced(model, texts, three_layers_standard), args.repeats)
                row(f"4. every layer's pattern, {words} words", "patterns s", patterns, "3 streams s", streams, "s")

        # 5. Memory, this process (where the values arrive) and vLLM's processes apart, against
        # plain vLLM submitting the same prompts the same way (64 in flight). Both first run 20
        # warm-up rounds: step shapes vary with the window, and the engine's RSS climbs with
        # each new one before it levels off (plain vLLM too); then 10 rounds are measured.
        if 5 in args.only:
            texts = prompts(64 // scale)
            growth, warm_up, peak = {}, {}, {}
            contenders = (("plain", lambda: plain_vllm_windowed(model, texts)), ("ours", lambda: collected(model, texts)))
            for name, run in contenders:
                start = engine_mib(model)
                for _ in range(20):
                    run()
                gc.collect()
                before = (client_mib(), engine_mib(model))
                warm_up[name] = before[1] - start
                for _ in range(10):
                    with PeakRSS() as sampled:
                        kept = run()
                    del kept
                    gc.collect()
                    peak[name] = max(peak.get(name, 0.0), sampled.peak - before[0] - before[1])
                growth[name] = (client_mib() - before[0], engine_mib(model) - before[1])
            row("5a. engine memory growth, 10 rounds", "collect MiB", growth["ours"][1], "plain vLLM MiB", growth["plain"][1], "MiB")
            row("5b. client memory growth, 10 rounds", "collect MiB", growth["ours"][0], "plain vLLM MiB", growth["plain"][0], "MiB")
            row("5c. engine memory, 20 warm-up rounds", "collect MiB", warm_up["ours"], "plain vLLM MiB", warm_up["plain"], "MiB")
            row("5d. peak memory above idle, one round", "collect MiB", peak["ours"], "plain vLLM MiB", peak["plain"], "MiB")
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
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown commit"
    code = ("packages", "benchmarks/bench.py", "benchmarks/workloads.py")
    return commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no", "--", *code) else "")


def write(out: Path, rows) -> None:
    from tabulate import tabulate

    table = tabulate(
        [(name, f"{a:.3g} ({al})", f"{b:.3g} ({bl})", ratio(a, b, paired), unit) for name, al, a, bl, b, unit, paired in rows],
        headers=("benchmark", "vlenvoys", "baseline", "ratio", "unit"),
        tablefmt="github",
    )
    machine = f"{platform.machine()}, {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB, torch {torch.__version__}"
    (out / "results.md").write_text(f"Machine: {machine}; vlenvoys-core {vlenvoys.__version__} at {checkout()}\n\n{table}\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.5))
    names = [name for name, *_ in rows]
    axis.barh(names, [p if p is not None else a / b if b > 0 and a >= 0 else 0.0 for _, _, a, _, b, _, p in rows], color="tab:blue")
    axis.axvline(1.0, color="black", linewidth=0.8)
    axis.invert_yaxis()
    axis.set_xlabel("ratio (vlenvoys / baseline; for seconds and MiB lower is better, for prompts/s higher)")
    axis.set_title(f"vlenvoys benchmarks ({machine})", fontsize=9)
    figure.tight_layout()
    figure.savefig(out / "results.png", dpi=110)
    print((out / "results.md").read_text())


if __name__ == "__main__":
    main()
