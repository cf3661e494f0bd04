"""vLLM's V2 model runner, opted in with ``VLENVOYS_MODEL_RUNNER=v2`` (#50): the same values as on V1, transformers'.

vLLM refuses its V2 runner where Triton has no backend for the device, and
decides so when it is imported: this pytest process has imported it already
(on the CPU engine, PyPI's Triton has no CPU backend). So the chosen tests run
in a pytest process of their own (`v2_run`, once per session), on the CPU
engine with Triton's interpreter as its backend
(`vlenvoys_testing.triton_interpreter`), on a GPU with Triton's own, and
``VLENVOYS_MODEL_RUNNER=v2``, over one engine: the conftest's tiny Llama. They
are the oracle suite's, collect's and steering's own tests, and this module's
``under_v2`` ones, which run only there; each test ``test_passes_under_v2[...]``
here reads one of that run's results.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from vlenvoys_testing import conformance, kept_runner_choice, oracle, triton_interpreter
from vlenvoys_testing.conformance import compare, host, read_all

#: Set in the pytest process `v2_run` starts.
UNDER_V2 = os.environ.get("VLENVOYS_MODEL_RUNNER") == "v2"
under_v2 = pytest.mark.skipif(not UNDER_V2, reason="runs in the V2 runner's own pytest process (test_passes_under_v2)")
on_tiny_llama = pytest.mark.parametrize("subject", ["LlamaForCausalLM"], indirect=True)

MODEL = "LlamaForCausalLM"
#: (test file, test) run under the V2 runner on the tiny Llama (a test's own parameters after the model's: ``[-1]``).
CHOSEN = [
    ("test_llama_v2_runner.py", "test_the_engine_runs_the_v2_runner"),
    ("test_llama_oracle.py", "test_each_prompt_alone"),
    ("test_llama_oracle.py", "test_two_prompts_in_one_trace"),
    ("test_llama_oracle.py", "test_decode_steps_have_one_row"),
    ("test_llama_v2_runner.py", "test_rows_follow_the_v2_batch_order"),
    ("test_llama_v2_runner.py", "test_decode_steps_equal_transformers"),
    ("test_llama_oracle.py", "test_add_to_layer_mid_in_place"),
    ("test_llama_oracle.py", "test_unedited_reads_leave_logits_bit_identical"),
    ("test_llama_collect.py", "test_values_equal_transformers_and_the_trace"),
    ("test_llama_collect.py", "test_someone_elses_request_carries_no_saves_and_is_unchanged"),
    ("test_llama_oracle.py", "test_collect_equals_a_trace"),
    ("test_llama_api.py", "test_steer_equals_the_same_edit_by_hand"),
    ("test_llama_api.py", "test_steer_and_steering_take_the_same_vectors"),
    ("test_llama_oracle.py", "test_steered_generation_equals_steering_in_a_trace"),
    # A block's error ends its own request (its end-of-sequence forced on V2's sampled row), the engine goes on.
    ("test_llama_oracle.py", "test_wrong_token_count_is_refused_and_engine_goes_on[-1]"),
    ("test_llama_oracle.py", "test_non_finite_write_is_refused_and_later_requests_stay_clean"),
    ("test_llama_api.py", "test_generate_as_a_block_is_a_trace_and_called_plainly_runs_the_engine"),
]
HERE = Path(__file__).parent


def case_id(test: str) -> str:
    """A chosen test's id on the tiny Llama: ``test[LlamaForCausalLM]``, or with its own parameters after it."""
    name, _, own = test.partition("[")
    return f"{name}[{MODEL}{'-' + own.rstrip(']') if own else ''}]"


@pytest.fixture(scope="session")
def v2_run(tmp_path_factory) -> dict:
    """The chosen tests run once in a pytest process over the V2 runner: {test id: (outcome, message)}."""
    folder = tmp_path_factory.mktemp("v2-runner")
    environment = {**os.environ, "VLENVOYS_MODEL_RUNNER": "v2", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if not torch.cuda.is_available():  # on a GPU, Triton's own CUDA backend
        environment = triton_interpreter.environment(folder / "triton", environment)
    environment.pop("VLLM_USE_V2_MODEL_RUNNER", None)  # vlenvoys.load chooses it
    report = folder / "report.xml"
    ids = [f"{HERE.name}/{file}::{case_id(test)}" for file, test in CHOSEN]
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *ids],
        cwd=HERE.parent, env=environment, capture_output=True, text=True, timeout=1200,
    )
    output = ran.stdout + ran.stderr
    if not report.exists():
        pytest.fail(f"the V2 runner's pytest process wrote no report (exit {ran.returncode}):\n{output[-6000:]}")
    results = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("name")
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if failed is not None:
            results[name] = ("failed", (failed.get("message") or "") + "\n" + (failed.text or "")[-4000:])
        elif skipped is not None:
            results[name] = ("skipped", skipped.get("message") or "")
        else:
            results[name] = ("passed", "")
    # The run's largest differences to transformers, in this session's summary too.
    for line in output.splitlines():
        found = re.match(rf"^{MODEL}\s+(\S.*?)\s+([0-9.e+-]+)$", line.strip())
        if found and "largest relative" not in line:
            conformance.record(f"{MODEL} (V2 runner)", found.group(1), float(found.group(2)))
    results["output"] = output
    return results


@pytest.mark.parametrize(("file", "test"), CHOSEN, ids=[test for _, test in CHOSEN])
def test_passes_under_v2(v2_run, file, test):
    outcome, message = v2_run.get(case_id(test), ("missing", v2_run["output"][-4000:]))
    assert outcome == "passed", f"{file}::{test} under the V2 runner: {outcome}\n{message}"


def test_the_default_runner_and_the_choice(monkeypatch):
    """Unset, V1 and vlenvoys' V1 worker on the CPU engine where vLLM has its V1 runner, V2 and the V2 worker on a CUDA
    device (vLLM's own default there) and on a vLLM without V1; with VLENVOYS_MODEL_RUNNER=v2, V2 and the V2 worker;
    a contradiction or an unknown choice is refused by name."""
    kept_runner_choice(monkeypatch)
    from vlenvoys.engine.loading import V2_RUNNER, model_runner
    from vlenvoys.engine.processes import RUNNER_CHOICE, has_v1_runner, worker_class
    from vlenvoys.errors import UnsupportedVLLM
    from vlenvoys.wire.requests import SITED_GRAPHS

    engine = "gpu.GPUWorker" if torch.cuda.is_available() else "cpu.CPUWorker"
    monkeypatch.delenv(SITED_GRAPHS, raising=False)  # which would choose V1 (test_sited_graphs_choose_v1_...)
    monkeypatch.delenv(RUNNER_CHOICE, raising=False)
    monkeypatch.delenv(V2_RUNNER, raising=False)
    model_runner()
    on_v1 = has_v1_runner() and not torch.cuda.is_available()  # V2 on CUDA, vLLM's own default there
    default = ("0", f"vlenvoys.worker.{engine}") if on_v1 else ("1", f"vlenvoys.worker.v2.{engine}")
    assert (os.environ[V2_RUNNER], worker_class()) == default
    monkeypatch.setenv(RUNNER_CHOICE, "v2")
    monkeypatch.delenv(V2_RUNNER)
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        model_runner()
        assert os.environ[V2_RUNNER] == "1" and worker_class() == f"vlenvoys.worker.v2.{engine}"
    else:  # the CPU engine with PyPI's Triton (no CPU backend; the V2 process has the interpreter's)
        with pytest.raises(UnsupportedVLLM, match="needs triton-cpu"):
            model_runner()
    # The user's own "0", in a process where load has set nothing (a value equal to the one load set for an earlier
    # engine is taken for load's: test_a_v1_engine_after_a_v2_engine_in_the_same_process).
    kept_runner_choice(monkeypatch)
    monkeypatch.setenv(V2_RUNNER, "0")
    with pytest.raises(UnsupportedVLLM, match="VLLM_USE_V2_MODEL_RUNNER=0 asks vLLM for its V1 model runner.*VLENVOYS_MODEL_RUNNER=v1"):
        model_runner()
    monkeypatch.setenv(RUNNER_CHOICE, "v3")
    with pytest.raises(ValueError, match="VLENVOYS_MODEL_RUNNER='v3'"):
        worker_class()


def test_sited_graphs_choose_v1_and_are_refused_on_v2(monkeypatch, tmp_path):
    """Sited graphs (``VLENVOYS_SITED_GRAPHS=1``) are captured through V1's seams: unset, the choice is V1 where vLLM
    has it; with V2 asked for (or a vLLM without V1), `load` refuses an engine with sites by name before it starts."""
    kept_runner_choice(monkeypatch)
    import vlenvoys
    from vlenvoys.engine.processes import RUNNER_CHOICE, has_v1_runner, runner_choice
    from vlenvoys.wire.requests import SITED_GRAPHS
    from vlenvoys_testing import tiny_model

    monkeypatch.setenv(SITED_GRAPHS, "1")
    monkeypatch.delenv(RUNNER_CHOICE, raising=False)
    assert runner_choice() == ("v1" if has_v1_runner() else "v2")
    monkeypatch.setenv(SITED_GRAPHS, "0")  # off: the platform's default again
    assert runner_choice() == ("v2" if torch.cuda.is_available() or not has_v1_runner() else "v1")
    monkeypatch.setenv(SITED_GRAPHS, "1")
    monkeypatch.setenv(RUNNER_CHOICE, "v2")
    path = tiny_model("LlamaForCausalLM", tmp_path)
    with pytest.raises(ValueError, match="sited graphs are captured through vLLM's V1 model runner"):
        vlenvoys.load(str(path), cuda_graphs=True, sites={"layer_output": "all"})


# -- run in the V2 runner's own pytest process ------------------------------------------------------------


@under_v2
@on_tiny_llama
def test_the_engine_runs_the_v2_runner(subject):
    """The engine asked vLLM for its V2 runner and runs vlenvoys' V2 worker (whose start refuses any other runner)."""
    config = subject.model.vllm_entrypoint.llm_engine.vllm_config
    assert config.use_v2_model_runner
    engine = "gpu.GPUWorker" if subject.device_type == "cuda" else "cpu.CPUWorker"
    assert config.parallel_config.worker_cls == f"vlenvoys.worker.v2.{engine}"
    assert subject.model.vllm_entrypoint.llm_engine.collective_rpc("nnsight_request_count") == [0]


@under_v2
@on_tiny_llama
def test_rows_follow_the_v2_batch_order(subject):
    """V2 orders a step's rows by scheduled tokens, not by arrival: invokes longest first each read their own."""
    order = sorted(range(len(subject.prompts)), key=lambda index: -len(subject.prompts[index]))
    assert [len(subject.prompts[index]) for index in order] != sorted(len(prompt) for prompt in subject.prompts)
    saved = read_all(subject.model, [subject.prompts[index] for index in order])
    for number, index in enumerate(order):
        compare(subject, saved[number], index)


@under_v2
@on_tiny_llama
def test_decode_steps_equal_transformers(subject):
    """Two invokes generating three tokens greedily: each step's rows (a prefill, then decodes beside the other
    request's) are transformers' at those positions of the prompt and the tokens generated."""
    model, steps = subject.model, 3
    prompts = [subject.prompts[2], subject.prompts[0]]
    with model.trace(temperature=0.0, max_tokens=steps) as tracer:
        results = list().save()
        for prompt in prompts:
            with tracer.invoke(prompt):
                rows = list().save()
                for _ in tracer.iter[0:steps]:
                    rows.append((model.layers[1].layer_output.save(), model.samples.save()))
                results.append(rows)
    for prompt, rows in zip(prompts, results, strict=True):
        generated = [int(sample.reshape(-1)[0]) for _, sample in rows]
        stream = torch.cat([host(read) for read, _ in rows], dim=1)  # [1, prompt + steps - 1, hidden]
        assert stream.shape[1] == len(prompt) + steps - 1
        expected = oracle.reference(subject.reference, prompt + generated[:-1], subject.layout)
        assert conformance.close(subject, "layer_output (decode steps)", stream, expected["values"]["layer_output"][1])
        assert torch.argmax(expected["logits"]).item() == generated[-1]
