"""README's Python code blocks, run as they are written, on a tiny random Llama shaped like the built-in SmolLM2.

The model has SmolLM2's stream width (576) and enough blocks for the indices the examples name, so each block
runs unchanged but for its placeholders: ``vlenvoys.load()`` (the built-in model) and ``vlenvoys.load(HUB)``
load the tiny one, the server's address is the test server's, and the files a snippet reads are made (the
corpus) or come from the block before it (the steering vectors). The family examples, which moved from README
to docs/adding-a-family.md, are run from there.
A block that changes without its test here fails `test_every_python_block_of_the_readme_is_run`.
"""

from __future__ import annotations

import contextlib
import re
import runpy
from pathlib import Path

import pytest
import torch
import vlenvoys
import vlenvoys_testing as testing
from vlenvoys.activations import Activations

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
#: The family examples' page.
FAMILY_PAGE = ROOT / "docs" / "adding-a-family.md"
#: SmolLM2-135M's stream width and head width; blocks enough for README's indices (10 and 20).
HIDDEN, HEADS, BLOCKS = 576, 9, 21
#: The hub id README's examples load and serve: the tiny model here (and its served name: the client runs as written).
HUB = "HuggingFaceTB/SmolLM2-135M-Instruct"
SERVED = HUB


def blocks(page: Path = README) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


def block(starting: str, page: Path = README) -> str:
    """The Python block of ``page`` (README) whose first lines are ``starting``."""
    (found,) = [code for code in blocks(page) if code.startswith(starting)]
    return found


def run(code: str, namespace: dict, folder: Path) -> dict:
    """``code`` run from a file of its own (nnsight reads a trace's block from its caller's file), in ``namespace``."""
    script = folder / f"readme_block_{len(list(folder.glob('readme_block_*.py')))}.py"
    script.write_text(code)
    return runpy.run_path(str(script), init_globals=namespace, run_name=namespace.get("__name__", "readme"))


#: The first lines of each Python block of README, and the test that runs it.
RUN = {
    "import vlenvoys\nif __name__": "test_the_quickstart",
    "import torch\nimport vlenvoys\n": "test_the_trace_example",
    "import vlenvoys\nfrom safetensors.torch import save_file\n": "test_the_collect_and_dataset_example",
    "from openai import OpenAI\n": "test_the_served_steering_and_capture_example",
}
#: The same for docs/adding-a-family.md.
RUN_FAMILY_PAGE = {
    "from vlenvoys import Architecture, Family, FusedLayer\n": "test_the_family_examples",
    "# tests/conftest.py\n": "test_the_family_examples",
}


def test_every_python_block_of_the_readme_is_run():
    for page, run_by in ((README, RUN), (FAMILY_PAGE, RUN_FAMILY_PAGE)):
        firsts = [[first for first in run_by if code.startswith(first)] for code in blocks(page)]
        assert all(len(found) == 1 for found in firsts), f"{page.name}: a Python block no test here runs (or two match)"
        assert sorted(found for found, in firsts) == sorted(run_by), page.name


@pytest.fixture(scope="module")
def smollm2_shaped(tmp_path_factory) -> Path:
    return testing.tiny_model(
        "LlamaForCausalLM", tmp_path_factory.mktemp("readme") / "model", hidden_size=HIDDEN,
        num_attention_heads=HEADS, num_key_value_heads=3, intermediate_size=128, num_hidden_layers=BLOCKS,
    )


@contextlib.contextmanager
def tiny_engines(model: Path):
    """``vlenvoys.load()`` and ``vlenvoys.load(HUB)`` load ``model``, on a small engine for a test."""
    load = vlenvoys.load

    def tiny(name=None, **engine_kwargs):  # the built-in model and the hub id are this one here
        assert name in (None, HUB), f"README loads {name!r}: give this test its placeholder"
        small = {"max_model_len": 256, "kv_cache_memory_bytes": 1 << 30}
        return load(model, **{**small, **engine_kwargs})

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vlenvoys, "load", tiny)
        yield


def test_the_quickstart(smollm2_shaped, tmp_path):
    with tiny_engines(smollm2_shaped):
        done = run(block("import vlenvoys\nif __name__"), {"__name__": "__main__"}, tmp_path)
    tokens = done["stream"].shape[1]
    assert done["stream"].shape == (1, tokens, HIDDEN) and tokens > 1
    vocab = done["model"].vocab_size
    assert done["lens"].shape == (1, vocab) and torch.isfinite(done["lens"]).all()
    assert getattr(done["model"], "_shut_down", False)


def test_the_trace_example(smollm2_shaped, tmp_path):
    with tiny_engines(smollm2_shaped):
        done = run(block("import torch\nimport vlenvoys\n"), {"__name__": "__main__"}, tmp_path)
    tokens = done["stream"].shape[1]
    assert done["stream"].shape == (1, tokens, HIDDEN) and tokens > 1
    assert done["queries"].shape == (1, tokens, HEADS, HIDDEN // HEADS)
    assert done["logits"].shape[0] == 1 and torch.isfinite(done["logits"]).all()
    assert getattr(done["model"], "_shut_down", False)


#: A corpus of a document per line, long enough for several windows of README's 128 tokens.
CORPUS = [prompt + f", line {index}." for index in range(20) for prompt in testing.PROMPTS]


@pytest.fixture(scope="module")
def collected(smollm2_shaped, tmp_path_factory) -> tuple[Path, dict]:
    """README's collect and dataset block, run once in a folder of its own with a corpus.txt: (folder, its names)."""
    folder = tmp_path_factory.mktemp("collected")
    (folder / "corpus.txt").write_text("".join(line + "\n" for line in CORPUS))
    code = block("import vlenvoys\nfrom safetensors.torch import save_file\n")
    with tiny_engines(smollm2_shaped), pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        done = run(code, {"__name__": "__main__"}, folder)
    return folder, done


def test_the_collect_and_dataset_example(collected):
    from safetensors.torch import load_file

    folder, done = collected
    assert getattr(done["model"], "_shut_down", False)
    rows = done["rows"]
    assert len(rows) == 2 and all(row.shape[0] == 1 and row.shape[2] == HIDDEN for row in rows)
    vectors = load_file(str(folder / "vectors.safetensors"))
    assert list(vectors) == ["paris"] and vectors["paris"].shape == (HIDDEN,)
    assert torch.equal(vectors["paris"], rows[0][0, -1] - rows[1][0, -1])
    written = Activations(folder / "acts")
    assert written.complete and written.keys == ["layer_output.10"] and len(written) >= 2 * 128
    assert len(written) % 128 == 0
    inputs = done["inputs"]  # the last batch: the whole dataset, shorter than 4096 rows
    assert inputs.dtype == torch.bfloat16 and inputs.shape == (len(written), HIDDEN)
    assert done["batch"]["token_ids"].shape == (len(written),)


def test_the_served_steering_and_capture_example(smollm2_shaped, collected, tmp_path, monkeypatch):
    from test_llama_serve import TEMPLATE

    folder, _ = collected
    monkeypatch.chdir(tmp_path)
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    # README's serve command, with the test's engine size and a chat template (the tiny model has none).
    arguments = [
        "--max-model-len", "256", "--served-model-name", SERVED, "--vectors", str(folder / "vectors.safetensors"),
        "--chat-template", str(tmp_path / "chat.jinja"),
    ]
    with testing.server(smollm2_shaped, tmp_path / "server.log", *arguments) as server:
        client_code = block("from openai import OpenAI\n").replace("http://localhost:8000", server["url"])
        done = run(client_code, {}, tmp_path)
    assert done["answer"].choices[0].message.content is not None
    queries = done["queries"]
    assert queries.dtype == torch.bfloat16 and queries.shape[0] == BLOCKS
    assert queries.shape[2:] == (HEADS, HIDDEN // HEADS)


def test_the_family_examples(tmp_path):
    declared = run(block("from vlenvoys import Architecture, Family, FusedLayer\n", FAMILY_PAGE), {}, tmp_path)
    assert isinstance(declared["FAMILY"], vlenvoys.Family)
    assert declared["FAMILY"].architectures["MyForCausalLM"].layer.MLP_NORM == "pre_feedforward_layernorm"
    tests = run(block("# tests/conftest.py\n", FAMILY_PAGE), {}, tmp_path)
    assert callable(tests["subject"]) and callable(tests["test_each_prompt_alone"])
