"""A steering vector from collected means, served: the difference of two prompt sets' mean residual streams,
added to the stream of `vlenvoys serve`'s completions through the ``steering`` field, called with the openai client.

1. `vlenvoys.collect` reads ``layer_output`` of every block for a set of
   positive and a set of negative prompts; each prompt's stream is averaged
   over its tokens, each set's over its prompts. The vector is the positive
   mean less the negative one at ``--layer``.
2. The vector is saved to a safetensors file and the engine shut down.
3. ``vlenvoys serve MODEL --vectors FILE`` serves the same checkpoint with the
   vector registered by name; each prompt is completed twice with the openai
   client, plainly and with ``"steering": [{"value": "layer_output", "layer": L,
   "vector": "positive", "factor": F}]``.

    python examples/steering_vector.py                  # the built-in SmolLM2-135M-Instruct
    python examples/steering_vector.py --layer 12 --factor 8
    python examples/steering_vector.py --tiny           # a tiny random Llama (needs vlenvoys-testing), as CI runs it

Writes ``steering_vector.png`` (how far apart the two sets' means are at every block, and each prompt's
projection on the vector at ``--layer``), ``vectors.safetensors``, ``steering_vector.json`` (the completions)
and ``serve.log`` to ``--out``. Needs the ``openai`` package (vLLM installs it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import torch
import vlenvoys
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from safetensors.torch import save_file
from vlenvoys.weights import smollm2_path

POSITIVE = [
    "I love this, it is wonderful and makes me so happy.",
    "What a joyful, beautiful day; everything is going well.",
    "Thank you so much, this is the best gift I have ever had.",
    "The concert was amazing and we had a great time together.",
    "I am delighted with the results, they are excellent.",
    "She smiled warmly and hugged her dear friends.",
]
NEGATIVE = [
    "I hate this, it is awful and makes me so angry.",
    "What a miserable, ugly day; everything is going wrong.",
    "No thanks, this is the worst gift I have ever had.",
    "The concert was terrible and we had an awful time together.",
    "I am disgusted with the results, they are dreadful.",
    "She frowned bitterly and shouted at her rude neighbours.",
]
QUESTIONS = ["I think that the new restaurant in town is", "Today at work, my boss told me that"]
#: The name the server gives the model and the vector.
SERVED, VECTOR = "example", "positive"


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layer", type=int, help="the block to steer, negative from the end (default: 8; with --tiny, 1)")
    parser.add_argument("--factor", type=float, default=6.0, help="the vector's multiple added to the stream")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens per completion")
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for the plot, the vector and the results")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of the built-in model (for CI)")
    return parser.parse_args(argv)


def checkpoint(tiny: bool, out: Path) -> Path:
    """The built-in SmolLM2-135M-Instruct's folder, or with ``tiny`` a tiny random Llama built into ``out``."""
    if not tiny:
        return smollm2_path()
    import vlenvoys_testing  # test support: tiny random checkpoints with a tokenizer

    return vlenvoys_testing.tiny_model("LlamaForCausalLM", out / "tiny-llama")


def mean_streams(model: vlenvoys.StandardizedVLLM, prompts: list[str]) -> torch.Tensor:
    """``[prompts, blocks, hidden_size]``: each prompt's ``layer_output`` at every block, averaged over its tokens."""
    blocks = list(range(model.num_layers))
    values = vlenvoys.collect(model, prompts, "layer_output", blocks)
    return torch.stack([torch.stack([values[f"layer_output.{block}"][index][0].float().mean(0) for block in blocks])
                        for index in range(len(prompts))])


def plot(positive: torch.Tensor, negative: torch.Tensor, layer: int, path: Path) -> Path:
    """Left: the distance of the two means at every block, over the mean stream norm. Right: each prompt's
    projection on the unit vector at ``layer``."""
    difference = positive.mean(0) - negative.mean(0)  # [blocks, hidden]
    scale = torch.cat([positive, negative]).norm(dim=-1).mean(0)
    figure = Figure(figsize=(10, 4), layout="constrained")
    left, right = figure.subplots(1, 2)
    left.plot(range(len(scale)), (difference.norm(dim=-1) / scale).numpy(), marker="o")
    left.axvline(layer, color="grey", linestyle="--", label=f"steered block {layer}")
    left.xaxis.set_major_locator(MaxNLocator(integer=True))
    left.set_xlabel("block")
    left.set_ylabel("|mean(positive) - mean(negative)| / mean |stream|")
    left.set_title("how far apart the two sets are")
    left.legend()
    direction = difference[layer] / difference[layer].norm()
    for label, streams, colour in (("positive", positive, "tab:green"), ("negative", negative, "tab:red")):
        projections = (streams[:, layer] @ direction).numpy()
        right.scatter(projections, [label] * len(projections), color=colour, s=40)
    right.set_xlabel(f"projection on the steering vector (block {layer})")
    right.set_title("each prompt's mean stream")
    figure.savefig(path, dpi=120)
    return path


@contextlib.contextmanager
def served(model: Path, vectors: Path, log: Path, started_within: float = 600) -> Iterator[str]:
    """``vlenvoys serve MODEL --vectors VECTORS`` on a free local port for the ``with`` body; yields its URL.

    The same as typing ``vlenvoys serve MODEL --vectors VECTORS`` in a shell, run by this Python; the server
    and its engine get SIGINT at the end (SIGKILL a minute later if still there).
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-c", "from vlenvoys.cli import app; app()", "serve", str(model), "--vectors", str(vectors),
               "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as output:
        server = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + started_within
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"vlenvoys serve exited ({server.returncode}); see {log}:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"vlenvoys serve did not answer within {started_within} s; see {log}")
            time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGINT)  # the server's group holds its engine's processes too
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(10)


def main(argv: list[str] | None = None) -> dict:
    options = arguments(argv)
    options.out.mkdir(parents=True, exist_ok=True)
    path = checkpoint(options.tiny, options.out)

    model = vlenvoys.load(str(path))
    try:
        layer = options.layer if options.layer is not None else (1 if options.tiny else 8)
        model.layers[layer]  # a block that does not exist: vlenvoys.NoSuchBlock, before any work
        layer %= model.num_layers
        positive, negative = mean_streams(model, POSITIVE), mean_streams(model, NEGATIVE)
    finally:
        vlenvoys.shutdown(model)  # its memory goes back before the server takes its own
    vector = positive[:, layer].mean(0) - negative[:, layer].mean(0)
    save_file({VECTOR: vector.contiguous()}, str(options.out / "vectors.safetensors"))
    plot(positive, negative, layer, options.out / "steering_vector.png")

    from openai import OpenAI

    steering = [{"value": "layer_output", "layer": layer, "vector": VECTOR, "factor": options.factor}]
    completions = []
    with served(path, options.out / "vectors.safetensors", options.out / "serve.log") as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="EMPTY")
        for prompt in QUESTIONS:
            asked = dict(model=SERVED, prompt=prompt, max_tokens=options.max_tokens, temperature=0.0)
            plain = client.completions.create(**asked).choices[0].text
            steered = client.completions.create(**asked, extra_body={"steering": steering}).choices[0].text
            completions.append({"prompt": prompt, "plain": plain, "steered": steered})
    results = {"layer": layer, "factor": options.factor, "vector_norm": round(float(vector.norm()), 4), "completions": completions}
    (options.out / "steering_vector.json").write_text(json.dumps(results, indent=1))
    for each in completions:
        print(f"{each['prompt']!r}\n  plain:   {each['plain']!r}\n  steered: {each['steered']!r}")
    print(f"wrote {options.out / 'steering_vector.png'}")
    return results


if __name__ == "__main__":  # vLLM starts its engine in processes that import this file again
    main()
