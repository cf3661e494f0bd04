"""``vlenvoys serve``: one real server process for the module, talked to over HTTP with the openai client.

The server runs the tiny Llama with the same weights as the session's
``subject`` engine (same architecture and seed), so a served request is
compared with `vlenvoys.generate` of the same token ids there: plain requests
token- and logprob-identical, steered ones equal to `vlenvoys.generate` with
the same `vlenvoys.Steering`. The server is started with ``--api-key``, so
every request also goes through vLLM's authentication.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from unittest import mock

import pytest
import torch
import vlenvoys
import vlenvoys_testing as testing
from vlenvoys_testing.conformance import TOLERANCE, greedy_steps, record, same_steps
from vlenvoys.engine.loading import TRITON_F32
from vlenvoys.serve.server import anyio_classes_first

anyio_classes_first()  # the openai client's anyio classes, defined under nnsight's .save mount otherwise

on_llama = pytest.mark.parametrize("subject", ["LlamaForCausalLM"], indirect=True)
KEY = "serve-test-key"
STEPS = 6
#: The server's hold on captures fetched later: seconds, and bytes (three captures of `BIG` fit, a fourth does not).
HELD_SECONDS = 10
HELD_BYTES = 1 << 20
#: A capture of 307,200 bytes: the stream at the 3 blocks, 200 positions of 128 float32.
BIG = {"value": "layer_output", "layers": "all", "positions": [0] * 200}
#: A chat template for the tiny tokenizer, which has none.
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def vector_of(seed: int, scale: float = 3.0) -> torch.Tensor:
    return scale * torch.randn(128, generator=torch.Generator().manual_seed(seed))


@contextlib.contextmanager
def started_server(tmp_path_factory):
    """``vlenvoys serve`` on the tiny Llama, in a process of its own; its base URL, model name and log.

    The ``server`` fixture (conftest.py) starts it once per session, for these tests and the fuzzed requests of
    test_llama_fuzz.py.
    """
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("serve")
    path = testing.tiny_model("LlamaForCausalLM", folder / "model")
    save_file({"up": vector_of(1), "down": -vector_of(1)}, str(folder / "vectors.safetensors"))
    (folder / "chat.jinja").write_text(TEMPLATE)
    arguments = [
        "--api-key", KEY, "--max-model-len", "256",
        "--vectors", str(folder / "vectors.safetensors"), "--chat-template", str(folder / "chat.jinja"),
        "--served-model-name", "tiny", "--enable-scale-out",
        "--capture-ttl", str(HELD_SECONDS), "--capture-held-bytes", str(HELD_BYTES),
        # On a GPU, beside the session's engine: a share as small as the test engines' (vlenvoys_testing.oracle.engine).
        *(["--gpu-memory-utilization", "0.08", "--kv-cache-memory-bytes", str(1 << 30)] if torch.cuda.is_available() else []),
    ]
    # oneDNN's primitive cache off in the server's engine (the CPU's matrix products): it takes entries for every
    # new step shape, up to 1,024, whose memory would hide a leak from test_llama_soak.py (benchmarks/soak.py).
    # Set only while the server starts, whose processes copy the environment: later engines keep the default.
    with contextlib.ExitStack() as stack:
        with mock.patch.dict(os.environ, {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"}):
            started = stack.enter_context(testing.server(path, folder / "server.log", *arguments))
        yield {**started, "model": "tiny", "path": path}


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    with OpenAI(base_url=f"{server['url']}/v1", api_key=KEY, max_retries=0, timeout=120) as made:
        yield made


def served(client, server, ids, steering=None, **extra) -> list[tuple[int, float]]:
    """A greedy completion of token ids: each generated token's (id, log-probability)."""
    body = {"ignore_eos": True, "return_tokens_as_token_ids": True, **extra}
    if steering is not None:
        body["steering"] = steering
    answer = client.completions.create(
        model=server["model"], prompt=ids, max_tokens=STEPS, temperature=0.0, logprobs=1, extra_body=body
    )
    return pairs(answer.choices[0].logprobs)


def pairs(logprobs) -> list[tuple[int, float]]:
    return [(int(token.removeprefix("token_id:")), value) for token, value in zip(logprobs.tokens, logprobs.token_logprobs, strict=True)]


def generated(model, ids, steering=None) -> list[tuple[int, float]]:
    return greedy_steps(model, ids, STEPS, steering)


def same_as_alone(got, want, what: str) -> bool:
    """A request served beside others against the same request alone (`vlenvoys_testing.conformance.same_steps`)."""
    return same_steps(got, want, "LlamaForCausalLM (vlenvoys serve)", what)


def assert_equal(got, want, what: str) -> None:
    """Same tokens, log-probabilities within float rounding (the largest difference is recorded under ``what``)."""
    assert [token for token, _ in got] == [token for token, _ in want], what
    difference = max(abs(a - b) for (_, a), (_, b) in zip(got, want, strict=True))
    record("LlamaForCausalLM (vlenvoys serve)", what, difference)
    assert difference <= 1e-5, f"{what}: log-probabilities {difference} apart"


@on_llama
def test_a_plain_completion_is_the_engines(subject, server, client):
    """No steering: token ids and log-probabilities bit-identical to a plain request on the session's engine."""
    for ids in subject.prompts:
        assert served(client, server, ids) == generated(subject.model, ids)


def test_a_plain_completion_is_plain_vllms(server, client, prompts, monkeypatch):
    """No steering: token ids and log-probabilities as vLLM's own engine (no vlenvoys) gives them on the weights.

    Bit-identical on the CPU engine; on a GPU within the oracle's bound (`same_as_alone`), with the
    full-float32 Triton dots vlenvoys gives a float32 engine (`vlenvoys.engine.loading.float32_kernels`; vLLM's
    default TF32 dots put its log-probabilities 1.2e-3 away, measured on an H200).
    """
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm.platforms import current_platform

    monkeypatch.setenv(TRITON_F32, "ieee")

    # On a GPU, a small share as the test engines take (vLLM's default 0.92 fails beside them).
    share = {"gpu_memory_utilization": 0.08} if current_platform.is_cuda_alike() else {}
    engine = LLM(str(server["path"]), dtype="float32", enforce_eager=True, max_model_len=256,
                 kv_cache_memory_bytes=1 << 30, enable_prefix_caching=True, **share)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=1)
        # One request at a time, as `served` sends them: the steps then have the server's shapes.
        outputs = [engine.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0] for ids in prompts]
    finally:
        engine.llm_engine.engine_core.shutdown()
    for ids, output in zip(prompts, outputs, strict=True):
        done = output.outputs[0]
        want = [(token, step[token].logprob) for token, step in zip(done.token_ids, done.logprobs, strict=True)]
        assert same_as_alone(served(client, server, ids), want, "plain vs vLLM alone")


@on_llama
@pytest.mark.parametrize("positions", ["all", "prompt", "generated", [0, 2, 11]])
def test_a_steered_completion_equals_vlenvoys_generate(subject, server, client, positions):
    vector = vector_of(5)
    for ids in subject.prompts[:2]:
        chosen = {"all": None, "prompt": slice(0, len(ids)), "generated": slice(len(ids), None)}.get(
            positions if isinstance(positions, str) else "", positions
        )
        want = generated(subject.model, ids, vlenvoys.Steering([0, 2], vector, 2.5, positions=chosen))
        field = [{"value": "layer_output", "layer": layer, "vector": vector.tolist(), "factor": 2.5,
                  "positions": positions} for layer in (0, -1)]
        got = served(client, server, ids, field)
        assert_equal(got, want, f"steered ({positions}) vs vlenvoys.generate")
        if positions == "all":
            assert got != served(client, server, ids), "the steering must show"


def steered_by_a_trace(model, ids, prompt_steers, generated_steers):
    """Greedy (token, log-probability) of ``ids`` with ``model.steer(layer, vector, factor)`` for each of
    ``prompt_steers`` at the prefill step and each of ``generated_steers`` at the decode steps."""
    from vlenvoys_testing.conformance import host

    with model.trace(ids, temperature=0.0, max_tokens=STEPS, ignore_eos=True) as tracer:
        logits = list().save()
        for step in tracer.iter[0:STEPS]:
            for layer, vector, factor in prompt_steers if step == 0 else generated_steers:
                model.steer(layer, vector, factor)
            logits.append(model.logits)
    rows = [host(each).reshape(-1, each.shape[-1])[-1].float().log_softmax(-1) for each in logits]
    return [(int(row.argmax()), float(row.max())) for row in rows]


@on_llama
@pytest.mark.parametrize("positions", [("all", "all"), ("prompt", "generated")])
def test_entries_of_several_vectors_equal_steering_in_a_trace(subject, server, client, positions):
    """Two vectors at two blocks, each its own factor and positions, against ``model.steer`` in a trace."""
    first, second = vector_of(11), vector_of(12)
    field = [{"layer": 0, "vector": first.tolist(), "factor": 1.5, "positions": positions[0]},
             {"layer": 2, "vector": second.tolist(), "factor": -2.0, "positions": positions[1]}]
    steers = [(0, first, 1.5), (2, second, -2.0)]
    at_prompt = [steer for steer, chosen in zip(steers, positions, strict=True) if chosen in ("all", "prompt")]
    at_generated = [steer for steer, chosen in zip(steers, positions, strict=True) if chosen in ("all", "generated")]
    for ids in subject.prompts[:2]:
        got = served(client, server, ids, field)
        assert_equal(got, steered_by_a_trace(subject.model, ids, at_prompt, at_generated), f"two vectors {positions} vs a trace")


@on_llama
def test_a_named_vector_equals_the_same_vector_inline(subject, server, client):
    ids = subject.prompts[1]
    named = served(client, server, ids, [{"layer": 1, "vector": "up", "factor": 3.0}])
    assert named == served(client, server, ids, [{"layer": 1, "vector": vector_of(1).tolist(), "factor": 3.0}])
    assert named != served(client, server, ids, [{"layer": 1, "vector": "down", "factor": 3.0}])


@on_llama
def test_a_vector_registered_by_the_endpoint_is_served_by_name(subject, server, client):
    import httpx

    headers = {"Authorization": f"Bearer {KEY}"}
    answer = httpx.post(f"{server['url']}/v1/steering/vectors", headers=headers,
                        json={"name": "late", "vector": vector_of(9).tolist()})
    assert answer.status_code == 200, answer.text
    listed = httpx.get(f"{server['url']}/v1/steering/vectors", headers=headers).json()
    assert {"up", "down", "late"} <= {entry["name"] for entry in listed["data"]}
    ids = subject.prompts[0]
    assert served(client, server, ids, {"layer": 2, "vector": "late"}) == generated(
        subject.model, ids, vlenvoys.Steering(2, vector_of(9))
    )
    wrong = httpx.post(f"{server['url']}/v1/steering/vectors", headers=headers, json={"name": "short", "vector": [1.0]})
    assert wrong.status_code == 400 and "expected 128 numbers" in wrong.json()["error"]["message"]
    assert httpx.get(f"{server['url']}/v1/steering/vectors").status_code == 401, "the registry is behind --api-key"


def test_steered_and_plain_requests_in_the_same_steps_each_get_their_own(prompts, server):
    """Many steered and plain requests at once: each equals the same request sent alone."""
    from openai import AsyncOpenAI

    steering = [{"layer": 1, "vector": "up", "factor": 2.0}]

    async def one(client, ids, steer):
        body = {"ignore_eos": True, "return_tokens_as_token_ids": True, **({"steering": steer} if steer else {})}
        answer = await client.completions.create(
            model=server["model"], prompt=ids, max_tokens=STEPS, temperature=0.0, logprobs=1, extra_body=body
        )
        return pairs(answer.choices[0].logprobs)

    async def scenario():
        async with AsyncOpenAI(base_url=f"{server['url']}/v1", api_key=KEY, max_retries=0, timeout=120) as client:
            alone = {}
            for ids in prompts:
                for steer in (None, steering):
                    alone[tuple(ids), steer is None] = await one(client, ids, steer)
            jobs = [(ids, steer) for _ in range(3) for ids in prompts for steer in (None, steering)]
            together = await asyncio.gather(*(one(client, ids, steer) for ids, steer in jobs))
            return alone, jobs, together

    alone, jobs, together = asyncio.run(scenario())
    for (ids, steer), got in zip(jobs, together, strict=True):
        what = "plain" if steer is None else "steered"
        assert same_as_alone(got, alone[tuple(ids), steer is None], f"{what} batched vs alone"), (what, ids)
    assert alone[tuple(prompts[0]), True] != alone[tuple(prompts[0]), False]


@pytest.fixture(scope="module")
def prompts(server):
    """The test prompts as the served model's token ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(server["path"])
    return [tokenizer(text)["input_ids"] for text in testing.PROMPTS]


MALFORMED = [
    ({"steering": [{"value": "layer_oops", "layer": 1, "vector": "up"}]}, "unknown value 'layer_oops'"),
    ({"steering": [{"value": "mlp_output", "layer": 1, "vector": "up"}]}, "'mlp_output' is not served yet"),
    ({"steering": [{"layer": 1, "vector": [1.0] * 127}]}, "expected shape [128]"),
    ({"steering": [{"layer": 1, "vector": [float("nan")] * 128}]}, "NaN or infinite"),
    ({"steering": [{"layer": 1, "vector": [1e39] + [0.0] * 127}]}, "NaN or infinite"),
    ({"steering": [{"layer": 3, "vector": "up"}]}, "block 3 does not exist: the model has blocks 0 to 2"),
    ({"steering": [{"layer": -4, "vector": "up"}]}, "block -4 does not exist"),
    ({"steering": [{"layer": 1, "vector": "sideways"}]}, "no vector is registered as 'sideways'"),
    ({"steering": [{"layer": 1, "vector": "up", "factor": 1e30}]}, "beyond"),
    ({"steering": [{"layer": 1, "vector": "up", "positions": "some"}]}, "positions"),
    ({"steering": [{"layer": 1, "vector": "up", "positions": [-1]}]}, "positions"),
    ({"steering": [{"layer": 1, "vector": "up", "positions": list(range(65537))}]}, "65537 positions, at most 65536"),
    ({"steering": [{"layer": 1, "vector": "up", "colour": 1}]}, "unknown keys ['colour']"),
    ({"steering": [{"layer": 1, "vector": "up"}, {"layer": 1, "vector": "down"}]}, "block 1 is steered by two entries"),
    ({"steering": [{"layer": 0, "vector": "up"}] * 17}, "at most 16 are served"),
    ({"steering": [{"layer": 1, "vector": "up"}, {"layer": 1, "vector": "up"}]}, "block 1 is steered by two entries"),
    ({"steering": "up"}, "expected an entry"),
    ({"steering": [{"vector": "up"}]}, "steering[0]: no layer"),
    ({"steering": [{"layer": 1}]}, "steering[0]: no vector"),
    ({"steering": [{"layer": 1, "vector": "nope"}]}, "steering[0].vector: no vector is registered as 'nope'"),
    ({"capture": [{"value": "layer_output", "layers": 1}] * 17}, "capture: 17 entries, at most 16 are served"),
    ({"capture": [{"value": "layer_output", "layer": 1}]}, "unknown keys ['layer']"),
    ({"capture": [{"value": "layer_oops", "layers": 1}]}, "unknown value 'layer_oops'"),
    ({"capture": [{"value": "layer_output", "layers": [3]}]}, "block 3 does not exist; the model has blocks 0 to 2"),
    ({"capture": [{"value": "attention_probabilities", "layers": 1}]}, "is recomputed per request"),
    ({"capture": [{"value": "attention_probabilities", "layers": 1}]}, "it can read layer_input, "),
    ({"capture": [{"value": "mlp_router_logits", "layers": 1}]}, "is not served on"),
    ({"capture": {"value": "layer_output", "layers": 1, "positions": "first"}}, "positions"),
    ({"capture": {"value": "layer_output", "layers": 1, "dtype": "int8"}}, "dtype"),
    ({"capture": {"value": "layer_output", "layers": 1}, "stream": True}, "drop stream"),
    ({"capture": {"value": "layer_output", "layers": 1}, "n": 2}, "one choice a request"),
    ({"capture": {"value": "layer_output", "layers": 1}, "prompt": ["a", "b"]}, "one prompt a request"),
    ({"capture": {"value": "layer_output", "layers": 1, "positions": [0, 99]}}, "position 99 is outside the rows read"),
    ({"capture": [{"value": "layer_output", "layers": 1}, {"value": "layer_output", "layers": 2}]}, "by two entries"),
    ({"vllm_xargs": {"vlenvoys_collect": "collect-x"}, "capture": {"value": "layer_output", "layers": 1}}, "set by the server"),
    ({"Capture": {"value": "layer_output", "layers": 1}}, "unknown field 'Capture'"),
    ({"capture": {"value": ["layer_output"], "layers": 1}}, "unknown value ['layer_output']"),
    ({"capture": {"value": "layer_output", "layers": 1, "dtype": {}}}, "dtype"),
    ({"capture": {"value": "layer_output", "layers": 1}, "vllm_xargs": "x"}, "vllm_xargs: expected an object"),
    ({"capture": {"value": "layer_output", "layers": 1, "positions": [0] * 65537}}, "at most 65536 are served"),
    ({"capture": {"value": "layer_output", "layers": "all", "positions": [0] * 60000}}, "MiB of values, beyond the 64 MiB"),
    ({"vllm_xargs": {"vlenvoys_steer": "{}"}}, "is set by the server"),
    ({"capture": {"value": "layer_output", "layers": 1}, "capture_transport": "pigeon"},
     "capture_transport: expected 'inline' or 'fetch', got 'pigeon'"),
    ({"capture": {"value": "layer_output", "layers": 1}, "capture_transport": 1}, "capture_transport: expected"),
    ({"capture_transport": ["fetch"]}, "capture_transport: expected 'inline' or 'fetch', got ['fetch']"),
    ({"capture": {"value": "layer_output", "layers": 1}, "capture_transprot": "fetch"},
     "unknown field 'capture_transprot'"),
    ({"capture": {"value": "layer_output", "layers": "all", "positions": [0] * 700}, "capture_transport": "fetch"},
     "beyond the 1.0 MiB this server holds for fetching (--capture-held-bytes)"),
    ({"Steering": [{"layer": 1, "vector": "up"}]}, "unknown field 'Steering'"),
]


@pytest.mark.parametrize("body, reason", MALFORMED, ids=[reason for _, reason in MALFORMED])
def test_a_malformed_request_is_a_400_with_its_reason_and_the_server_goes_on(server, body, reason):
    import httpx

    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    request = {"model": server["model"], "prompt": "The cat", "max_tokens": 2, **body}
    answer = httpx.post(f"{server['url']}/v1/completions", headers=headers, content=json.dumps(request), timeout=60)
    assert answer.status_code == 400, answer.text
    assert reason in answer.json()["error"]["message"]
    after = httpx.post(f"{server['url']}/v1/completions", headers=headers, timeout=60,
                       json={"model": server["model"], "prompt": "The cat", "max_tokens": 2,
                             "steering": [{"layer": 1, "vector": "up"}]})
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 2


def test_serve_without_a_model_serves_the_built_in_one():
    """`vlenvoys serve` alone serves SmolLM2-135M-Instruct offline (not vLLM's default hub model), as load() does."""
    from vlenvoys.serve.server import BUILTIN_NAME, parsed
    from vlenvoys.weights import WeightsUnavailable, smollm2_path

    try:
        built_in = str(smollm2_path())
    except WeightsUnavailable as error:
        pytest.skip(str(error))
    args = parsed(["--port", "8123", "--cuda-graphs"])
    assert (args.model, args.served_model_name) == (built_in, [BUILTIN_NAME])
    assert parsed(["--served-model-name", "mine"]).served_model_name == ["mine"]
    assert parsed(["some/checkpoint", "--port", "8123"]).model_tag == "some/checkpoint"
    for named in (["--model", "some/checkpoint"], ["--model=some/checkpoint"]):
        assert parsed(named).model == "some/checkpoint" and not parsed(named).served_model_name


def test_serve_with_a_config_file_naming_a_model_serves_that_one(tmp_path):
    """A model named by ``--config`` (vLLM's YAML of arguments) is the one served, not the built-in one."""
    from vlenvoys.serve.server import parsed

    config = tmp_path / "serve.yaml"
    config.write_text("model: some/checkpoint\nport: 8123\n")
    args = parsed(["--config", str(config)])
    assert (args.model, args.port) == ("some/checkpoint", 8123) and not args.served_model_name


def test_a_model_runner_against_vlenvoys_choice_is_refused_by_load_and_serve_before_an_engine_starts(tmp_path, monkeypatch):
    """#50: VLLM_USE_V2_MODEL_RUNNER set by hand against the runner vlenvoys runs (V1 here; V2 where
    VLENVOYS_MODEL_RUNNER=v2 asks for it) is named, with what to do, by load and serve alike."""
    testing.kept_runner_choice(monkeypatch)  # after a V1 engine (sited graphs) a "0" would be taken for load's own
    from vlenvoys.engine.loading import V2_RUNNER
    from vlenvoys.engine.processes import RUNNER_CHOICE, runner_choice
    from vlenvoys.serve.server import parsed, prepare

    path = str(testing.tiny_model("LlamaForCausalLM", tmp_path / "model"))
    v2 = runner_choice() == "v2"
    monkeypatch.setenv(V2_RUNNER, "0" if v2 else "1")
    said = f"{V2_RUNNER}=0 asks vLLM for its V1 model runner.*{RUNNER_CHOICE}=v1" if v2 else f"{V2_RUNNER}=1 asks vLLM for its V2 model runner"
    with pytest.raises(vlenvoys.UnsupportedVLLM, match=said):
        vlenvoys.load(path)
    with pytest.raises(vlenvoys.UnsupportedVLLM, match=f"unset (it|{V2_RUNNER})"):
        prepare(parsed([path]))
    monkeypatch.delenv(V2_RUNNER)
    with pytest.raises(ValueError, match="--pipeline-parallel-size 2: pipeline parallelism .* is not served"):
        prepare(parsed([path, "--pipeline-parallel-size", "2"]))  # #51 item 2: refused by name, as load does
    prepare(parsed([path]))  # chosen for the user
    assert os.environ[V2_RUNNER] == ("1" if v2 else "0")


def test_the_openapi_document_describes_steering_and_capture(server):
    """/openapi.json (and /docs) show the request fields the middleware serves, with the keys it takes (#49)."""
    import httpx
    from vlenvoys.serve import capture, steering
    from vlenvoys.values.names import OWNERS

    document = httpx.get(f"{server['url']}/openapi.json", timeout=60).json()
    schemas = document["components"]["schemas"]
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        fields = schemas[request]["properties"]
        assert {"steering", "capture", "capture_transport"} <= set(fields), request
        assert fields["capture_transport"]["anyOf"][0]["enum"] == list(capture.TRANSPORTS)
    assert set(schemas["SteeringEntry"]["properties"]) == steering.ENTRY_KEYS
    assert set(schemas["CaptureEntry"]["properties"]) == capture.ENTRY_KEYS
    assert schemas["CaptureEntry"]["properties"]["value"]["enum"] == list(OWNERS)
    assert schemas["SteeringEntry"]["required"] == ["layer", "vector"]
    assert httpx.get(f"{server['url']}/openapi.json", timeout=60).json() == document  # asked twice, the same


@on_llama
def test_steering_set_by_hand_on_another_path_is_refused(subject, server, prompts):
    """vLLM's token-in endpoint (``--enable-scale-out``) takes ``extra_args`` from the body, past the middleware.

    A spec made exactly as the middleware makes it, but without the cache salt
    the middleware adds, would share cached prefixes with plain requests: it is
    refused on its way to the engine, and the server goes on serving.
    """
    import httpx

    from vlenvoys.serve.steering import VECTORS, steering_spec
    from vlenvoys.wire.steering import salt_of

    spec = steering_spec({"layer": 1, "vector": vector_of(1).tolist()}, 128, 3, torch.float32, VECTORS)
    headers = {"Authorization": f"Bearer {KEY}"}
    params = {"max_tokens": 2, "temperature": 0.0, "extra_args": {"vlenvoys_steer": spec}}
    request = {"model": server["model"], "token_ids": prompts[0], "sampling_params": params}
    for salt in (None, "mine"):
        answer = httpx.post(f"{server['url']}/inference/v1/generate", headers=headers, timeout=60,
                            json={**request, **({"cache_salt": salt} if salt else {})})
        assert answer.status_code == 400, answer.text
        assert "is the server's own" in answer.text
    # A collector named by hand: its rows would stay on the engine, as nobody would take them.
    for extra in ({"vlenvoys_collect": "collect-0"}, {"vlenvoys_collect": "collect-0", "vlenvoys_collect_id": "x"}):
        answer = httpx.post(f"{server['url']}/inference/v1/generate", headers=headers, timeout=60,
                            json={**request, "sampling_params": {"max_tokens": 2, "extra_args": extra}})
        assert answer.status_code == 400 and "capture with the 'capture' field" in answer.text, answer.text
    salted = httpx.post(f"{server['url']}/inference/v1/generate", headers=headers, timeout=60,
                        json={**request, "cache_salt": salt_of(spec)})
    assert salted.status_code == 200, "the salt the middleware gives lets it through (it is then what a steered request is)"
    plain = httpx.post(f"{server['url']}/inference/v1/generate", headers=headers, timeout=60,
                       json={**request, "sampling_params": {"max_tokens": 2, "temperature": 0.0}})
    assert plain.status_code == 200, plain.text


def test_a_request_without_the_key_is_a_401_before_its_steering_is_read(server):
    import httpx

    answer = httpx.post(f"{server['url']}/v1/completions", timeout=60,
                        json={"model": server["model"], "prompt": "x", "steering": [{"layer": 9, "vector": "up"}]})
    assert answer.status_code == 401


@on_llama
def test_chat_and_streaming_are_steered(subject, server, client):
    """A steered chat completion streamed equals it whole, and both equal vlenvoys.generate of the chat's tokens."""
    messages = [{"role": "user", "content": "The Eiffel Tower is in"}]
    steering = [{"layer": 1, "vector": "up", "factor": 2.0}]
    body = {"ignore_eos": True, "return_token_ids": True, "steering": steering}
    whole = client.chat.completions.create(
        model=server["model"], messages=messages, max_tokens=STEPS, temperature=0.0, extra_body=body
    )
    ids = list(whole.prompt_token_ids)
    tokens = list(whole.choices[0].token_ids)
    want = generated(subject.model, ids, vlenvoys.Steering(1, vector_of(1), 2.0))
    assert tokens == [token for token, _ in want]
    plain = client.chat.completions.create(
        model=server["model"], messages=messages, max_tokens=STEPS, temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert list(plain.choices[0].token_ids) == [token for token, _ in generated(subject.model, ids)]
    assert list(plain.choices[0].token_ids) != tokens
    streamed = client.chat.completions.create(
        model=server["model"], messages=messages, max_tokens=STEPS, temperature=0.0, stream=True, extra_body=body
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text == whole.choices[0].message.content
    completion = client.completions.create(
        model=server["model"], prompt=ids, max_tokens=STEPS, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True, "steering": steering},
    )
    assert "".join(chunk.choices[0].text for chunk in completion) == whole.choices[0].message.content


def server_memory(server) -> int:
    import psutil

    root = psutil.Process(server["pid"])
    return sum(process.memory_info().rss for process in [root, *root.children(recursive=True)])


def test_a_soak_of_mixed_concurrent_requests_loses_none(server, prompts):
    """240 requests at once, plain, steered inline, steered by name, capturing, a few malformed: every one answered."""
    from openai import AsyncOpenAI, BadRequestError
    from vlenvoys.capturing import decode

    inline = vector_of(7).tolist()

    def kind_of(number):
        return ("plain", "inline", "named", "captured", "bad")[number % 5] if number % 21 else "bad"

    async def one(client, number):
        kind = kind_of(number)
        steer = {"plain": None, "inline": [{"layer": 0, "vector": inline, "positions": "generated"}],
                 "named": [{"layer": 2, "vector": "down", "factor": 0.5}], "captured": None,
                 "bad": [{"layer": 1, "vector": "nobody"}]}[kind]
        body = {"ignore_eos": True, **({"steering": steer} if steer else {})}
        if kind == "captured":
            body["capture"] = [{"value": "layer_output", "layers": [number % 3], "positions": "last"}]
        stream = number % 3 == 0 and kind != "captured"
        try:
            answer = await client.completions.create(
                model=server["model"], prompt=prompts[number % len(prompts)], max_tokens=4, temperature=0.0,
                extra_body=body, stream=stream,
            )
        except BadRequestError:
            return kind, "400"
        if stream:
            return kind, "".join([chunk.choices[0].text async for chunk in answer])
        assert answer.usage.completion_tokens == 4
        if kind == "captured":
            (entry,) = answer.model_extra["capture"]
            return kind, (answer.choices[0].text, decode(entry))
        return kind, answer.choices[0].text

    async def soak(count):
        async with AsyncOpenAI(base_url=f"{server['url']}/v1", api_key=KEY, max_retries=0, timeout=300) as client:
            return await asyncio.gather(*(one(client, number) for number in range(count)))

    first = asyncio.run(soak(240))
    before = server_memory(server)
    second = asyncio.run(soak(240))
    grown = server_memory(server) - before
    for results in (first, second):
        assert len(results) == 240
        for kind, text in results:
            assert (text == "400") == (kind == "bad"), kind
    # The same requests gave the same answers: bit for bit on the CPU engine (deterministic batching); on a GPU,
    # whose kernels tile by the step's shape and whose rounds batch apart, captured values within the oracle's bound.
    for (kind, one_round), (_, other) in zip(first, second, strict=True):
        if kind != "captured":
            assert one_round == other, kind
            continue
        assert one_round[0] == other[0]
        assert torch.equal(one_round[1], other[1]) if exact_here() else torch.allclose(one_round[1], other[1], rtol=TOLERANCE, atol=TOLERANCE)
    record("LlamaForCausalLM (vlenvoys serve)", "soak: second round's memory growth, MiB", grown / 2**20)
    assert grown < 256 * 2**20, f"the server grew by {grown / 2**20:.0f} MiB over a second round of 240 requests"



def traced_values(model, ids, reads, steer=None, steps=1):
    """A trace's reads of ``ids`` over ``steps`` steps, ``{(value, layer): [1, rows, ...]}`` (the prompt's rows, then
    one row a decode step), with ``model.steer(*steer)`` first at every step."""
    from vlenvoys.values.names import VALUES

    order = {name: number for number, (_, name) in enumerate(VALUES)}
    owners = dict((name, owner) for owner, name in VALUES)
    with model.trace(ids, temperature=0.0, max_tokens=steps, ignore_eos=True) as tracer:
        got = dict().save()
        for step in tracer.iter[0:steps]:
            if steer is not None:
                model.steer(*steer)
            for value, layer in sorted(reads, key=lambda read: (read[1], order[read[0]])):
                block = model.layers[layer]
                got[value, layer, step] = getattr(block if owners[value] == "layer" else getattr(block, owners[value]), value)
    from vlenvoys_testing.conformance import host

    return {read: torch.cat([host(got[(*read, step)]) for step in range(steps)], dim=1) for read in reads}


def assert_same_values(got, want, what, exact):
    """Bit-identical where both runs have the same kernels (the CPU engine, no steering); else the oracle's bound."""
    from vlenvoys_testing.conformance import host

    want = host(want).to(got.dtype)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    difference = float(((got.float() - want.float()).abs() / want.float().abs().clamp_min(1.0)).max())
    if exact:
        assert torch.equal(got, want), f"{what}: {difference} apart, expected bit-identical"
        return
    record("LlamaForCausalLM (vlenvoys serve)", f"capture: {what} (relative)", difference)
    bound = TOLERANCE if got.dtype == torch.float32 else 1e-2  # bfloat16: one rounding of float32 values equal within TOLERANCE
    assert difference <= bound, f"{what}: {difference} apart"


def exact_here():
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


@on_llama
def test_captured_values_equal_a_traces_reads(subject, server, client):
    """Four values (the stream at every block, head-split queries, an MLP output over the prompt and the decode
    steps, keys at chosen positions) of two prompts, in their layouts, against a trace's reads at every step."""
    from vlenvoys.capturing import decode

    capture = [{"value": "layer_output", "layers": "all"}, {"value": "attention_queries", "layers": [1]},
               {"value": "mlp_output", "layers": [-1, 0], "positions": "all"},
               {"value": "attention_keys", "layers": 2, "positions": [0, -1, -STEPS]}]
    for ids in subject.prompts[:2]:
        answer = client.completions.create(model=server["model"], prompt=ids, max_tokens=STEPS, temperature=0.0,
                                           extra_body={"capture": capture, "ignore_eos": True})
        assert answer.usage.completion_tokens == STEPS
        entries = answer.model_extra["capture"]
        assert [entry["value"] for entry in entries] == ["layer_output", "attention_queries", "mlp_output", "attention_keys"]
        want = traced_values(subject.model, ids, [("layer_output", layer) for layer in range(3)] + [
            ("attention_queries", 1), ("mlp_output", 2), ("mlp_output", 0), ("attention_keys", 2)], steps=STEPS)
        rows = len(ids) + STEPS - 1  # the last token sampled is never fed back
        expected = {"layer_output": list(range(len(ids))), "attention_queries": list(range(len(ids))),
                    "mlp_output": list(range(rows)), "attention_keys": [0, rows - 1, rows - STEPS]}
        for entry in entries:
            got = decode(entry)
            assert entry["prompt_tokens"] == len(ids) and entry["generated_rows"] == STEPS - 1
            assert entry["positions"] == expected[entry["value"]], entry["value"]
            stacked = torch.stack([want[entry["value"], layer][0, entry["positions"]] for layer in entry["layers"]])
            assert_same_values(got, stacked, entry["value"], exact_here())
        assert list(decode(entries[1]).shape[2:]) == [4, 32], "queries come split by head: [heads, head_dim]"


def test_capture_null_is_a_plain_request(server, client):
    answer = client.completions.create(model=server["model"], prompt="The cat", max_tokens=2, extra_body={"capture": None})
    assert answer.usage.completion_tokens == 2 and "capture" not in (answer.model_extra or {})


@on_llama
def test_generated_positions_stop_where_the_completion_stops(subject, server, client):
    """One token generated: no decode step ran, so "generated" is empty and "all" is the prompt."""
    from vlenvoys.capturing import decode

    ids = subject.prompts[0]
    capture = [{"value": "layer_output", "layers": 1, "positions": "generated"},
               {"value": "mlp_output", "layers": 1, "positions": "all"}]
    answer = client.completions.create(model=server["model"], prompt=ids, max_tokens=1, temperature=0.0,
                                       extra_body={"capture": capture})
    generated, everything = answer.model_extra["capture"]
    assert generated["positions"] == [] and list(decode(generated).shape) == [1, 0, 128]
    assert everything["positions"] == list(range(len(ids))) and everything["generated_rows"] == 0


@on_llama
def test_a_steered_chat_captures_its_steered_run(subject, server, client):
    """Chat, steered at block 0, captures block 2's stream at its last prompt position in bfloat16: as a steered trace."""
    from vlenvoys.capturing import decode

    messages = [{"role": "user", "content": "The Eiffel Tower is in"}]
    body = {"return_token_ids": True, "steering": [{"layer": 0, "vector": "up", "factor": 2.0}],
            "capture": {"value": "layer_output", "layers": 2, "positions": "last", "dtype": "bfloat16"}}
    answer = client.chat.completions.create(model=server["model"], messages=messages, max_tokens=2,
                                            temperature=0.0, extra_body=body)
    ids = list(answer.prompt_token_ids)
    (entry,) = answer.model_extra["capture"]
    assert entry["positions"] == [len(ids) - 1] and entry["dtype"] == "bfloat16"
    want = traced_values(subject.model, ids, [("layer_output", 2)], steer=(0, vector_of(1), 2.0))
    assert_same_values(decode(entry), want["layer_output", 2][0, -1:].unsqueeze(0), "steered, bfloat16", False)
    plain = traced_values(subject.model, ids, [("layer_output", 2)])["layer_output", 2][0, -1:]
    assert not torch.allclose(decode(entry).float()[0], plain, atol=0.1), "the steering must show in the capture"


def captured(client, server, prompt, capture, transport=None, **extra):
    """A greedy completion of ``STEPS`` tokens capturing ``capture``: the response."""
    body = {"capture": capture, "ignore_eos": True, **({"capture_transport": transport} if transport else {}), **extra}
    return client.completions.create(model=server["model"], prompt=prompt, max_tokens=STEPS, temperature=0.0,
                                     extra_body=body)


@pytest.mark.parametrize("local", [None, False], ids=["local", "http"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fetched_values_equal_the_inline_ones_bit_for_bit(server, client, prompts, dtype, local):
    """The prompt's, the decode steps' and listed positions' values, fetched as safetensors (through HTTP, or as
    the capture's file, which a client on the server's host maps: the default at 127.0.0.1), equal the same
    request's inline base64 ones bit for bit; the entries say the same but for ``data`` (inline) and ``id``/``url``."""
    from vlenvoys.capturing import decode, fetch

    capture = [{"value": "layer_output", "layers": "all", "dtype": dtype},
               {"value": "mlp_output", "layers": [1], "positions": "generated", "dtype": dtype},
               {"value": "attention_keys", "layers": 2, "positions": [0, -1, 3], "dtype": dtype}]
    for ids in prompts[:2]:
        inline = captured(client, server, ids, capture)
        fetched = captured(client, server, ids, capture, "fetch")
        assert fetched.choices[0].text == inline.choices[0].text
        entries, held = inline.model_extra["capture"], fetched.model_extra["capture"]
        assert all("data" not in entry and entry["url"] == f"/v1/captures/{entry['id']}" for entry in held)
        assert len({entry["id"] for entry in held}) == 1, "a response's entries are fetched together"
        assert len({json.dumps(entry["beacon"]) for entry in held}) == 1, "each names the server's beacon"
        assert [{**entry, "data": None} for entry in entries] == [
            {key: value for key, value in entry.items() if key not in ("id", "url", "beacon")} | {"data": None}
            for entry in held
        ]
        got = fetch(f"{server['url']}/v1", fetched, api_key=KEY, local=local)
        assert len(got) == 3
        for entry, tensor in zip(entries, got, strict=True):
            want = decode(entry)
            assert tensor.dtype == want.dtype == getattr(torch, dtype) and tensor.shape == want.shape, entry["value"]
            assert torch.equal(tensor.view(torch.uint8), want.view(torch.uint8)), entry["value"]
        assert got[1].shape[1] == STEPS - 1 and got[2].shape[1] == 3
    # Inline entries are decoded where they are: no server is asked (none answers at this address).
    local = fetch("http://127.0.0.1:9", inline)
    assert all(torch.equal(tensor, decode(entry)) for tensor, entry in zip(local, entries, strict=True))


def test_a_capture_is_fetched_once_and_an_unknown_id_is_a_404(server, client):
    """Raw HTTP: safetensors bytes behind the key, once; the second fetch and an unknown id are 404s saying why."""
    import httpx
    from safetensors.torch import load
    from vlenvoys.capturing import CaptureGone, fetch

    capture = [{"value": "layer_output", "layers": [0, 2]}, {"value": "mlp_output", "layers": 1, "positions": "last"}]
    answer = captured(client, server, "The cat sat", capture, "fetch")
    entries = answer.model_extra["capture"]
    url = f"{server['url']}{entries[0]['url']}"
    assert httpx.get(url, timeout=60).status_code == 401, "captures are behind --api-key"
    with pytest.raises(httpx.HTTPStatusError, match="no api_key was given; pass its key as fetch"):
        fetch(server["url"], answer)
    with pytest.raises(httpx.HTTPStatusError, match="the api_key given was refused"):
        fetch(server["url"], answer, api_key="wrong")
    headers = {"Authorization": f"Bearer {KEY}"}
    first = httpx.get(url, headers=headers, timeout=60)
    assert first.status_code == 200 and first.headers["content-type"] == "application/octet-stream"
    tensors = load(first.content)
    assert {name: list(tensor.shape) for name, tensor in tensors.items()} == {
        entry["value"]: entry["shape"] for entry in entries
    }
    again = httpx.get(url, headers=headers, timeout=60)
    assert again.status_code == 404 and "fetched already" in again.json()["error"]["message"], again.text
    with pytest.raises(CaptureGone, match="fetched already"):
        fetch(server["url"], answer, api_key=KEY)
    unknown = httpx.get(f"{server['url']}/v1/captures/0123abcd", headers=headers, timeout=60)
    assert unknown.status_code == 404 and "capture '0123abcd': never held here" in unknown.json()["error"]["message"]
    plain = client.completions.create(model=server["model"], prompt="The cat", max_tokens=2,
                                      extra_body={"capture": None, "capture_transport": "fetch"})
    assert plain.usage.completion_tokens == 2 and "capture" not in (plain.model_extra or {})


def test_several_captures_are_fetched_in_one_request(server, client, prompts):
    """Raw HTTP: ``GET /v1/captures?ids=a,b,...`` answers each held capture's tensors as ``{id}/{value}``, bit for
    bit the inline values of the same request, and names the ids it does not hold, and why, in its metadata."""
    import json
    import struct

    import httpx
    from safetensors.torch import load
    from vlenvoys.capturing import FETCH_TOGETHER, decode

    capture = [{"value": "layer_output", "layers": [0, 2]}, {"value": "mlp_output", "layers": 1, "positions": "last"}]
    held = [captured(client, server, ids, capture, "fetch").model_extra["capture"] for ids in prompts[:2]]
    inline = [captured(client, server, ids, capture).model_extra["capture"] for ids in prompts[:2]]
    names = [entries[0]["id"] for entries in held]
    url, headers = f"{server['url']}/v1/captures", {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(url, params={"ids": ",".join(names)}, timeout=60).status_code == 401, "behind --api-key"
    answer = httpx.get(url, params={"ids": ",".join([*names, "0123abcd"])}, headers=headers, timeout=60)
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/octet-stream", answer.text
    tensors = load(answer.content)
    assert sorted(tensors) == sorted(f"{name}/{value}" for name in names for value in ("layer_output", "mlp_output"))
    for name, entries in zip(names, inline, strict=True):
        for entry in entries:
            got, want = tensors[f"{name}/{entry['value']}"], decode(entry)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (name, entry["value"])
    (size,) = struct.unpack("<Q", answer.content[:8])
    gone = json.loads(json.loads(answer.content[8 : 8 + size])["__metadata__"]["gone"])
    assert list(gone) == ["0123abcd"] and "never held here" in gone["0123abcd"]
    again = httpx.get(url, params={"ids": names[0]}, headers=headers, timeout=60)
    assert again.status_code == 200 and load(again.content) == {}, "a capture is served once"
    assert "fetched already" in json.loads(json.loads(again.content[8 : 8 + struct.unpack("<Q", again.content[:8])[0]])[
        "__metadata__"]["gone"])[names[0]]
    for ids in ("", ",".join(["0123abcd"] * (FETCH_TOGETHER + 1))):
        refused = httpx.get(url, params={"ids": ids}, headers=headers, timeout=60)
        assert refused.status_code == 400 and "capture ids, comma-separated" in refused.json()["error"]["message"]


def test_concurrent_fetches_on_one_client_are_gathered(server, client, prompts):
    """24 responses fetched at once with `fetch_async` on one ``httpx.AsyncClient``: a few requests, not 24 (one
    round trip each cost served capture more than its values, #45), and each response gets its own values."""
    import httpx
    from vlenvoys.capturing import CaptureGone, fetch, fetch_async

    capture = [{"value": "layer_output", "layers": [0, 2]}, {"value": "mlp_output", "layers": 1, "positions": "all"}]
    firsts = prompts[:4]
    alone = [fetch(server["url"], captured(client, server, ids, capture, "fetch"), api_key=KEY) for ids in firsts]
    # Each capture holds a few KiB: the 24 fit the server's hold of `HELD_BYTES`.
    answers = [captured(client, server, firsts[number % 4], capture, "fetch") for number in range(24)]
    requests = []

    async def note(request):
        requests.append(request)

    async def all_at_once():
        async with httpx.AsyncClient(timeout=60, event_hooks={"request": [note]}) as http:
            got = await asyncio.gather(*(fetch_async(server["url"], answer, api_key=KEY, client=http)
                                         for answer in answers))
            with pytest.raises(CaptureGone, match="fetched already"):  # each id's own reason, through a gathered fetch
                await fetch_async(server["url"], answers[0], api_key=KEY, client=http)
            return got

    for number, got in enumerate(asyncio.run(all_at_once())):
        for value, tensor, expected in zip(("layer_output", "mlp_output"), got, alone[number % 4], strict=True):
            assert_same_values(tensor, expected, f"response {number}: {value}", exact_here())
    assert 2 <= len(requests) <= 5, [str(request.url) for request in requests]
    assert all(request.url.path == "/v1/captures" and "ids" in request.url.params for request in requests)


def test_an_unfetched_capture_expires_after_the_ttl(server, client):
    import time

    from vlenvoys.capturing import CaptureGone, fetch

    capture = {"value": "layer_output", "layers": 1}
    late = captured(client, server, "The cat", capture, "fetch")
    time.sleep(HELD_SECONDS + 0.5)
    soon = captured(client, server, "The cat", capture, "fetch")
    (tensor,) = fetch(server["url"], soon, api_key=KEY)
    with pytest.raises(CaptureGone, match=f"expired: not fetched within {HELD_SECONDS} s"):
        fetch(server["url"], late, api_key=KEY)
    assert torch.equal(tensor, fetch(server["url"], captured(client, server, "The cat", capture), api_key=KEY)[0])


def held_files() -> set[str]:
    """The files of captures held under /dev/shm (`vlenvoys.serve.capture.Image`), of every server on this host."""
    import glob

    return set(glob.glob("/dev/shm/vlenvoys-serve-*-*.safetensors"))


def test_a_local_fetch_hands_over_the_captures_file_and_none_is_left_behind(server, client, prompts):
    """Raw HTTP with ``local=1``: the answer names the capture's file under /dev/shm (a safetensors file of its
    values, bit for bit the inline ones) and carries no values; the client removes it (`fetch` does). A capture
    never fetched, and a file handed over that its client never removed, are removed ``--capture-ttl`` seconds on;
    a bad ``local`` is a 400, and a fetch of a capture gone a 404, as without it."""
    import json
    import struct
    import time

    import httpx
    from safetensors.torch import load, load_file
    from vlenvoys.capturing import CaptureGone, decode, fetch

    capture = [{"value": "layer_output", "layers": [0, 2]}, {"value": "mlp_output", "layers": 1, "positions": "last"}]
    url, headers = f"{server['url']}/v1/captures", {"Authorization": f"Bearer {KEY}"}

    def metadata(content: bytes) -> dict:
        (size,) = struct.unpack("<Q", content[:8])
        return json.loads(content[8 : 8 + size]).get("__metadata__", {})

    before = held_files()
    answers = [captured(client, server, ids, capture, "fetch") for ids in prompts[:3]]
    inline = captured(client, server, prompts[0], capture).model_extra["capture"]
    files = held_files() - before
    assert len(files) == 3, "each held capture is a file of its own"
    name = answers[0].model_extra["capture"][0]["id"]
    for query in ("2", "yes"):
        refused = httpx.get(f"{url}/{name}", params={"local": query}, headers=headers, timeout=60)
        assert refused.status_code == 400 and "local: expected 0 or 1" in refused.json()["error"]["message"]
    handed = httpx.get(f"{url}/{name}", params={"local": "1"}, headers=headers, timeout=60)
    assert handed.status_code == 200 and load(handed.content) == {}, "a file handed over carries no values here"
    path = json.loads(metadata(handed.content)["files"])[name]
    assert path in files and os.path.exists(path)
    for entry in inline:
        assert torch.equal(load_file(path)[entry["value"]].view(torch.uint8), decode(entry).view(torch.uint8))
    os.unlink(path)  # the client's to remove
    gone = httpx.get(f"{url}/{name}", params={"local": "1"}, headers=headers, timeout=60)
    assert gone.status_code == 404 and "fetched already" in gone.json()["error"]["message"]
    second = answers[1].model_extra["capture"][0]["id"]
    together = httpx.get(url, params={"ids": f"{second},0123abcd", "local": "1"}, headers=headers, timeout=60)
    assert together.status_code == 200 and load(together.content) == {}
    kept = json.loads(metadata(together.content)["files"])[second]
    assert list(json.loads(metadata(together.content)["gone"])) == ["0123abcd"]
    # Neither removed by a client nor fetched: both go once --capture-ttl seconds have passed, on the server's
    # timer (no request in between), and the fetch of the one never fetched says it expired.
    assert os.path.exists(kept) and (files - {path, kept}) <= held_files()
    time.sleep(HELD_SECONDS + 0.5)
    assert not (files & held_files()), "removed on the server's timer, with no request since"
    with pytest.raises(CaptureGone, match="expired"):
        fetch(server["url"], answers[2], api_key=KEY)
    assert not (files & held_files()), "no file is left behind"


def test_files_handed_over_count_against_the_cap_until_removed(server, client):
    """A file handed over (raw ``local=1``) and not removed by its client counts against --capture-held-bytes: with
    it, a fourth capture of 300 KiB drops the oldest held one; with three, a new one finds no room (a 400 saying
    why). Removed by their client, they count no more."""
    import struct

    import httpx
    from vlenvoys.capturing import CaptureGone, fetch

    url, headers = f"{server['url']}/v1/captures", {"Authorization": f"Bearer {KEY}"}

    def handed() -> str:
        name = captured(client, server, "The cat", BIG, "fetch").model_extra["capture"][0]["id"]
        answer = httpx.get(f"{url}/{name}", params={"local": "1"}, headers=headers, timeout=60)
        (size,) = struct.unpack("<Q", answer.content[:8])
        return json.loads(json.loads(answer.content[8 : 8 + size])["__metadata__"]["files"])[name]

    first = handed()
    answers = [captured(client, server, "The cat", BIG, "fetch") for _ in range(3)]
    with pytest.raises(CaptureGone, match="dropped unfetched to make room for newer captures"):
        fetch(server["url"], answers[0], api_key=KEY)
    os.unlink(first)  # its client's removal: the next capture finds room, none dropped
    answers.append(captured(client, server, "The cat", BIG, "fetch"))
    got = [fetch(server["url"], answer, api_key=KEY)[0] for answer in answers[1:]]
    assert all(list(tensor.shape) == [3, 200, 128] and torch.equal(tensor, got[0]) for tensor in got)
    files = [handed() for _ in range(3)]
    with pytest.raises(Exception, match="files handed to clients on its host that they have not removed yet"):
        captured(client, server, "The cat", BIG, "fetch")
    for path in files:
        os.unlink(path)
    (again,) = fetch(server["url"], captured(client, server, "The cat", BIG, "fetch"), api_key=KEY)
    assert torch.equal(again, got[0])


def test_a_beacon_this_client_does_not_read_fetches_the_bytes(server, client, prompts):
    """Entries whose beacon this client cannot open (as on another host, through a tunnel) or that holds another
    token: the default fetch asks for the bytes (no local=1), equal to the inline values bit for bit; local=True
    raises before anything is fetched, so the capture is still there."""
    import httpx
    from vlenvoys.capturing import NotLocal, decode, fetch

    capture = [{"value": "layer_output", "layers": [0, 2]}, {"value": "mlp_output", "layers": 1, "positions": "last"}]
    inline = captured(client, server, prompts[0], capture).model_extra["capture"]
    for wrong in ({"token": "0" * 32}, {"path": "/dev/shm/vlenvoys-serve-0123456789abcdef.lock"}):
        entries = [{**entry, "beacon": {**entry["beacon"], **wrong}}
                   for entry in captured(client, server, prompts[0], capture, "fetch").model_extra["capture"]]
        requests = []
        with httpx.Client(timeout=60, event_hooks={"request": [requests.append]}) as http:
            with pytest.raises(NotLocal, match="local=True: this client cannot read the server's capture files"):
                fetch(server["url"], entries, api_key=KEY, local=True, client=http)
            assert not requests, "nothing is fetched"
            got = fetch(server["url"], entries, api_key=KEY, client=http)
        assert [request.url.params.get("local") for request in requests] == [None]
        for entry, tensor in zip(inline, got, strict=True):
            assert torch.equal(tensor.view(torch.uint8), decode(entry).view(torch.uint8)), entry["value"]


def host_address() -> str | None:
    """An address of this host's other than a loopback one (None where it has none)."""
    import ipaddress
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))  # a route's source address; nothing is sent
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if ipaddress.ip_address(address).is_loopback else address


def test_a_server_that_refuses_local_is_asked_again_without_it(server, client, prompts):
    """A client on the server's host whose requests come from another address than a loopback one (as through
    Docker's ``-p``, where the server sees the bridge's): its beacon reads, it asks ``local=1``, gets a 400 (no
    capture taken), asks again without it and gets the bytes, equal to the inline values bit for bit; the same
    client asks no more ``local=1`` of that server, sync or async."""
    import httpx
    from vlenvoys.capturing import decode, fetch, fetch_async

    address = host_address()
    if address is None:
        pytest.skip("this host has no address but loopback ones")
    capture = [{"value": "layer_output", "layers": [0, 2]}, {"value": "mlp_output", "layers": 1, "positions": "last"}]
    inline = captured(client, server, prompts[0], capture).model_extra["capture"]
    requests = []
    with httpx.Client(timeout=60, transport=httpx.HTTPTransport(local_address=address),
                      event_hooks={"request": [requests.append]}) as http:
        for _ in range(2):
            got = fetch(server["url"], captured(client, server, prompts[0], capture, "fetch"), api_key=KEY, client=http)
            for entry, tensor in zip(inline, got, strict=True):
                assert torch.equal(tensor.view(torch.uint8), decode(entry).view(torch.uint8)), entry["value"]
    assert [request.url.params.get("local") for request in requests] == ["1", None, None]

    async def gathered():
        async def note(request):
            requests.append(request)

        async with httpx.AsyncClient(timeout=60, transport=httpx.AsyncHTTPTransport(local_address=address),
                                     event_hooks={"request": [note]}) as http:
            return await fetch_async(server["url"], captured(client, server, prompts[0], capture, "fetch"),
                                     api_key=KEY, client=http)

    requests.clear()
    for entry, tensor in zip(inline, asyncio.run(gathered()), strict=True):
        assert torch.equal(tensor.view(torch.uint8), decode(entry).view(torch.uint8)), entry["value"]
    assert [request.url.params.get("local") for request in requests] == ["1", None]


def test_the_oldest_held_captures_are_dropped_beyond_the_cap(server, client):
    """Four captures of 300 KiB under a cap of 1 MiB: the first is dropped, saying why; the three newer are served."""
    from vlenvoys.capturing import CaptureGone, fetch

    answers = [captured(client, server, "The cat", BIG, "fetch") for _ in range(4)]
    with pytest.raises(CaptureGone, match="dropped unfetched to make room for newer captures"):
        fetch(server["url"], answers[0], api_key=KEY)
    got = [fetch(server["url"], answer, api_key=KEY)[0] for answer in answers[1:]]
    assert all(list(tensor.shape) == [3, 200, 128] and torch.equal(tensor, got[0]) for tensor in got)


def test_a_steered_capture_is_fetched(server, client, prompts):
    """Steered at block 0 and capturing block 2's stream with fetch: the inline values of the same request, bit for
    bit, and not the unsteered run's."""
    from vlenvoys.capturing import decode, fetch

    steering = [{"layer": 0, "vector": "up", "factor": 2.0}]
    capture = {"value": "layer_output", "layers": 2, "positions": "all"}
    ids = prompts[0]
    (steered,) = fetch(server["url"], captured(client, server, ids, capture, "fetch", steering=steering), api_key=KEY)
    (inline,) = captured(client, server, ids, capture, steering=steering).model_extra["capture"]
    (plain,) = fetch(server["url"], captured(client, server, ids, capture, "fetch"), api_key=KEY)
    assert list(steered.shape) == [1, len(ids) + STEPS - 1, 128]
    assert torch.equal(steered, decode(inline))
    assert not torch.allclose(steered, plain, atol=0.1), "the steering must show in the fetched capture"


@pytest.mark.parametrize("transport", [None, "fetch"])
def test_concurrent_captures_each_get_their_own_values(server, client, prompts, transport):
    """24 capturing requests at once, which the server takes off the engine together (one take for all the
    requests that finished meanwhile): each gets its own values, those of the same request run alone."""
    from openai import AsyncOpenAI
    from vlenvoys.capturing import fetch, fetch_async

    capture = [{"value": "layer_output", "layers": [0, 2]}, {"value": "mlp_output", "layers": 1, "positions": "all"}]
    firsts = prompts[:4]
    alone = [fetch(server["url"], captured(client, server, ids, capture, transport), api_key=KEY) for ids in firsts]

    async def one(together, number):
        answer = await together.completions.create(
            model=server["model"], prompt=firsts[number % len(firsts)], max_tokens=STEPS, temperature=0.0,
            extra_body={"capture": capture, "ignore_eos": True, **({"capture_transport": transport} if transport else {})},
        )
        return await fetch_async(server["url"], answer, api_key=KEY)

    async def all_at_once():
        async with AsyncOpenAI(base_url=f"{server['url']}/v1", api_key=KEY, max_retries=0, timeout=300) as together:
            return await asyncio.gather(*(one(together, number) for number in range(24)))

    for number, got in enumerate(asyncio.run(all_at_once())):
        want = alone[number % len(firsts)]
        assert len(got) == len(want) == 2
        for value, tensor, expected in zip(("layer_output", "mlp_output"), got, want, strict=True):
            assert_same_values(tensor, expected, f"request {number}: {value}", exact_here())
