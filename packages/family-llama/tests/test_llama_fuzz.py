"""Fuzzed user blocks and request fields (#46): property-based tests on the shared engine and server.

Hypothesis draws (a) trace blocks that read, save and write standard values of
random shapes, dtypes, devices and containers, at random blocks (out of range
too) and steps, beside a plain invoke in the same trace; (b) request bodies with
random and malformed ``steering``, ``capture`` and ``capture_transport`` fields,
sent to a `vlenvoys serve` beside plain requests. None may end the engine or the
server; every failure is a clear error naming what the user did; the plain
requests in the same steps come out as alone; and after every example the engine
(or server) still serves a plain request its reference result.

Example counts are small for CI (`EXAMPLES`); ``VLENVOYS_FUZZ_EXAMPLES=500`` (or
``benchmarks/fuzz.py``) runs many more, ``VLENVOYS_FUZZ_SEED`` draws other examples
than CI's fixed ones.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import time

import pytest
import torch
import vlenvoys
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from nnsight.intervention.interleaver import OutOfOrderError
from test_llama_safety import plain_generation, within
from vlenvoys.engine.processes import runner_choice
from vlenvoys.values.names import VALUES

#: Examples per fuzz test in CI, and what ``VLENVOYS_FUZZ_EXAMPLES`` sets instead.
EXAMPLES = {"trace": 200, "serve": 120}
_ASKED = os.environ.get("VLENVOYS_FUZZ_EXAMPLES")
_SEED = os.environ.get("VLENVOYS_FUZZ_SEED")


def fuzz_settings(kind: str) -> settings:
    """Bounded, reproducible runs: CI draws the same examples every time (a fixed seed unless asked)."""
    return settings(
        max_examples=int(_ASKED) if _ASKED else EXAMPLES[kind],
        deadline=None,
        derandomize=_SEED is None,
        database=None,
        # One engine per session: examples are slow next to hypothesis' expectations, and the
        # session-scoped fixtures are shared on purpose.
        suppress_health_check=list(HealthCheck),
        # A failure is reported as drawn: shrinking reruns the engine for minutes.
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
        print_blob=True,
    )


def seeded(test):
    """``VLENVOYS_FUZZ_SEED`` chooses the examples of a longer run."""
    if _SEED is None:
        return test
    from hypothesis import seed

    return seed(int(_SEED))(test)


on_llama = pytest.mark.parametrize("subject", ["LlamaForCausalLM"], indirect=True)

# ---------------------------------------------------------------------------------------------
# (a) Trace blocks
# ---------------------------------------------------------------------------------------------

OWNERS = {name: owner for owner, name in VALUES}
BLOCK_VALUES = [name for _, name in VALUES]
MODEL_VALUES = ["token_embeddings", "logits", "samples"]
ORDER = {name: number for number, name in enumerate(BLOCK_VALUES)}
DTYPES = ["float32", "float16", "bfloat16", "float64", "int64", "int32", "bool"]
FILLS = ["zeros", "ones", "randn", "nan", "inf", "-inf", "huge", "index"]
SHAPES = ["same", "tokens+1", "last+1", "scalar", "row", "extra_dim", "empty", "no_batch"]

tensors = st.tuples(
    st.just("tensor"), st.sampled_from(SHAPES), st.sampled_from(DTYPES),
    st.sampled_from(["cpu", "cpu", "cpu", "meta"]), st.sampled_from(FILLS),
)
payloads = st.one_of(
    tensors, tensors, tensors,
    st.tuples(st.sampled_from(["list", "tuple", "dict"]), tensors),
    st.tuples(st.just("none")),
    st.tuples(st.just("int"), st.integers(-(2**70), 2**70)),
    st.tuples(st.just("float"), st.floats(allow_nan=True, allow_infinity=True)),
    st.tuples(st.just("bool"), st.booleans()),
    st.tuples(st.just("str"), st.text(max_size=5)),
)
#: How a value is touched: read (its shape), saved (in a container), written whole, or edited in place.
VERBS = ["read", "save", "save", "dot_save", "assign", "assign", "setitem", "iadd", "imul", "fill_row",
         "skip", "steer", "project"]
CONTAINERS = ["tensor", "clone", "list", "tuple", "dict", "nested", "slice", "shape", "dtype", "none", "int", "str",
              "float"]

#: Values a write reaches the model through (the rest are refused by name: read-only, unavailable).
WRITABLE = [name for name in BLOCK_VALUES if not name.startswith(("attention_scores", "attention_prob", "mlp_router",
                                                                  "mlp_activation"))]
operations = st.fixed_dictionaries({
    "value": st.sampled_from(BLOCK_VALUES + WRITABLE + WRITABLE + MODEL_VALUES),
    "layer": st.one_of(st.integers(-3, 2), st.integers(-3, 2), st.integers(-5, 5)),  # mostly blocks that exist
    "verb": st.sampled_from(VERBS),
    "payload": payloads,
    "container": st.sampled_from(CONTAINERS),
    "step": st.sampled_from([0, 0, 0, 1, 2, 3]),
})


def _position(op: dict) -> tuple:
    """Where the forward reaches a value, for sorting a block's operations into the model's order."""
    if op["value"] == "token_embeddings":
        return (-1, 0)
    if op["value"] in ("logits", "samples"):
        return (99, op["value"] == "samples")
    return (op["layer"] % 3 if -3 <= op["layer"] < 3 else op["layer"], ORDER[op["value"]])


@st.composite
def blocks(draw) -> dict:
    """A fuzzed block: operations, whether they run under ``tracer.iter`` and at which steps."""
    ops = draw(st.lists(operations, min_size=1, max_size=3))
    in_order = draw(st.booleans()) or draw(st.booleans())  # mostly in the model's order: the rest is nnsight's error
    if in_order:
        ops = sorted(ops, key=_position)
    steps = draw(st.integers(1, 3))
    iterate = draw(st.sampled_from([None, "range", "slice"]))
    start = draw(st.integers(0, 2))
    stop = draw(st.integers(start + 1, 4))
    return {"ops": ops, "steps": steps, "iterate": iterate, "start": start, "stop": stop, "in_order": in_order}


def make(payload: tuple, current) -> object:
    """The object a fuzzed write assigns, made in the block from its recipe (``current``: the value read)."""
    kind = payload[0]
    if kind == "none":
        return None
    if kind in ("int", "float", "bool", "str"):
        return payload[1]
    if kind in ("list", "tuple", "dict"):
        inner = make(payload[1], current)
        return {"list": [inner], "tuple": (inner, 1), "dict": {"value": inner}}[kind]
    _, shape_kind, dtype, device, fill = payload
    shape = list(current.shape) if isinstance(current, torch.Tensor) else [1, 3, 128]
    shape = {
        "same": shape,
        "tokens+1": shape[:1] + [shape[1] + 1] + shape[2:] if len(shape) > 1 else shape + [1],
        "last+1": shape[:-1] + [shape[-1] + 1] if shape else [1],
        "scalar": [],
        "row": shape[-1:],
        "extra_dim": [1, *shape],
        "empty": [0],
        "no_batch": shape[1:],
    }[shape_kind]
    dtype = getattr(torch, dtype)
    if fill == "randn":
        made = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    elif fill == "index":
        made = torch.arange(math.prod(shape)).reshape(shape).to(dtype)
    elif fill in ("zeros", "ones"):
        made = getattr(torch, fill)(shape, dtype=dtype)
    else:
        number = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "huge": 1e30}[fill]
        made = torch.full(shape, number).to(dtype)
    return made.to(device)


def envoy_of(model, op: dict):
    """The envoy a value is an attribute of: the model, a block, its attention or its MLP."""
    if op["value"] in MODEL_VALUES:
        return model
    block = model.layers[op["layer"]]
    owner = OWNERS[op["value"]]
    return block if owner == "layer" else getattr(block, owner)


def contained(value, container: str) -> object:
    """What a fuzzed save keeps: the value, or something made of it."""
    if container == "tensor":
        return value
    if container == "clone":
        return value.clone()
    if container == "list":
        return [value, value]
    if container == "tuple":
        return (value, "x", 1)
    if container == "dict":
        return {"value": value, "shape": tuple(value.shape)}
    if container == "nested":
        return {"rows": [value[..., :1], (value.sum(),)]}
    if container == "slice":
        return value[..., -1]
    if container == "shape":
        return value.shape
    if container == "dtype":
        return value.dtype
    if container == "int":
        return int(value.numel())
    if container == "float":
        return float(value.float().sum())
    if container == "str":
        return str(tuple(value.shape))
    return None


def apply(model, ops: list[dict], step: int, saved: list) -> None:
    """Run the block's operations drawn for this step (nnsight runs this on the engine)."""
    for number, op in enumerate(ops):
        if op["step"] != step:
            continue
        verb = op["verb"]
        if verb == "skip":  # the block handed the payload on as its output (the value named is not read)
            model.layers[op["layer"]].skip(make(op["payload"], model.layers[op["layer"]].layer_input))
            continue
        if verb == "steer":  # the payload's last 128 entries (or fewer) as the vector, with a drawn factor
            vector = make(op["payload"], torch.zeros(1, 128))
            model.steer(op["layer"], vector.flatten()[-128:] if isinstance(vector, torch.Tensor) else vector,
                        float(op["step"]) * 1e3 - 1)
            continue
        envoy, name = envoy_of(model, op), op["value"]
        if verb == "project":  # nnterp's logit lens of whatever the payload is
            saved.append((number, model.project_on_vocab(make(op["payload"], getattr(envoy, name)))))
            continue
        if verb == "assign":
            setattr(envoy, name, make(op["payload"], getattr(envoy, name)))
            continue
        value = getattr(envoy, name)
        if verb == "read":
            saved.append((number, tuple(value.shape)))
        elif verb == "save":
            saved.append((number, contained(value, op["container"])))
        elif verb == "dot_save":
            value.save()
        elif verb == "setitem":
            value[:] = make(op["payload"], value)
        elif verb == "iadd":
            value += make(op["payload"], value)
        elif verb == "imul":
            value *= make(op["payload"], value)
        else:  # fill_row
            value[..., -1] = make(op["payload"], value[..., -1])


#: The tiny Llama's value layouts (T: the step's tokens), for replaying a block's in-place operations on the client.
LAYOUTS = {
    **dict.fromkeys(["token_embeddings", "layer_input", "attention_norm_output", "attention_output", "layer_mid",
                     "mlp_norm_output", "mlp_output", "layer_output"], lambda t: [1, t, 128]),
    **dict.fromkeys(["attention_queries", "attention_head_outputs", "attention_premix"], lambda t: [1, t, 4, 32]),
    **dict.fromkeys(["attention_keys", "attention_values"], lambda t: [1, t, 2, 32]),
    **dict.fromkeys(["attention_scores", "attention_probabilities"], lambda t: [1, 4, t, t]),
    "mlp_neurons": lambda t: [1, t, 256],
    "logits": lambda t: [1, 512],
}
#: Token ids as the engine draws them (nnsight's ``model.samples``), one a request: vLLM's V1 sampler gives int32,
#: its V2 sampler int64.
SAMPLES = ([1, 1], torch.int64 if runner_choice() == "v2" else torch.int32)


def torch_says(block: dict, tokens: int) -> set[tuple[str, str]]:
    """What torch itself raises for the block's in-place operations on a plain tensor of each value's layout.

    A block's own torch operation that cannot be done (``value += x`` that cannot broadcast or cast) fails
    with torch's error, as it would outside vLLM; the engine survives it (README).
    """
    said = set()
    for op in block["ops"]:
        if op["verb"] not in ("setitem", "iadd", "imul", "fill_row"):
            continue
        for count in {tokens, 1}:
            if op["value"] == "samples":
                value = torch.zeros(SAMPLES[0], dtype=SAMPLES[1])
            else:
                value = torch.zeros(LAYOUTS.get(op["value"], lambda t: [1, t, 128])(count))
            try:
                if op["verb"] == "setitem":
                    value[:] = make(op["payload"], value)
                elif op["verb"] == "iadd":
                    value += make(op["payload"], value)
                elif op["verb"] == "imul":
                    value *= make(op["payload"], value)
                else:
                    value[..., -1] = make(op["payload"], value[..., -1])
            except Exception as error:  # noqa: BLE001
                said.add((type(error).__name__, first_line(error)))
    return said


def first_line(error: BaseException) -> str:
    return str(error).split("\n")[0].strip()


def assert_clear(error: BaseException, block: dict, tokens: int) -> None:
    """``error`` is an error of the kinds a bad block is told, and its message names what the block did.

    vlenvoys' own errors name the value (or the block); nnsight's out-of-order error names the block; a save that
    cannot come back names the variable; any other error must be the one torch raises for the same operation
    on a plain tensor (`torch_says`).
    """
    message = str(error)
    assert message.strip(), f"{type(error).__name__} with no message"
    #: What each operation is called in an error: its value, or the call it made.
    calls = {"skip": {"skip"}, "steer": {"steer", "steering_vector", "layer_output", "Steering"},
             "project": {"project_on_vocab"}}
    names = {op["value"] for op in block["ops"]} | {name for op in block["ops"] for name in calls.get(op["verb"], ())}
    if "token_embeddings" in names:  # an in-place edit of it is checked as what it is, block 0's layer_input
        names.add("layer_input")
    layers = {str(op["layer"]) for op in block["ops"]}
    named = any(re.search(rf"\b{re.escape(name)}\b", message) for name in names)
    if isinstance(error, vlenvoys.NoSuchBlock):
        assert any(re.search(rf"(?<![\w-]){re.escape(layer)}(?!\w)", message) for layer in layers), message
    elif isinstance(error, (vlenvoys.InvalidWrite, vlenvoys.ReadOnly, vlenvoys.Unavailable)):
        assert named, f"{type(error).__name__} names none of {sorted(names)}: {message}"
    elif isinstance(error, OutOfOrderError):
        assert "block" in message or "requested after" in message, message
    elif isinstance(error, vlenvoys.SkipRefused):
        assert "cannot skip" in message and re.search(r"layers\.\d", message), message
    elif isinstance(error, TypeError) and first_line(error).startswith("the saved variable"):
        pass
    elif isinstance(error, (ValueError, TypeError)) and named:
        pass
    else:
        said = torch_says(block, tokens)
        assert (type(error).__name__, first_line(error)) in said, (
            f"{type(error).__name__}: {message}\nis neither a vlenvoys error naming the value nor what torch "
            f"raises for the block's own operations: {said}")


class Reference:
    """A plain prompt's values (a trace's read and logits) and a plain generation's tokens, once per session."""

    def __init__(self, subject) -> None:
        model = subject.model
        self.prompt, self.fuzzed = subject.prompts[3], subject.prompts[1]
        with model.trace(self.prompt, temperature=0.0):
            stream = model.layers[1].layer_output.save()
            logits = model.logits.save()
        self.stream, self.logits = stream, logits
        self.generated = plain_generation(model)


_REFERENCE: dict = {}


def reference_of(subject) -> Reference:
    if subject.name not in _REFERENCE:
        _REFERENCE[subject.name] = Reference(subject)
    return _REFERENCE[subject.name]


def run_block(model, reference: Reference, block: dict) -> tuple:
    """The fuzzed block in one invoke beside a plain invoke of the reference prompt; (plain read, logits, saved)."""
    plain_stream = plain_logits = None
    steps, iterate = block["steps"], block["iterate"]
    with model.trace(temperature=0.0, max_tokens=steps, ignore_eos=True) as tracer:
        with tracer.invoke(reference.prompt):
            plain_stream = model.layers[1].layer_output.save()
            plain_logits = model.logits.save()
        with tracer.invoke(reference.fuzzed):
            saved = list().save()
            if iterate == "range":
                for step in tracer.iter[0:steps]:
                    apply(model, block["ops"], step, saved)
            elif iterate == "slice":
                for step in tracer.iter[block["start"]:block["stop"]]:
                    apply(model, block["ops"], step, saved)
            else:
                apply(model, block["ops"], 0, saved)
    return plain_stream, plain_logits, saved


def expected_saves(block: dict) -> list[int]:
    """The operations that save something, in the order a block that raised nothing runs them."""
    if block["iterate"] is None:
        steps = [0]
    elif block["iterate"] == "range":
        steps = range(block["steps"])
    else:  # a slice past the request's last step stops there
        steps = range(block["start"], min(block["stop"], block["steps"]))
    return [number for step in steps for number, op in enumerate(block["ops"])
            if op["step"] == step and op["verb"] in ("read", "save", "project")]


def assert_the_engine_serves(model, reference: Reference) -> None:
    engine = model.vllm_entrypoint.llm_engine
    assert engine.get_num_unfinished_requests() == 0, "the fuzzed trace's requests must not run on"
    assert engine.collective_rpc("nnsight_request_count") == [0], "their blocks must be wound up on the worker"
    assert plain_generation(model) == reference.generated, "a plain request must draw the same tokens"
    with model.trace(reference.prompt, temperature=0.0):
        stream = model.layers[1].layer_output.save()
    assert torch.equal(stream, reference.stream), "a trace must read the same values"


#: Every fuzzed block's outcome, for `benchmarks/fuzz.py`'s summary (``VLENVOYS_FUZZ_LOG``).
_LOG = os.environ.get("VLENVOYS_FUZZ_LOG")


def log(kind: str, outcome: str, detail: str, started: float) -> None:
    if _LOG:
        with open(_LOG, "a") as file:
            file.write(json.dumps({"test": kind, "outcome": outcome, "detail": detail[:300],
                                   "seconds": round(time.monotonic() - started, 2)}) + "\n")


@on_llama
@fuzz_settings("trace")
@seeded
@given(block=blocks())
def test_a_fuzzed_block_fails_alone_and_clearly(subject, block):
    model, reference = subject.model, reference_of(subject)
    plain_stream = plain_logits = None
    started = time.monotonic()
    try:
        with within(120):
            plain_stream, plain_logits, saved = run_block(model, reference, block)
        assert [number for number, _ in saved] == expected_saves(block), saved
        log("trace", "ok", json.dumps(block), started)
    except TimeoutError:
        raise
    except Exception as error:  # noqa: BLE001 - every error is checked for its kind and words
        log("trace", type(error).__name__, first_line(error), started)
        assert_clear(error, block, len(reference.fuzzed))
    # The plain invoke beside it: its values as alone (bound before the fuzzed one's error is raised, if any).
    if plain_stream is not None and not isinstance(plain_stream, type(None)):
        assert torch.equal(plain_stream, reference.stream), "the plain invoke's read changed"
    if plain_logits is not None:
        assert torch.equal(plain_logits, reference.logits), "the plain invoke's logits changed"
    assert_the_engine_serves(model, reference)


# ---------------------------------------------------------------------------------------------
# (b) Request fields of `vlenvoys serve`
# ---------------------------------------------------------------------------------------------

#: JSON that is no sensible field: numbers of every size, strings, nulls, nested containers.
junk = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
              st.text(max_size=6)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=2)),
    max_leaves=4,
)
numbers_ = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**70), 2**70),
                     st.floats(-10, 10, allow_nan=False))
vectors = st.one_of(
    st.sampled_from(["up", "down", "nope", ""]),
    st.builds(lambda fill, width: [fill] * width, st.floats(-4, 4, allow_nan=False),
              st.sampled_from([128, 128, 127, 1, 0])),
    st.builds(lambda first, rest: [first] + [0.5] * 127, numbers_, st.just(None)),  # one odd entry
    st.lists(junk, max_size=3),
    junk,
)
positions = st.one_of(
    st.sampled_from(["all", "prompt", "generated", "last", "some"]),
    st.lists(st.one_of(st.integers(-40, 40), st.integers(-(2**70), 2**70)), min_size=0, max_size=4),
    junk,
)
layers = st.one_of(st.integers(-5, 5), st.integers(-5, 5), st.integers(-(2**70), 2**70), junk)
steering_entries = st.fixed_dictionaries(
    {},
    optional={
        "value": st.one_of(st.sampled_from(["layer_output", "layer_output", "mlp_output", "layer_oops"]), junk),
        "layer": layers,
        "vector": vectors,
        "factor": st.one_of(numbers_, junk),
        "positions": positions,
        "colour": junk,
    },
).map(lambda entry: {"layer": 1, "vector": "up", **entry} if len(entry) < 2 else entry)
capture_entries = st.fixed_dictionaries(
    {"value": st.one_of(st.sampled_from(BLOCK_VALUES + ["layer_output"] * 4), junk)},
    optional={
        "layers": st.one_of(layers, st.just("all"), st.lists(st.integers(-4, 3), max_size=3)),
        "positions": positions,
        "dtype": st.one_of(st.sampled_from(["float32", "bfloat16", "float16", "int8"]), junk),
        "layer": junk,
    },
)


def fields(entries):
    """A request field: null, empty, one entry, a list of them (17 is one too many), or junk."""
    return st.one_of(st.none(), st.just([]), entries, st.lists(entries, min_size=1, max_size=3),
                     st.lists(entries, min_size=17, max_size=17), junk)


common = st.fixed_dictionaries(
    {"max_tokens": st.integers(1, 4)},
    optional={
        "steering": fields(steering_entries),
        "capture": fields(capture_entries),
        "capture_transport": st.one_of(st.sampled_from(["inline", "fetch", "fetch", "pigeon"]), junk),
        "stream": st.sampled_from([False, False, True]),
    },
)
#: Rarer: fields a request may misspell or set by hand, and vLLM's own fields our checks meet.
odd = st.fixed_dictionaries({}, optional={
    "n": st.integers(1, 2),
    "Steering": junk,
    "vllm_xargs": st.one_of(st.just({"vlenvoys_steer": "{}"}), st.just({"vlenvoys_collect": "x"}), junk),
    "cache_salt": st.one_of(st.text(max_size=4), junk),
})
requests = st.one_of(common, common, common, st.builds(lambda a, b: {**a, **b}, common, odd))
#: The request's route: a completion of text or of token ids, or a chat.
routes = st.sampled_from(["text", "ids", "chat"])

PLAIN = {"prompt": [1, 40, 41, 42, 43, 44], "max_tokens": 4, "temperature": 0.0, "logprobs": 1, "ignore_eos": True,
         "return_tokens_as_token_ids": True}


def serve_key() -> str:
    from test_llama_serve import KEY

    return KEY


async def plain_answer(client, server) -> tuple:
    """A plain completion's tokens and log-probabilities."""
    answer = await client.post(f"{server['url']}/v1/completions", json={"model": server["model"], **PLAIN})
    assert answer.status_code == 200, answer.text
    logprobs = answer.json()["choices"][0]["logprobs"]
    return tuple(logprobs["tokens"]), tuple(logprobs["token_logprobs"])


async def send(client, server, route: str, fields_: dict):
    """A fuzzed request; its status and its body (a stream's whole text)."""
    body = {"model": server["model"], "temperature": 0.0, "ignore_eos": True, **fields_}
    if route == "chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": "The cat sat"}]
    else:
        path, body["prompt"] = "/v1/completions", "The cat sat" if route == "text" else [1, 30, 31, 32]
    content = json.dumps(body)  # NaN and Infinity as Python writes them: the server must answer them too
    answer = await client.post(f"{server['url']}{path}", content=content, headers={"Content-Type": "application/json"})
    return answer.status_code, answer.text


#: The keys a 400 may name as its ``param`` or in its message, for a request with these fields.
FIELD_WORDS = ("steering", "capture", "capture_transport", "vllm_xargs", "Steering", "stream", "n", "use_beam_search")


def assert_answered_clearly(status: int, text: str, fields_: dict) -> None:
    """A 200 (its stream without an error event), or a 4xx whose message names the field at fault."""
    assert status < 500, f"the server failed ({status}) on {fields_}: {text[:2000]}"
    if status == 200:
        assert '"error"' not in text.split("data: [DONE]")[0] or not fields_.get("stream"), text[:2000]
        if not fields_.get("stream"):
            payload = json.loads(text)
            assert payload.get("choices"), text[:2000]
        return
    assert 400 <= status < 500, (status, text[:2000])
    error = json.loads(text).get("error", {})
    message, param = error.get("message", ""), error.get("param")
    assert message, text[:2000]
    ours = {key for key in ("steering", "capture", "capture_transport", "vllm_xargs", "Steering") if key in fields_}
    if ours:
        # Our fields are checked first, and the message names the one at fault (or vLLM names one of its own).
        assert param in FIELD_WORDS or any(word in message for word in FIELD_WORDS), (status, message, param, fields_)


@pytest.fixture(scope="module")
def plain_reference(server):
    import httpx

    async def one():
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {serve_key()}"}, timeout=120) as client:
            return await plain_answer(client, server)

    return asyncio.run(one())


@fuzz_settings("serve")
@seeded
@given(fields_=requests, route=routes)
def test_a_fuzzed_request_is_answered_clearly_and_plain_ones_beside_it_are_untouched(
    server, plain_reference, fields_, route
):
    import httpx

    started = time.monotonic()

    async def scenario():
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {serve_key()}"}, timeout=120) as client:
            fuzzed, beside = await asyncio.gather(send(client, server, route, fields_), plain_answer(client, server))
            return fuzzed, beside, await plain_answer(client, server)

    (status, text), beside, after = asyncio.run(scenario())
    log("serve", str(status), text[:300] if status != 200 else json.dumps(fields_)[:300], started)
    assert_answered_clearly(status, text, fields_)
    assert beside == plain_reference, "the plain request beside the fuzzed one changed"
    assert after == plain_reference, "the server must go on serving plain requests as before"


# ---------------------------------------------------------------------------------------------
# What the fuzzing found, each as its own case
# ---------------------------------------------------------------------------------------------


def fails_alone(subject, block, error, match) -> None:
    """``block(model)`` in an invoke beside a plain one raises ``error`` matching ``match``; the plain invoke's
    values are as alone, and the engine then serves traces and plain requests as before."""
    model, reference = subject.model, reference_of(subject)
    plain = None
    with within(120), pytest.raises(error, match=match) as raised:
        with model.trace(temperature=0.0) as tracer:
            with tracer.invoke(reference.prompt):
                plain = model.logits.save()
            with tracer.invoke(reference.fuzzed):
                block(model)
    assert plain is None or torch.equal(plain, reference.logits)
    assert_the_engine_serves(model, reference)
    return raised.value


@on_llama
def test_torchs_own_error_in_a_block_names_its_class_once(subject):
    """An in-place edit torch cannot broadcast came back as "RuntimeError: RuntimeError: output with shape ...";
    now as torch words it, the class named once (by the traceback)."""
    def block(model):
        stream = model.layers[1].layer_output
        stream += torch.zeros(1, 1, 10, 128)

    raised = fails_alone(subject, block, RuntimeError, r"^output with shape \[1, 10, 128\] doesn.t match the broadcast")
    assert not str(raised).startswith("RuntimeError")


@on_llama
@pytest.mark.parametrize("value", ["logits", "samples"])
def test_a_meta_tensor_written_to_logits_or_samples_is_refused_by_name(subject, value):
    """torch's "Cannot copy out of meta tensor; no data!" (a NotImplementedError) named neither the value nor the
    device; a meta tensor written to a stream was already refused so."""
    dtype = torch.float32 if value == "logits" else torch.int64
    shape = (1, 512) if value == "logits" else (1, 1)
    fails_alone(subject, lambda model: setattr(model, value, torch.zeros(shape, dtype=dtype, device="meta")),
                vlenvoys.InvalidWrite, rf"model\.{value}: expected a tensor on cpu, got one on meta")


#: What ``skip`` was handed that a write of the same stream is refused for: NaN, another width, dtype or device.
BAD_SKIPS = {
    "NaN": (torch.full((1, 10, 128), float("nan")), "skip: the written value has NaN or infinite entries"),
    "width": (torch.zeros(1, 10, 129), r"skip: expected shape \[1, 10, 128\]"),
    "dtype": (torch.zeros(1, 10, 128, dtype=torch.float16), "skip: expected dtype torch.float32, got torch.float16"),
    "device": (torch.zeros(1, 10, 128, device="meta"), "skip: expected a tensor on cpu, got one on meta"),
}


@on_llama
@pytest.mark.parametrize("bad", list(BAD_SKIPS))
def test_a_skip_is_checked_as_a_write(subject, bad):
    """``skip`` checked only the stream's first two axes: a NaN stream reached the cached keys and values, and
    every later plain request drew token 0 ([0, 0, 0] for [395, 104, 93]); another width, dtype or device reached
    the next block as it was. Now refused as a write of the stream is, and the engine serves as before."""
    hidden, match = BAD_SKIPS[bad]
    model, reference = subject.model, reference_of(subject)
    with within(120), pytest.raises(vlenvoys.InvalidWrite, match=match):
        with model.trace(reference.fuzzed, temperature=0.0):  # alone: a skip beside other requests is refused
            model.layers[1].skip(hidden)
    assert_the_engine_serves(model, reference)
    with model.trace(reference.fuzzed, temperature=0.0):
        model.layers[1].skip(model.layers[1].layer_input)  # a good skip still runs
        skipped = model.logits.save()
    assert skipped.shape == reference.logits.shape and not torch.equal(skipped, reference.logits)


#: Finite entries past the square root of float32's range, where a value reaches the model's products.
HUGE_WRITES = {
    "attention_keys": lambda model: model.layers[0].self_attn.attention_keys.fill_(3e38),
    "attention_values": lambda model: model.layers[0].self_attn.attention_values.fill_(3e38),
    "attention_queries": lambda model: model.layers[0].self_attn.attention_queries.fill_(3e38),
    "attention_head_outputs": lambda model: model.layers[0].self_attn.attention_head_outputs.fill_(3e38),
    "attention_premix": lambda model: model.layers[0].self_attn.attention_premix.fill_(3e38),
    "mlp_neurons": lambda model: setattr(model.layers[0].mlp, "mlp_neurons", torch.full((1, 10, 256), 1e30)),
    "layer_output": lambda model: model.steer(0, torch.ones(128), 3e38),
}


@on_llama
@pytest.mark.parametrize("value", list(HUGE_WRITES))
def test_a_finite_but_huge_write_is_refused_and_later_requests_are_untouched(subject, value):
    """Keys of 3e38 (finite, so let through) overflowed the query-key products to inf; the NaN after them reached
    the cached keys and values, and later plain requests drew token 0. Entries past sqrt(float32's largest value),
    the bound `vlenvoys.Steering` refuses past, are refused now; entries under it still go through."""
    fails_alone(subject, HUGE_WRITES[value], vlenvoys.InvalidWrite,
                rf"{value}: the written value has entries up to \S+, beyond 1.84e\+19")
    model, reference = subject.model, reference_of(subject)
    with model.trace(reference.fuzzed, temperature=0.0):
        model.layers[0].self_attn.attention_keys.fill_(1.8e19)  # under the bound: written, and the engine goes on
        written = model.logits.save()
    assert torch.isfinite(written).all()
    assert_the_engine_serves(model, reference)


@pytest.mark.parametrize("stream", [False, True])
def test_a_collector_named_by_hand_is_a_400_before_a_stream_begins(server, stream):
    """``vllm_xargs: {"vlenvoys_collect": ...}`` without ``capture`` passed the middleware and was refused only on the
    way to the engine: streamed, after the 200 had begun, as an error event inside the stream. Now a 400 up front."""
    import httpx

    body = {"model": server["model"], "prompt": "The cat", "max_tokens": 1, "stream": stream,
            "vllm_xargs": {"vlenvoys_collect": "x"}}
    answer = httpx.post(f"{server['url']}/v1/completions", json=body, timeout=60,
                        headers={"Authorization": f"Bearer {serve_key()}"})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "vllm_xargs" and "vlenvoys_collect keys are set by the server" in error["message"]


@on_llama
def test_an_assignment_to_token_embeddings_is_refused_by_that_name(subject):
    """``model.token_embeddings = True`` was refused as "layer_input: expected a tensor ...", a value the block never
    named; now as token_embeddings (block 0's layer_input)."""
    fails_alone(subject, lambda model: setattr(model, "token_embeddings", True), vlenvoys.InvalidWrite,
                r"^token_embeddings \(block 0's layer_input: expected a tensor of shape \[1, 10, 128\], got bool\)")
