"""The repository's examples/ (#49 item 3) run as a user runs them, each in a process of its own, with ``--tiny``:
a tiny random Llama for the built-in model. Each writes its plot (a PNG) and its results (JSON)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
PNG = b"\x89PNG\r\n\x1a\n"


def run(script: str, out: Path, *arguments: str) -> dict:
    """``python examples/SCRIPT --tiny --out OUT ARGUMENTS``; its results (``OUT/<script>.json``)."""
    path = EXAMPLES / script
    if not path.is_file():
        pytest.fail(f"no example at {path}: its tests run from a checkout of the repository")
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    ran = subprocess.run([sys.executable, str(path), "--tiny", "--out", str(out), *arguments], capture_output=True, text=True,
                         timeout=1200, env=environment)
    assert ran.returncode == 0, f"{script} exited {ran.returncode}:\n{ran.stdout[-3000:]}\n{ran.stderr[-6000:]}"
    plot = out / f"{path.stem}.png"
    assert plot.read_bytes()[:8] == PNG and plot.stat().st_size > 10_000, f"{script}: no plot at {plot}"
    assert f"wrote {plot}" in ran.stdout
    return json.loads((out / f"{path.stem}.json").read_text())


def test_logit_lens(tmp_path):
    results = run("logit_lens.py", tmp_path, "--prompt", "The capital of France is", "--top", "2")
    assert results["prompt"] == "The capital of France is"
    assert len(results["blocks"]) == 3 and all(len(block) == 2 for block in results["blocks"])  # the tiny Llama's 3 blocks
    for block in results["blocks"]:
        assert 0 < block[1]["probability"] <= block[0]["probability"] <= 1


def test_attention_pattern(tmp_path):
    results = run("attention_pattern.py", tmp_path, "--layer", "-1")
    tokens = results["shape"][-1]
    assert results["layer"] == 2 and results["shape"] == [4, tokens, tokens]  # 4 heads, query x key
    assert len(results["last_query"]) == 4
    for head in results["last_query"]:
        assert 0 <= head["key"] < tokens and 1 / tokens <= head["probability"] <= 1


def test_steering_vector_served(tmp_path):
    """Means collected in-process, the vector served by `vlenvoys serve` and asked for with the openai client: the
    steered completions differ from the plain ones."""
    results = run("steering_vector.py", tmp_path, "--factor", "8", "--max-tokens", "8")
    assert results["layer"] == 1 and results["vector_norm"] > 0
    from safetensors.torch import load_file

    assert load_file(str(tmp_path / "vectors.safetensors"))["positive"].shape == (128,)
    assert len(results["completions"]) == 2
    assert any(each["steered"] != each["plain"] for each in results["completions"]), results
    assert all(each["plain"] and each["steered"] for each in results["completions"])


def test_train_sae(tmp_path):
    results = run("train_sae.py", tmp_path, "--epochs", "4")
    assert results["key"] == "layer_output.1" and results["features"] == 8 * 128
    assert results["steps"] >= 20 and results["last_loss"] < results["first_loss"]
    assert 0 < results["active_features"] < results["features"]
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "sae.safetensors"))
    assert weights["encoder.weight"].shape == (8 * 128, 128) and weights["decoder.weight"].shape == (128, 8 * 128)
    assert (tmp_path / "activations" / "manifest.json").is_file()


def test_compare_with_transformers(tmp_path):
    """The recipe a user runs to check vlenvoys on a checkpoint of their own: every block's four values against
    transformers' modules, two prompts, within the oracle's bound (and not all equal, which would mean one side
    was read twice)."""
    results = run("compare_with_transformers.py", tmp_path, "--prompt", "The capital of France is", "--prompt",
                  "One two three")
    assert results["values"] == ["layer_input", "attention_output", "mlp_output", "layer_output"]
    differences = results["relative_differences"]
    assert len(differences) == 3 and all(len(block) == 4 for block in differences)  # the tiny Llama's 3 blocks
    assert 0 < results["largest"] <= 1e-4, results
    assert results["largest"] == max(max(block) for block in differences)
