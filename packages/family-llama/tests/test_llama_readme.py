"""README's Python code blocks, run as they are written, on a tiny random Llama shaped like the built-in SmolLM2.

The model has SmolLM2's stream width (576) and enough blocks for the indices the examples name, so each block
runs unchanged but for its placeholders: ``vlenvoys.load()`` (the built-in model) loads the tiny one, the
server's address is the test server's, and the names a snippet takes from the prose before it are given.
A block that changes without its test here fails `test_every_python_block_of_the_readme_is_run`.
"""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest
import torch
import vlenvoys
import vlenvoys_testing as testing

README = Path(__file__).resolve().parents[3] / "README.md"
#: SmolLM2-135M's stream width and head width; blocks enough for README's indices (10 and 20).
HIDDEN, HEADS, BLOCKS = 576, 9, 21
#: The served model's name: README's placeholder for a checkpoint, so the client snippets run as written.
SERVED = "path/to/checkpoint"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def block(starting: str) -> str:
    """The README's Python block whose first line is ``starting``."""
    (found,) = [code for code in blocks() if code.startswith(starting)]
    return found


def run(code: str, namespace: dict, folder: Path) -> dict:
    """``code`` run from a file of its own (nnsight reads a trace's block from its caller's file), in ``namespace``."""
    script = folder / f"readme_block_{len(list(folder.glob('readme_block_*.py')))}.py"
    script.write_text(code)
    return runpy.run_path(str(script), init_globals=namespace, run_name=namespace.get("__name__", "readme"))


#: The first line of each Python block, and the test that runs it.
RUN = {
    "import torch\nimport vlenvoys\n": "test_the_trace_example",
    "from safetensors.torch import save_file\n": "test_the_served_steering_and_capture_examples",
    "from openai import OpenAI\n": "test_the_served_steering_and_capture_examples",
    "from vlenvoys.capturing import decode\n": "test_the_served_steering_and_capture_examples",
    "from vlenvoys import Architecture, Family, FusedLayer\n": "test_the_family_examples",
    "# tests/conftest.py\n": "test_the_family_examples",
}


def test_every_python_block_of_the_readme_is_run():
    assert sorted(next(first for first in RUN if code.startswith(first)) for code in blocks()) == sorted(RUN)


@pytest.fixture(scope="module")
def smollm2_shaped(tmp_path_factory) -> Path:
    return testing.tiny_model(
        "LlamaForCausalLM", tmp_path_factory.mktemp("readme") / "model", hidden_size=HIDDEN,
        num_attention_heads=HEADS, num_key_value_heads=3, intermediate_size=128, num_hidden_layers=BLOCKS,
    )


def test_the_trace_example(smollm2_shaped, tmp_path, monkeypatch):
    load = vlenvoys.load

    def tiny(model=None, **engine_kwargs):  # the built-in model is this one here; a small engine for a test
        small = {"max_model_len": 256, "kv_cache_memory_bytes": 1 << 30}
        return load(model or smollm2_shaped, **{**small, **engine_kwargs})

    monkeypatch.setattr(vlenvoys, "load", tiny)
    done = run(block("import torch\nimport vlenvoys\n"), {"__name__": "__main__"}, tmp_path)
    tokens = done["stream"].shape[1]
    assert done["stream"].shape == (1, tokens, HIDDEN) and tokens > 1
    assert done["logits"].shape[0] == 1 and torch.isfinite(done["logits"]).all()
    assert getattr(done["model"], "_shut_down", False)


def test_the_served_steering_and_capture_examples(smollm2_shaped, tmp_path, monkeypatch):
    from test_llama_serve import TEMPLATE

    monkeypatch.chdir(tmp_path)
    # The prose before it makes these: the mean streams of prompts about Paris and about Rome.
    means = {"paris_mean": torch.randn(HIDDEN), "rome_mean": torch.randn(HIDDEN)}
    run(block("from safetensors.torch import save_file\n"), means, tmp_path)
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    arguments = [
        "--max-model-len", "256", "--served-model-name", SERVED, "--vectors", str(tmp_path / "vectors.safetensors"),
        "--chat-template", str(tmp_path / "chat.jinja"),
    ]
    with testing.server(smollm2_shaped, tmp_path / "server.log", *arguments) as server:
        client_code = block("from openai import OpenAI\n").replace("http://localhost:8000", server["url"])
        done = run(client_code, {}, tmp_path)
        assert done["answer"].choices[0].message.content is not None
        done = run(block("from vlenvoys.capturing import decode\n"), done, tmp_path)
    queries = done["queries"]
    assert queries.dtype == torch.bfloat16 and queries.shape[0] == BLOCKS
    assert queries.shape[2:] == (HEADS, HIDDEN // HEADS)


def test_the_family_examples(tmp_path):
    declared = run(block("from vlenvoys import Architecture, Family, FusedLayer\n"), {}, tmp_path)
    assert isinstance(declared["FAMILY"], vlenvoys.Family)
    assert declared["FAMILY"].architectures["MyForCausalLM"].layer.MLP_NORM == "pre_feedforward_layernorm"
    tests = run(block("# tests/conftest.py\n"), {}, tmp_path)
    assert callable(tests["subject"]) and callable(tests["test_each_prompt_alone"])
