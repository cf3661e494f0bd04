"""``vlenvoys serve`` on an architecture vLLM runs on its transformers backend: GPT-NeoX (Pythia's parallel block).

One server process for the module, on the same tiny checkpoint as the session's
engine; a steered completion equals `vlenvoys.generate` with the same
`vlenvoys.Steering` there, and a captured value equals a trace's reads.
"""

from __future__ import annotations

import pytest
import torch
import vlenvoys
import vlenvoys_testing as testing
from vlenvoys_testing.conformance import TOLERANCE, greedy_steps, host, record, same_steps
from vlenvoys.serve.server import anyio_classes_first

anyio_classes_first()  # the openai client's anyio classes, defined under nnsight's .save mount otherwise

NAME = "GPTNeoXForCausalLM-parallel"
on_neox = pytest.mark.parametrize("subject", [pytest.param(NAME, marks=pytest.mark.transformers_backend)], indirect=True)
STEPS = 4


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from openai import OpenAI

    folder = tmp_path_factory.mktemp("serve-neox")
    path = testing.tiny_model("GPTNeoXForCausalLM", folder / "model")  # the subject's weights (same seed and config)
    memory = ["--gpu-memory-utilization", "0.08", "--kv-cache-memory-bytes", str(1 << 30)] if torch.cuda.is_available() else []
    with testing.server(path, folder / "server.log", "--max-model-len", "256", "--served-model-name", "neox", *memory) as started:
        with OpenAI(base_url=f"{started['url']}/v1", api_key="none", max_retries=0, timeout=120) as made:
            yield made


def completion(client, ids, **body):
    answer = client.completions.create(model="neox", prompt=ids, max_tokens=STEPS, temperature=0.0, logprobs=1,
                                       extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True, **body})
    choice = answer.choices[0]
    steps = [(int(token.removeprefix("token_id:")), value) for token, value in zip(choice.logprobs.tokens, choice.logprobs.token_logprobs, strict=True)]
    return steps, answer.model_extra.get("capture")


def generated(model, ids, steering=None):
    return greedy_steps(model, ids, STEPS, steering)


def assert_same_steps(got, want, what):
    assert same_steps(got, want, f"{NAME} (vlenvoys serve)", what), (what, got, want)


@on_neox
def test_serve_steers_a_transformers_backend_model_as_generate(subject, client):
    vector = 3.0 * torch.randn(128, generator=torch.Generator().manual_seed(7))
    for ids in subject.prompts[:2]:
        plain, _ = completion(client, ids)
        assert_same_steps(plain, generated(subject.model, ids), "plain vs the engine")
        field = [{"value": "layer_output", "layer": 1, "vector": vector.tolist(), "factor": 2.0, "positions": "generated"}]
        steered, _ = completion(client, ids, steering=field)
        want = generated(subject.model, ids, vlenvoys.Steering(1, vector, 2.0, positions=slice(len(ids), None)))
        assert_same_steps(steered, want, "steered (generated) vs vlenvoys.generate")
        assert steered != plain, "the steering must show"


@on_neox
def test_serve_captures_on_a_transformers_backend_model_as_a_trace(subject, client):
    """The stream at every block and the MLP's output over prompt and decode steps, against a trace's reads."""
    from vlenvoys.capturing import decode

    ids = subject.prompts[1]
    _, entries = completion(client, ids, capture=[{"value": "layer_output", "layers": "all"},
                                                  {"value": "mlp_output", "layers": [1], "positions": "all"}])
    model = subject.model
    with model.trace(ids, temperature=0.0, max_tokens=STEPS, ignore_eos=True) as tracer:
        got = list().save()
        for _ in tracer.iter[0:STEPS]:
            first = model.layers[0].layer_output
            mlp = model.layers[1].mlp.mlp_output  # in forward order: block 1's MLP before its output
            got.append([first, model.layers[1].layer_output, model.layers[2].layer_output, mlp])
    streams = [host(each) for each in got[0][:3]]
    mlp = torch.cat([host(step[3]) for step in got], dim=1)  # prefill's rows, then a row per decode step
    for entry, want in zip(entries, [torch.cat(streams), mlp], strict=True):
        captured = decode(entry)
        assert captured.shape == want.shape, (entry["value"], captured.shape, want.shape)
        difference = float(((captured - want).abs() / want.abs().clamp_min(1.0)).max())
        record(f"{NAME} (vlenvoys serve)", f"capture: {entry['value']} vs a trace (relative)", difference)
        assert torch.equal(captured, want) if not torch.cuda.is_available() else difference <= TOLERANCE, (entry["value"], difference)
