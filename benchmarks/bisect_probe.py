"""Bisect probe: one commit's vlenvoys (first on PYTHONPATH) timed on its own eager engine, for benchmarks/bisect.sh.

    python bisect_probe.py CHECKPOINT TAG TURN COUNT FOLDER

Starts the vlenvoys engine (eager, a small share of the GPU), waits until COUNT probes are up, then,
when turn TURN comes (FOLDER/done-<TURN-1>), times plain prefill, collect, a 3-read trace, plain
generation and vlenvoys.generate (none and every request steered) in rounds, and writes
FOLDER/result-TAG.json. Several commits' probes side by side on one GPU measure minutes apart on
one machine, which is what found the cause of #45 (collect: 0.43 s per 512 prompts at 5919979,
0.90 s at 0aef5f2).
"""
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
path, tag, turn, count, folder = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
ROUNDS = int(os.environ.get("PROBE_ROUNDS", "3"))


def main():
    import torch
    import vlenvoys
    from vlenvoys.collect import collect
    from vllm import SamplingParams

    import random

    words = ("the quick brown fox jumps over a lazy dog while seven tired sailors sing about distant islands "
             "and golden rivers under a pale morning sky full of quiet birds and old stories").split()

    def prompts(n, low, high, seed):
        draw = random.Random(seed)
        lengths = [draw.randint(low, high) for _ in range(n)]
        starts = [draw.randrange(len(words)) for _ in range(n)]
        return [" ".join(words[(s + i) % len(words)] for i in range(k)) for s, k in zip(starts, lengths)]

    prefill, generate = prompts(512, 16, 120, 1), prompts(256, 16, 120, 2)
    began = time.perf_counter()
    model = vlenvoys.load(path, dtype="bfloat16", max_model_len=1024, enable_prefix_caching=False,
                          gpu_memory_utilization=0.07, kv_cache_memory_bytes=2 << 30)
    print(f"{tag}: up in {time.perf_counter() - began:.0f} s", flush=True)
    (folder / f"ready-{turn}").touch()
    deadline = time.monotonic() + 240
    while len(list(folder.glob("ready-*"))) < count and time.monotonic() < deadline:
        time.sleep(0.2)
    while turn and not (folder / f"done-{turn - 1}").exists():
        time.sleep(0.2)
    llm = model.vllm_entrypoint
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    steps = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, detokenize=False)
    vector = torch.randn(model.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) * 4

    def reads(m):
        return [m.layers[i].layer_output for i in (4, 8, 12)]

    def trace3():
        kept = []
        for start in range(0, len(prefill), 64):
            with model.trace(temperature=0.0, max_tokens=1) as tracer:
                saved = list().save()
                for text in prefill[start:start + 64]:
                    with tracer.invoke(text):
                        saved.append(reads(model))
            kept.extend(saved)

    runs = {
        "prefill": lambda: llm.generate(prefill, one, use_tqdm=False),
        "collect": lambda: collect(model, prefill, "layer_output", [4, 8, 12]),
        "trace3": trace3,
        "generate": lambda: llm.generate(generate, steps, use_tqdm=False),
        "gen_none": lambda: vlenvoys.generate(model, generate, steps, steering=None, use_tqdm=False),
        "gen_steered": lambda: vlenvoys.generate(model, generate, steps, steering=vlenvoys.Steering(8, vector), use_tqdm=False),
    }
    times = {name: [] for name in runs}
    for r in range(ROUNDS + 1):
        for name, run in runs.items():
            t = time.perf_counter()
            try:
                run()
            except Exception as error:  # noqa: BLE001
                print(f"{tag} {name} failed: {error!r}", flush=True)
                times[name] = None
                continue
            if r and times[name] is not None:
                times[name].append(time.perf_counter() - t)
    result = {"tag": tag, "median_s": {k: (statistics.median(v) if v else None) for k, v in times.items()}, "rounds": times}
    m = result["median_s"]
    if m["prefill"] and m["collect"]:
        result["collect/prefill"] = m["prefill"] / m["collect"]
    if m["generate"] and m["gen_none"]:
        result["gen_none/generate"] = m["generate"] / m["gen_none"]
    if m["generate"] and m["gen_steered"]:
        result["gen_steered/generate"] = m["generate"] / m["gen_steered"]
    if m["prefill"] and m["trace3"]:
        result["trace3/prefill"] = m["prefill"] / m["trace3"]
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}), flush=True)
    (folder / f"result-{tag}.json").write_text(json.dumps(result, indent=1))
    (folder / f"done-{turn}").touch()
    vlenvoys.shutdown(model)


if __name__ == "__main__":
    try:
        main()
    finally:
        (folder / f"done-{turn}").touch()
