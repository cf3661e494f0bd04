"""Where a served capture's time goes on the CPU engine: the server's stages one by one, and whole rounds.

Two parts, printed as markdown:

- stages: the server's and the client's work on one round's values, with no
  engine: rows laid out as the engine's handover leaves them (float32, a
  ``[rows, hidden]`` block per request and block), run through the server's
  own functions (`_values`, `Held.put`, the fetch's body) and the client's
  parse (`vlenvoys.serve.client`), each timed alone;
- rounds: ``vlenvoys serve`` on a random Llama of hidden 2048 and
  ``--blocks`` blocks (float32, so each captured row is as many bytes as the
  gate's), ``--requests`` concurrent completions of ``--tokens`` tokens,
  prompts of 16..120 words; plain requests against the same requests
  capturing ``layer_output`` at blocks 0 and 1, every prompt position, float32,
  fetched (the gate's ``capturing`` request). ``--profile`` records the
  server with py-spy meanwhile and prints its busiest functions.

Run: ``python benchmarks/serve_capture_cost.py [--requests 24 --tokens 4]``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench import cache_root  # noqa: E402
from workloads import prompts  # noqa: E402


def checkpoint(blocks: int) -> Path:
    from vlenvoys_testing import tiny_model

    return tiny_model(
        "LlamaForCausalLM", cache_root() / f"capture-cost-llama-2048x{blocks}", dtype="float32", hidden_size=2048,
        num_hidden_layers=blocks, num_attention_heads=32, num_key_value_heads=8, head_dim=64, intermediate_size=1024,
        max_position_embeddings=1024,
    )


def timed(run, repeats: int = 5, before=None) -> float:
    """Median CPU seconds of ``run`` (this thread's: the machine may be busy with other work), after a warm-up;
    ``before()``, untimed, before each call, and its result passed to ``run``."""
    times = []
    for _ in range(repeats + 1):
        given = () if before is None else (before(),)
        began = time.thread_time()
        run(*given)
        times.append(time.thread_time() - began)
    return statistics.median(times[1:])


def stages(requests: int, rows: int, hidden: int = 2048) -> list[tuple[str, float, int]]:
    """(stage, seconds for ``requests`` captures of 2 blocks x ``rows`` positions, bytes it moves)."""
    from vlenvoys.serve import capture, client

    torch.set_num_threads(1)  # one thread's CPU time is the stage's
    # The handover's rows: one [rows, hidden] block per request and block (views of the engine's memory).
    arena = torch.randn(2, requests, rows + 4, hidden)
    taken = {
        "order": [f"r{i}" for i in range(requests)], "missing": {}, "prompts": {f"r{i}": rows for i in range(requests)},
        "values": {f"layer_output.{layer}": [arena[n, i] for i in range(requests)] for n, layer in enumerate((2, 5))},
    }
    entries = [{"value": "layer_output", "owner": "layer", "layers": [2, 5], "positions": "prompt", "dtype": "float32"}]
    size = requests * 2 * rows * hidden * 4
    out = []

    if not hasattr(capture, "Image"):  # before: copied into tensors, held, serialized by safetensors, parsed by it
        def values():
            return [capture._values(taken, f"r{i}", i, {}, entries, 4) for i in range(requests)]

        out.append(("`_values` (rows picked, stacked, cast)", timed(values), size))
        each = values()
        held = capture.Held(most=64 << 30)
        names = []

        def put():
            names[:] = [held.put({entry["value"]: tensor for entry, tensor in one}) for one in each]

        out.append(("`Held.put`", timed(put), size))
        put()
        together = {f"{name}/layer_output": held.held[name][2]["layer_output"] for name in names}

        def build():
            return capture.as_file(together, {"gone": "{}"})

        out.append(("fetch body (safetensors `save` of them all)", timed(build), size))
        data = build()
        parse = timed(lambda: client._files_of(data, names))
        out.append(("client parse (`_files_of`: safetensors `load`)", parse, size))
        return out
    made = []

    def values():
        made[:] = [capture._values(taken, f"r{i}", i, {}, entries, 4, True)[1] for i in range(requests)]

    out.append(("`_values` into /dev/shm files (one copy, file made)", timed(values), size))
    held = capture.Held(most=64 << 30)
    names = []

    def put(_=None):
        names[:] = [held.put(image) for image in made]

    out.append(("`Held.put`", timed(put, before=values), size))
    images = {name: held.held[name][2] for name in names}
    body = timed(lambda: capture.fetch_body(images, {"gone": "{}"}))
    out.append(("fetch body (`fetch_body`: header, views)", body, size))
    data = bytearray(b"".join(bytes(part) for part in capture.fetch_body(images, {"gone": "{}"})))
    parse = timed(lambda: client._captures(data, names, True))
    out.append(("client parse of an HTTP body (`_captures`: views)", parse, size))

    def hand_over():
        values()
        put()
        return [held.hand_over(name)[0] for name in names]

    out.append(("`Held.hand_over` (local=1)", timed(lambda _: [held.hand_over(name) for name in names],
                                                   before=lambda: (values(), put())), size))
    out.append(("client map of handed files (`_held`, local=1)",
                timed(lambda paths: [client._held(path) for path in paths], before=hand_over), size))
    return out


def cpu(pid: int) -> tuple[float, float]:
    """CPU seconds so far of the server process ``pid`` (its HTTP side) and of its descendants (the engine's)."""
    import psutil

    server = psutil.Process(pid)
    engine = 0.0
    for child in server.children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.Error:
            continue
        engine += times.user + times.system
    times = server.cpu_times()
    return times.user + times.system, engine


async def rounds(url: str, pid: int, texts: list[str], tokens: int, kinds: list[str], count: int) -> dict:
    """``count`` rounds of each of ``kinds`` in turn (after a warm-up of each): each round's wall seconds and CPU
    seconds of the server's HTTP process, its engine's processes and this client process."""
    import serve
    from serve import completions

    # The gate's capturing request, at the first two blocks (the checkpoint has few): as many bytes a row.
    serve.FIELDS["capturing"] = {**serve.FIELDS["capturing"], "capture": [{"value": "layer_output", "layers": [0, 1]}]}
    async def one(kind: str) -> None:
        if kind != "capturing over HTTP":
            return await completions(url, "bench", texts, tokens, 1, kind)
        import vlenvoys.capturing as capturing

        alone, capturing.fetch_async = capturing.fetch_async, functools.partial(capturing.fetch_async, local=False)
        try:
            await completions(url, "bench", texts, tokens, 1, "capturing")
        finally:
            capturing.fetch_async = alone

    for kind in kinds:
        await one(kind)  # warm-up
    got = {kind: [] for kind in kinds}
    for _ in range(count):
        for kind in kinds:
            began, client, (http, engine) = time.perf_counter(), time.process_time(), cpu(pid)
            await one(kind)
            after = cpu(pid)
            got[kind].append((time.perf_counter() - began, after[0] - http, after[1] - engine,
                              time.process_time() - client))
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stages-only", action="store_true")
    parser.add_argument("--profile", type=Path, help="py-spy's raw output of the server during the capturing rounds")
    options = parser.parse_args()
    from vlenvoys.serve.server import anyio_classes_first
    from vlenvoys_testing import http_server

    anyio_classes_first()
    texts = prompts(options.requests, 16, 120, seed=3)
    print("| stage | seconds | MB/s |\n|---|---|---|")
    for stage, seconds, size in stages(options.requests, 100):
        print(f"| {stage} | {seconds:.4f} | {size / seconds / 1e6:.0f} |")
    if options.stages_only:
        return
    model = checkpoint(options.blocks)
    folder = Path(tempfile.mkdtemp(prefix="vlenvoys-capture-cost-"))
    command = [sys.executable, "-c", "from vlenvoys.cli import app; app()", "serve", "--model", str(model),
               "--dtype", "float32", "--max-model-len", "1024", "--served-model-name", "bench",
               "--no-enable-prefix-caching", "--kv-cache-memory-bytes", str(1 << 30), "--enforce-eager"]
    with http_server(command, folder / "vlenvoys.log", started_within=600) as served:
        spy = None
        if options.profile:
            spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(served["pid"]),
                                    "--format", "raw", "--rate", "50", "--nonblocking",
                                    "--output", str(options.profile)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        import inspect

        from vlenvoys.capturing import fetch_async

        # Where the client may map the server's files (local=1, its default here), also the same over HTTP.
        local = "local" in inspect.signature(fetch_async).parameters
        kinds = ["plain", "capturing", *(["capturing over HTTP"] if local else [])]
        got = asyncio.run(rounds(served["url"], served["pid"], texts, options.tokens, kinds, options.rounds))
        if spy is not None:
            spy.send_signal(2)
            spy.wait(60)
    print(f"\n{options.requests} requests x {options.tokens} tokens a round, {options.rounds} rounds of each "
          "(medians; CPU seconds of the server's HTTP process, its engine's processes, the client):\n")
    print("| round | wall s | server HTTP CPU s | engine CPU s | client CPU s |\n|---|---|---|---|---|")
    for kind, each in got.items():
        medians = [statistics.median(column) for column in zip(*each, strict=True)]
        print(f"| {kind} | " + " | ".join(f"{value:.2f}" for value in medians) + " |")
    print("\nevery round:", {kind: [[round(value, 2) for value in one] for one in each] for kind, each in got.items()})
    if options.profile and options.profile.exists():
        top(options.profile)


def top(path: Path, count: int = 25) -> None:
    """The server's functions by samples they are on the stack of (py-spy's raw format), the API server thread's."""
    own, total = Counter(), 0
    for line in path.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        frames = stack.split(";")
        total += int(samples)
        for frame in set(frames):
            own[frame] += int(samples)
    print(f"\n{total} samples; functions on the most stacks:")
    for frame, samples in own.most_common(count):
        print(f"  {samples / total:6.1%}  {frame[:150]}")


if __name__ == "__main__":
    main()
