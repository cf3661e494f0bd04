"""Activation datasets at scale: vlenvoys.activations.collect_dataset against plain prefill of the same windows.

For each corpus size (tokens of windows) it measures, on one engine:

- tokens/s of ``collect_dataset`` (one value at one layer, bfloat16 shards on
  disk) and of plain vLLM prefill of the same windows with as many in flight;
- the peak memory of this process and vLLM's together (proportional set sizes, sampled every 20 ms)
  during each, to show that a longer corpus does not take more memory;
- the bytes written;
- the client process's CPU time per window (every thread but the memory sampling's; vLLM's engine
  core runs in a process of its own): what the client spends beside the engine, which sets the pace
  where the engine is fast (a GPU's);
- the host memory the engine's worker made for rows during the run, and the seconds it took
  (`vlenvoys.worker.arena.Arena.stats`): the forward waits for each chunk made, and on a GPU page-locking
  alone takes about 0.4 s a GiB. A worker keeps its chunks for the next collection, so a long run
  pays this once; a warm-up collection of ``--warm-windows`` windows (three times the windows in
  flight on a GPU) makes them before the timed runs, which then show the steady state;
- where the time beyond plain prefill's goes on the worker (`vlenvoys.worker.collector.Spent`): its hooks,
  the takes the engine waits for between steps, and on a GPU the copies off the device on the
  forward's own stream (what a copy on a stream of its own would save at most).

On the CPU: the built-in SmolLM2-135M (float32). Where torch sees a GPU:
bench.py's random Llama of a 1B shape in bfloat16. Run with ``nox -s bench``
(CPU sizes) or ``python benchmarks/datasets.py --tokens 1e4 1e5 1e6``.
Writes benchmarks/results/results-datasets-TAG.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

import torch
import vlenvoys
from vlenvoys.activations import collect_dataset, windows

# This file's folder is on the path when it runs as a script.
from bench import (MAX_MODEL_LEN, PeakMemory, cache_root, checkout, cuda_checkpoint, github_table, plain_prefill, stop,
                   worker_stats)
from workloads import prompts


def client_cpu() -> float:
    """CPU seconds this process has used, every thread (vLLM's engine core runs in a process of its own)."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


def made_since(before: dict, after: dict) -> tuple[float, float]:
    """MiB of row memory the worker made between two `worker_stats` readings, and the seconds that took."""
    return (after["made_bytes"] - before["made_bytes"]) / 2**20, after["made_seconds"] - before["made_seconds"]


def spent_since(before: dict, after: dict) -> dict[str, float]:
    """Seconds of the worker's hooks, takes and (on a GPU) copies off the device (on their own stream) between two `worker_stats` readings."""
    return {key: after[key] - before[key] for key in ("hook_seconds", "take_seconds", "copy_seconds")}


def corpus(tokenizer, tokens: int, context_length: int) -> tuple[list[str], list[list[int]]]:
    """Documents that make at least ``tokens`` tokens of windows, and those windows (cut as collect_dataset cuts them)."""
    documents: list[str] = []
    while True:
        documents += prompts(2000, 20, 400, seed=len(documents))
        cut = list(windows(documents, tokenizer, context_length))
        if len(cut) * context_length >= tokens:
            return documents, cut[: tokens // context_length]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=float, nargs="+", help="corpus sizes in tokens (default 1e4 1e5; 1e4 1e5 1e6 on a GPU)")
    parser.add_argument("--context-length", type=int, default=128, help="tokens per window (128, as SAE training code uses)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each side below 1e5 tokens (one above)")
    parser.add_argument("--tag", help="results-datasets-TAG.* (default cpu, or h200 on a GPU)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--folder", type=Path, help="where the shards go (a temporary folder, removed after each run)")
    parser.add_argument("--warm-windows", type=int,
                        help="windows of the warm-up collection (default: three times the windows in flight on a GPU, 8 on the CPU)")
    parser.add_argument("--tiny", action="store_true",
                        help="on the CPU, a random Llama of hidden 512 instead of SmolLM2 (about 13 times its tokens/s: 1e6 tokens in minutes)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    sizes = [int(size) for size in (args.tokens or ([1e4, 1e5, 1e6] if cuda else [1e4, 1e5]))]
    tag = args.tag or ("h200" if cuda else "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if cuda:
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # GPU_NOTES.md: the bundle has no flashinfer
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        path = cuda_checkpoint("1b")
        model = vlenvoys.load(str(path), dtype="bfloat16", max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False,
                              gpu_memory_utilization=0.5)
        described = "random Llama, 1B shape, bfloat16"
    elif args.tiny:
        from vlenvoys_testing import tiny_model

        path = tiny_model("LlamaForCausalLM", cache_root() / "bench-llama-512", hidden_size=512, intermediate_size=1024)
        model = vlenvoys.load(str(path), enable_prefix_caching=False)
        described = "random Llama, hidden 512, 3 blocks, float32"
        tag = args.tag or "cpu-tiny"
    else:
        from vlenvoys.weights import smollm2_path

        path = smollm2_path()
        model = vlenvoys.load(str(path), enable_prefix_caching=False)
        described = "SmolLM2-135M-Instruct, float32"
    layer = model.num_layers // 2
    in_flight = model.vllm_entrypoint.llm_engine.vllm_config.scheduler_config.max_num_seqs
    scratch = Path(tempfile.mkdtemp(prefix="vlenvoys-datasets-", dir=args.folder))
    rows, measured = [], []
    try:
        warm_windows = args.warm_windows or (3 * in_flight if cuda else 8)
        texts, warm = corpus(model.tokenizer, warm_windows * args.context_length, args.context_length)
        # Warm-up of both sides: the first collection installs its hooks and makes the worker's row memory.
        plain_prefill(model, warm, in_flight)
        before, start = worker_stats(model), time.perf_counter()
        collect_dataset(model, texts, scratch / "warm", "layer_output", [layer], context_length=args.context_length,
                        max_tokens=len(warm) * args.context_length, progress=False)
        warm_seconds, warm_made = time.perf_counter() - start, made_since(before, worker_stats(model))
        print(f"warm-up: {len(warm)} windows in {warm_seconds:.2f} s; the worker made {warm_made[0]:,.0f} MiB of row memory "
              f"in {warm_made[1]:.2f} s", flush=True)
        for size in sizes:
            documents, cut = corpus(model.tokenizer, size, args.context_length)
            tokens = len(cut) * args.context_length
            repeats = args.repeats if size < 100_000 else 1
            plain_seconds, ours_seconds, plain_peak, ours_peak, written = [], [], 0.0, 0.0, 0
            plain_cpu, ours_cpu = [], []  # the client process's CPU seconds (every thread; the engine runs in its own)
            made_mib, made_seconds = 0.0, 0.0  # row memory the worker made during the timed collections
            spent = []  # per timed collection: the worker's `spent_since`
            for _ in range(repeats):
                with PeakMemory() as peak:
                    start, cpu = time.perf_counter(), client_cpu()
                    plain_prefill(model, cut, in_flight)
                    plain_seconds.append(time.perf_counter() - start)
                    plain_cpu.append(client_cpu() - cpu)
                plain_cpu[-1] -= peak.cpu  # not the memory sampling's
                plain_peak = max(plain_peak, peak.peak)
                folder = scratch / "acts"
                before = worker_stats(model)
                with PeakMemory() as peak:
                    start, cpu = time.perf_counter(), client_cpu()
                    collect_dataset(model, documents, folder, "layer_output", [layer], context_length=args.context_length,
                                    max_tokens=tokens, progress=False)
                    ours_seconds.append(time.perf_counter() - start)
                    ours_cpu.append(client_cpu() - cpu)
                after = worker_stats(model)
                mib, seconds = made_since(before, after)
                made_mib, made_seconds = made_mib + mib, made_seconds + seconds
                spent.append(spent_since(before, after))
                ours_cpu[-1] -= peak.cpu
                ours_peak = max(ours_peak, peak.peak)
                written = sum(file.stat().st_size for file in folder.iterdir())
                shutil.rmtree(folder)
            plain_rate, ours_rate = tokens / min(plain_seconds), tokens / min(ours_seconds)
            plain_us, ours_us = (1e6 * min(each) / len(cut) for each in (plain_cpu, ours_cpu))
            # The columns of times are the best runs', as the ratio's: the gap is best against best, the worker's
            # figures those of the best collection.
            gap = min(ours_seconds) - min(plain_seconds)
            best = min(range(repeats), key=lambda index: ours_seconds[index])
            worker_ms = {key.removesuffix("_seconds"): 1e3 * value for key, value in spent[best].items()}
            measured.append({"tokens": tokens, "plain_tokens_per_s": plain_rate, "dataset_tokens_per_s": ours_rate,
                             "plain_peak_mib": plain_peak, "dataset_peak_mib": ours_peak, "bytes_written": written,
                             "plain_client_us_per_window": plain_us, "dataset_client_us_per_window": ours_us,
                             "worker_made_mib": made_mib, "worker_made_seconds": made_seconds, "repeats": repeats,
                             "gap_ms": 1e3 * gap, **{f"worker_{key}_ms": value for key, value in worker_ms.items()}})
            rows.append((f"{tokens:,}", f"{ours_rate:,.0f}", f"{plain_rate:,.0f}", f"{ours_rate / plain_rate:.3f}",
                         f"{ours_peak:,.0f}", f"{plain_peak:,.0f}", f"{written / 2**20:,.0f}", f"{ours_us:,.0f}", f"{plain_us:,.0f}",
                         f"{made_mib:,.0f} in {made_seconds:.2f} s", f"{1e3 * gap:,.0f}",
                         " / ".join(f"{worker_ms[key]:,.0f}" for key in ("hook", "take", "copy"))))
            print(" | ".join(rows[-1]), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        stop(model)
    headers = ("tokens", "collect_dataset tok/s", "plain prefill tok/s", "ratio", "collect_dataset peak MiB",
               "plain prefill peak MiB", "written MiB", "collect_dataset client CPU µs/window", "plain prefill client CPU µs/window",
               "row memory the worker made (MiB)", "collect_dataset's ms beyond plain prefill's",
               "worker's ms in hooks / takes / copies on the forward's stream")
    device = torch.cuda.get_device_name() if cuda else f"CPU, {os.cpu_count()} cores"
    header = (f"{device}; {described}; layer_output at block {layer}, windows of {args.context_length} tokens, "
              f"{in_flight} in flight, bfloat16 shards; peak = this process and vLLM's, proportional set size (shared pages once); "
              f"best of the runs; after a warm-up collection of {len(warm)} windows, which made {warm_made[0]:,.0f} MiB of the "
              f"worker's row memory in {warm_made[1]:.2f} s; vlenvoys-core {vlenvoys.__version__} at {checkout()}")
    table = github_table(rows, headers)
    (args.out / f"results-datasets-{tag}.md").write_text(f"{header}\n\n{table}\n")
    (args.out / f"results-datasets-{tag}.json").write_text(json.dumps({"header": header, "rows": measured}, indent=1))
    print(f"{header}\n\n{table}")


if __name__ == "__main__":
    main()
