"""Shared-engine safety: isolation between requests, decode steps, faults, skips, caches, a soak.

vLLM batches every request in flight into one step. On its CPU engine a
request's values are bit-identical alone and batched (measured), so
isolation is checked with exact equality.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys

import psutil
import pytest
import torch

import vlenvoys
import vlenvoys_testing as testing
from vlenvoys_testing import oracle
from vlenvoys_testing.conformance import difference_of, record, same_rows

SAFETY_MODELS = ["LlamaForCausalLM", "SmolLM2"]
on_safety_models = pytest.mark.parametrize("subject", SAFETY_MODELS, indirect=True)


def prompts_of_eight_lengths(subject) -> list[list[int]]:
    longest = max(subject.prompts, key=len)
    lengths = sorted({max(2, len(longest) * k // 8) for k in range(1, 9)})
    while len(lengths) < 8:
        lengths.append(lengths[-1] + 1)
    return [(longest * 2)[:length] for length in lengths]


def run(model, prompts, edit_first=None, layer=1):
    """One invoke per prompt in one trace; each saves its layer-``layer`` stream and logits."""
    with model.trace(temperature=0.0) as tracer:
        results = dict().save()
        for number, prompt in enumerate(prompts):
            with tracer.invoke(prompt):
                if number == 0 and edit_first is not None:
                    edit_first(model)
                stream = model.layers[layer].layer_output.save()
                results[number] = (stream, model.logits.save())
    return [results[number] for number in range(len(prompts))]


@on_safety_models
def test_isolation_of_eight_requests(subject):
    model = subject.model
    prompts = prompts_of_eight_lengths(subject)
    alone = [run(model, [prompt])[0] for prompt in prompts]
    together = run(model, prompts)
    for number, ((stream, logits), (stream_alone, logits_alone)) in enumerate(zip(together, alone)):
        assert stream.shape == (1, len(prompts[number]), stream.shape[-1])
        assert same_rows(stream, stream_alone, subject), number
        assert same_rows(logits, logits_alone, subject), number

    def edit(model):
        model.layers[0].layer_mid[:] += 3.0

    edited = run(model, prompts, edit_first=edit)
    assert not torch.equal(edited[0][1], together[0][1]), "the edit must change its own request"
    for number in range(1, len(prompts)):
        # The same step shapes as `together`: exactly its values on the CPU engine; on a GPU the
        # edited request's rows are spliced into a new step tensor, and the kernels reading it
        # round differently (measured on an H200: 1 ulp), so there within the oracle's bound.
        assert same_rows(edited[number][0], together[number][0], subject), number
        assert same_rows(edited[number][1], together[number][1], subject), number


@on_safety_models
def test_decode_step_values_equal_transformers_fed_the_generated_tokens(subject):
    model = subject.model
    prompt, steps, layer = subject.prompts[1], 4, 1
    with model.trace(prompt, temperature=0.0, max_tokens=steps) as tracer:
        streams, tokens = list().save(), list().save()
        for _ in tracer.iter[0:steps]:
            streams.append(model.layers[layer].layer_output)
            tokens.append(model.samples)
    generated = [int(token.reshape(-1)[0]) for token in tokens]
    expected = oracle.reference(subject.reference, prompt + generated[:-1], subject.layout)
    want = expected["values"]["layer_output"][layer]
    assert streams[0].shape[1] == len(prompt)
    for step in range(1, steps):
        assert streams[step].shape == (1, 1, want.shape[-1])
        position = len(prompt) + step - 1
        got, reference = streams[step][0, 0], want[0, position]
        difference = difference_of(got, reference).max().item()
        record(subject.name, "decode-step layer_output", difference)
        assert difference <= subject.tolerance * max(1.0, reference.abs().max().item())


@on_safety_models
def test_an_edit_on_step_three_changes_only_what_follows(subject):
    model = subject.model
    prompt, steps = subject.prompts[1], 5
    vector = torch.zeros(subject.hidden_size)
    vector[:8] = 50.0

    def generate(edit_step=None):
        with model.trace(prompt, temperature=0.0, max_tokens=steps) as tracer:
            logits = list().save()
            for step in tracer.iter[0:steps]:
                if step == edit_step:
                    stream = model.layers[1].layer_output
                    stream[:, -1] += vector.to(stream.device)
                logits.append(model.logits)
        return logits

    plain, edited = generate(), generate(edit_step=3)
    for step in range(3):
        assert torch.equal(plain[step], edited[step]), step
    assert not torch.equal(plain[3], edited[3])


def _interrupted(model, hidden):
    model.layers[1].layer_output.save()
    raise KeyboardInterrupt("in the block")


FAULTS = {
    "token count": lambda model, hidden: setattr(model.layers[1], "layer_output", torch.zeros(1, 99, hidden)),
    "hidden size": lambda model, hidden: setattr(model.layers[1], "layer_output", torch.zeros(1, 3, hidden + 1)),
    "dtype": lambda model, hidden: setattr(model.layers[1], "layer_mid", model.layers[1].layer_mid.half()),
    "device": lambda model, hidden: setattr(model.layers[1], "layer_mid", torch.zeros(1, 3, hidden, device="meta")),
    "exception in the block": lambda model, hidden: (model.layers[1].layer_output.save(), 1 / 0),
    # Raised where the block runs, in the engine's worker, these two ended the engine (nnsight defers Exception only).
    "sys.exit in the block": lambda model, hidden: (model.layers[1].layer_output.save(), sys.exit(3)),
    "KeyboardInterrupt in the block": _interrupted,
    "unavailable value": lambda model, hidden: model.layers[1].mlp.mlp_activation.save(),
    # A token outside the vocabulary ended the engine at the next step's embedding lookup (its request goes on).
    "token past the vocabulary": lambda model, hidden: setattr(model, "samples", model.samples + 10**6),
    "negative token": lambda model, hidden: setattr(model, "samples", model.samples - 10**6),
    "token edited in place": lambda model, hidden: model.samples.fill_(-1),
    "float tokens": lambda model, hidden: setattr(model, "samples", model.samples.float()),
    "NaN logits": lambda model, hidden: setattr(model, "logits", model.logits * float("nan")),
    "logits of another shape": lambda model, hidden: setattr(model, "logits", model.logits[:, :7]),
}
RAISED = {
    "token count": (vlenvoys.InvalidWrite, r"layer_output: expected shape \[1, 3, "),
    "hidden size": (vlenvoys.InvalidWrite, r"layer_output: expected shape \[1, 3, "),
    "dtype": (vlenvoys.InvalidWrite, "layer_mid: expected dtype torch.float32, got torch.float16"),
    "device": (vlenvoys.InvalidWrite, "layer_mid: expected a tensor on .+, got one on meta, which holds no data"),
    "exception in the block": (ZeroDivisionError, "division by zero"),
    "sys.exit in the block": (vlenvoys.BlockExit, "the trace's block raised SystemExit: 3; its request ended there"),
    "KeyboardInterrupt in the block": (vlenvoys.BlockExit, "raised KeyboardInterrupt: in the block; its request ended"),
    "unavailable value": (vlenvoys.Unavailable, "mlp_activation is unavailable"),
    "token past the vocabulary": (vlenvoys.InvalidWrite, r"model.samples: token ids must be in \[0, \d+\)"),
    "negative token": (vlenvoys.InvalidWrite, r"model.samples: token ids must be in \[0, \d+\)"),
    "token edited in place": (vlenvoys.InvalidWrite, r"model.samples: token ids must be in \[0, \d+\)"),
    "float tokens": (vlenvoys.InvalidWrite, "model.samples: expected integer token ids, got torch.float32"),
    "NaN logits": (vlenvoys.InvalidWrite, r"model.logits: NaN or \+inf entries"),
    "logits of another shape": (vlenvoys.InvalidWrite, r"model.logits: expected shape \[1, \d+\], got \[1, 7\]"),
}


@pytest.mark.parametrize("subject", ["LlamaForCausalLM"], indirect=True)
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_faulty_request_ends_alone(subject, fault):
    """The faulty request raises in its own block; its neighbour in the step completes unchanged."""
    model, hidden = subject.model, subject.hidden_size
    neighbour, faulty = subject.prompts[3], subject.prompts[0][:3]
    (_, alone), = run(model, [neighbour])
    error, message = RAISED[fault]
    good = None
    with pytest.raises(error, match=message):
        with model.trace(temperature=0.0) as tracer:
            with tracer.invoke(neighbour):
                good = model.logits.save()
            with tracer.invoke(faulty):
                FAULTS[fault](model, hidden)
    assert good is not None and same_rows(good, alone, subject)
    (_, again), = run(model, [neighbour])
    assert torch.equal(again, alone), "the engine must go on serving"


@pytest.mark.parametrize("subject", ["LlamaForCausalLM"], indirect=True)
@pytest.mark.parametrize("call", ["trace", "generate"])
def test_a_trace_without_a_prompt_says_so(subject, call):
    """A trace or generation that reads with no prompt, its own or an invoke's, says so before anything is sent
    (nnsight's error named vLLM's module path and "interleaving")."""
    model = subject.model
    with pytest.raises(ValueError, match="this trace has no prompt where it reads: pass one"):
        with getattr(model, call)(max_tokens=1):
            model.layers[1].layer_output.save()
    (stream, _), = run(model, [subject.prompts[0]])  # the engine goes on
    assert stream.shape[1] == len(subject.prompts[0])


#: Where a call is interrupted: (the synchronous engine's method that raises KeyboardInterrupt, at which call of it).
INTERRUPTS = {"while its requests are added": ("add_request", 2), "at its first step": ("step", 1), "at a later step": ("step", 4)}


@pytest.mark.parametrize("subject", ["LlamaForCausalLM"], indirect=True)
@pytest.mark.parametrize("where", list(INTERRUPTS))
@pytest.mark.parametrize("call", ["trace", "vlenvoys.generate"])
def test_an_interrupted_call_leaves_nothing_running(subject, monkeypatch, where, call):
    """Ctrl-C at any point of a trace or a steered generation: its requests are aborted and their blocks wound up."""
    from vllm import SamplingParams

    model, prompts, steps = subject.model, subject.prompts[:3], 40
    engine = model.vllm_entrypoint.llm_engine
    (_, alone), = run(model, [prompts[0]])
    method, at = INTERRUPTS[where]
    original, calls = getattr(type(engine), method), []

    def interrupted(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == at:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(engine), method, interrupted)
    with pytest.raises(KeyboardInterrupt):
        if call == "trace":
            with model.trace(temperature=0.0, max_tokens=steps, ignore_eos=True) as tracer:
                for prompt in prompts:
                    with tracer.invoke(prompt):
                        streams = list().save()
                        for _ in tracer.iter[0:steps]:
                            streams.append(model.layers[1].layer_output)
        else:
            steering = vlenvoys.Steering(1, torch.ones(subject.hidden_size))
            vlenvoys.generate(model, prompts, SamplingParams(max_tokens=steps, ignore_eos=True), steering=steering)
    monkeypatch.undo()
    assert engine.get_num_unfinished_requests() == 0, "the interrupted call's requests must not run on"
    assert engine.collective_rpc("nnsight_request_count") == [0], "their blocks must be wound up on the worker"
    (_, again), = run(model, [prompts[0]])
    assert torch.equal(again, alone), "the engine must go on serving"


@pytest.mark.parametrize("subject", ["LlamaForCausalLM"], indirect=True)
def test_forced_tokens_and_masked_logits_reach_the_engine(subject):
    """The checks on ``model.samples`` and ``model.logits`` pass what the engine can take, edited or assigned."""
    model, prompt, steps = subject.model, subject.prompts[1], 3
    with model.trace(prompt, temperature=0.0, max_tokens=steps) as tracer:
        for _ in tracer.iter[0:steps]:
            model.samples = torch.full_like(model.samples, 7)
        forced = tracer.result.save()
    assert list(forced.outputs[0].token_ids) == [7] * steps
    with model.trace(prompt, temperature=0.0, max_tokens=1):
        drawn = model.samples.save()
    with model.trace(prompt, temperature=0.0, max_tokens=1):
        model.logits[0, int(drawn.reshape(-1)[0])] = float("-inf")  # in place: that token is masked out
        masked = model.samples.save()
    assert int(masked.reshape(-1)[0]) != int(drawn.reshape(-1)[0])


@pytest.mark.parametrize("subject", ["LlamaForCausalLM"], indirect=True)
def test_a_save_that_cannot_be_sent_back_fails_its_trace_alone(subject):
    """A saved lambda, alone or in a list: a TypeError naming the variable; the engine goes on."""
    import nnsight

    model, prompt = subject.model, subject.prompts[1]
    (_, alone), = run(model, [prompt])
    with pytest.raises(TypeError, match=r"the saved variable 'keep' \(builtins\.function\) cannot be sent back") as raised:
        with model.trace(prompt, temperature=0.0):
            keep = nnsight.save(lambda x: x)  # noqa: F841
            model.layers[1].layer_output.save()
    assert str(raised.value).startswith("the saved variable"), "the class name is the traceback's, not the message's"
    assert "functions defined in a trace do not pickle" in str(raised.value) and "torchvision" not in str(raised.value)
    with pytest.raises(TypeError, match=r"the saved variable 'kept' \(builtins\.list\) cannot be sent back from the "
                       r"engine: it holds a builtins\.function, which is a function"):
        with model.trace(prompt, temperature=0.0):
            kept = list().save()
            kept.append(lambda x: x)
    (_, again), = run(model, [prompt])
    assert torch.equal(again, alone), "the engine must go on serving"


#: What a block saves that cannot come back from the engine, and the type its error names.
UNSENDABLE_SAVES = {
    "tracer.iter itself": "nnsight.intervention.iterator.Iterations",
    "envoy": "vlenvoys_llama.LlamaLayer",
    "lambda": "builtins.function",
    "lock": "_thread.lock",
    "generator": "builtins.generator",
}


def plain_generation(model) -> list[int]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=3, temperature=0.0)
    (output,) = model.vllm_entrypoint.generate(["The sun"], params, use_tqdm=False)
    return list(output.outputs[0].token_ids)


@contextlib.contextmanager
def within(seconds: int):
    """A TimeoutError after ``seconds``, this process's engines killed first: a block that hangs the engine
    fails its test (and the engine's later tests), instead of hanging the session while the engine's memory grows
    (a client interrupted while its requests are in flight waits for their blocks to wind up)."""

    def expire(signum, frame):
        for child in psutil.Process().children(recursive=True):
            child.kill()
        raise TimeoutError(f"still running after {seconds} s; this process's engines were killed")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def assert_the_engine_goes_on(model, prompt, stream, generated) -> None:
    """A fresh trace reads the same stream as before, and a plain generation draws the same tokens."""
    (again, _), = run(model, [prompt])
    assert torch.equal(again, stream), "the engine must go on serving traces"
    assert plain_generation(model) == generated, "and plain requests"


@pytest.mark.parametrize("subject", ["LlamaForCausalLM"], indirect=True)
def test_saving_the_step_of_an_open_iter_block_fails_its_trace_alone(subject):
    """nnsight's deprecated block form, as a new user writes it: its block reads nothing of the model, so the
    open-ended loop ends at the engine's longest sequence, and the saved step objects are refused by name."""
    model, prompt = subject.model, subject.prompts[1]
    (stream, _), = run(model, [prompt])
    generated = plain_generation(model)
    expected = (r"the saved variable 'saved' \(builtins\.list\) cannot be sent back from the engine: "
                r"it holds a nnsight\.intervention\.iterator\.Iterations, which is nnsight's own")
    with within(60), pytest.raises(TypeError, match=expected):
        with model.trace("The Eiffel Tower is in", max_tokens=3) as tracer:
            saved = list().save()
            with tracer.iter[:] as it:
                saved.append(it)
    assert_the_engine_goes_on(model, prompt, stream, generated)


@pytest.mark.parametrize("subject", ["LlamaForCausalLM"], indirect=True)
def test_an_open_iter_loop_that_reads_nothing_ends(subject):
    """``for step in tracer.iter[:]`` with a block that never parks: at most max_model_len steps, then on."""
    model, prompt = subject.model, subject.prompts[1]
    with within(60), model.trace(prompt, max_tokens=3) as tracer:
        steps = list().save()
        for step in tracer.iter[:]:
            steps.append(step)
        after = model.layers[0].layer_output.save()
    assert steps == list(range(model.vllm_entrypoint.llm_engine.model_config.max_model_len))
    assert after.shape[-1] == subject.hidden_size


@pytest.mark.parametrize("saving", list(UNSENDABLE_SAVES))
@pytest.mark.parametrize("subject", ["LlamaForCausalLM"], indirect=True)
def test_a_saved_object_of_any_kind_that_cannot_come_back_fails_its_trace_alone(subject, saving):
    import threading

    import nnsight

    model, prompt = subject.model, subject.prompts[1]
    (stream, _), = run(model, [prompt])
    generated = plain_generation(model)
    expected = re.escape(f"the saved variable 'kept' ({UNSENDABLE_SAVES[saving]}) cannot be sent back from the engine")
    with pytest.raises(TypeError, match=expected):
        with model.trace(prompt, max_tokens=2) as tracer:
            model.layers[1].layer_output.save()
            if saving == "tracer.iter itself":
                kept = nnsight.save(tracer.iter[:])
            elif saving == "envoy":
                kept = nnsight.save(model.layers[0])
            elif saving == "lambda":
                kept = nnsight.save(lambda x: x)
            elif saving == "lock":
                kept = nnsight.save(threading.Lock())
            else:
                kept = nnsight.save(x for x in range(3))  # noqa: F841
    assert_the_engine_goes_on(model, prompt, stream, generated)


@pytest.mark.parametrize("subject", ["LlamaForCausalLM"], indirect=True)
def test_an_unsendable_save_in_one_invoke_leaves_the_other_invokes_value_delivered(subject):
    """Two invokes, two requests: the one saving step objects fails, and the trace raises its error; the other
    invoke's value is still delivered (bound before the error is raised), and the engine goes on."""
    model, prompt = subject.model, subject.prompts[1]
    (stream, _), = run(model, [prompt])
    generated = plain_generation(model)
    with within(60), pytest.raises(TypeError, match=r"the saved variable 'bad' \(builtins\.list\)"):
        with model.trace(temperature=0.0, max_tokens=2) as tracer:
            with tracer.invoke(prompt):
                good = model.layers[1].layer_output.save()
            with tracer.invoke(prompt):
                bad = list().save()
                with tracer.iter[:] as it:
                    bad.append(it)
    assert torch.equal(good, stream), "the other invoke's value is delivered, though the trace raises"
    assert_the_engine_goes_on(model, prompt, stream, generated)


@on_safety_models
def test_skip_alone_equals_transformers_with_the_block_skipped(subject):
    model, prompt, skipped = subject.model, subject.prompts[2], 1
    with model.trace(prompt, temperature=0.0):
        model.layers[skipped].skip(model.layers[skipped].layer_input)
        logits = model.logits.save()

    inputs = {}
    block = subject.block(skipped)
    handles = [
        block.register_forward_pre_hook(lambda module, args, kwargs: inputs.update(stream=args[0] if args else kwargs["hidden_states"]), with_kwargs=True),
        block.register_forward_hook(lambda module, args, output: inputs["stream"]),
    ]
    try:
        want = oracle.edited_logits(subject.reference, prompt, layout=subject.layout)
    finally:
        for handle in handles:
            handle.remove()
    difference = difference_of(logits.reshape(-1), want).max().item()
    record(subject.name, "skip block 1", difference)
    assert difference <= subject.tolerance * max(1.0, want.abs().max().item())
    assert not torch.equal(logits.reshape(-1).cpu(), oracle.edited_logits(subject.reference, prompt, layout=subject.layout))


@on_safety_models
def test_skip_on_a_shared_step_is_refused(subject):
    """The first request decodes while the second is prefilled in the same step: its skip is refused."""
    model = subject.model
    (_, alone), = run(model, [subject.prompts[3]])
    with pytest.raises(vlenvoys.SkipRefused, match="other requests|this request's"):
        with model.trace(temperature=0.0) as tracer:
            with tracer.invoke(subject.prompts[3], max_tokens=3):
                first = model.logits.save()
            with tracer.invoke(subject.prompts[1]):
                model.layers[1].skip(model.layers[1].layer_input)
    assert same_rows(first, alone, subject)


@pytest.mark.parametrize("subject", ["LlamaForCausalLM"], indirect=True)
def test_plain_requests_share_the_prefix_cache_and_traces_stay_out_of_it(subject):
    """Prefix caching is on by default: plain requests read a cached prefix, a trace neither leaves nor reads one."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    model, llm = subject.model, subject.model.vllm_entrypoint
    block = llm.llm_engine.vllm_config.cache_config.block_size
    assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    ids = [5 + (11 * position + 3) % 300 for position in range(block + 8)]  # a full block and more, new to this engine
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=1)

    def plain():
        (output,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        logprobs = [step[token].logprob for step, token in zip(output.outputs[0].logprobs, output.outputs[0].token_ids)]
        return output.num_cached_tokens, list(output.outputs[0].token_ids), logprobs

    # First an edited trace: a prefix it left in the cache would carry its edit into the plain runs.
    with model.trace(ids, temperature=0.0):
        model.layers[0].layer_output[:] += 50.0
        edited = model.layers[1].layer_output.save()
    first, second = plain(), plain()
    assert first[0] == 0, "the trace left its (edited) prefix in the cache"
    assert second[0] >= block, "plain requests share the cache"
    assert second[1] == first[1], "a cached prefix changes no token"
    # On a GPU a cached prefix changes which rows a kernel computes together, and with it the float rounding.
    assert torch.allclose(torch.tensor(second[2]), torch.tensor(first[2]), rtol=0, atol=1e-5), (first, second)
    # Then a trace of the cached prompt: every row computed (none served from the cache), and unedited.
    with model.trace(ids, temperature=0.0):
        stream = model.layers[1].layer_output.save()
    assert stream.shape[1] == edited.shape[1] == len(ids)
    collected = vlenvoys.collect(model, [ids], "layer_output", 1)["layer_output.1"][0]
    assert same_rows(collected, stream, subject)
    assert not same_rows(edited, stream, subject)


@pytest.fixture(scope="module")
def caching_engine(tmp_path_factory):
    """A tiny Llama engine with prefix caching and chunked prefill (16-token steps) turned on."""
    path = testing.tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("caching"))
    with oracle.engine(
        str(path), enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=16
    ) as model:
        yield model


def test_prefix_cache_never_serves_short_values(caching_engine):
    prompt = testing.PROMPTS  # any: repeated, so the second run could be served from the cache
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(caching_engine.args[0])(prompt[1])["input_ids"]
    first = run(caching_engine, [ids])[0]
    second = run(caching_engine, [ids])[0]
    assert first[0].shape[1] == second[0].shape[1] == len(ids)
    assert torch.equal(first[0], second[0])


def test_collect_joins_chunked_prefill_and_never_reads_the_prefix_cache(caching_engine):
    """collect's hooks take a prompt's rows from every chunk of its prefill, and a repeated prompt whole."""
    from transformers import AutoTokenizer

    path = caching_engine.args[0]
    ids = AutoTokenizer.from_pretrained(path)(testing.PROMPTS[3])["input_ids"]
    assert len(ids) > 16, "longer than one 16-token step, so its prefill comes in chunks"
    first, second = (vlenvoys.collect(caching_engine, [ids], "layer_output", [0, 2]) for _ in range(2))
    expected = oracle.reference(oracle.load_reference(path), ids)["values"]["layer_output"]
    for layer in (0, 2):
        got = first[f"layer_output.{layer}"][0]
        assert got.shape == (1, len(ids), expected[layer].shape[-1])
        assert torch.equal(got, second[f"layer_output.{layer}"][0]), "the repeat was served whole, not from the cache"
        difference = difference_of(got, expected[layer]).max().item()
        record("LlamaForCausalLM (chunked prefill)", "collect: layer_output", difference)
        assert difference <= 1e-4 * max(1.0, expected[layer].abs().max().item())


def test_steered_generation_shares_no_prefix_cache_with_unsteered(caching_engine):
    """A steered request's cache is salted by its steering: neither side reads the other's cached prefix."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    model = caching_engine
    ids = AutoTokenizer.from_pretrained(model.args[0])(" ".join(testing.PROMPTS * 6))["input_ids"][:180]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=1)
    steering = vlenvoys.Steering(1, 4 * torch.randn(model.hidden_size, generator=torch.Generator().manual_seed(3)))

    def logprobs(**steer):
        (output,) = vlenvoys.generate(model, [ids], params, **steer)
        return [(token, step[token].logprob) for token, step in zip(output.outputs[0].token_ids, output.outputs[0].logprobs)]

    plain = logprobs()  # its prefix is cached now
    steered = logprobs(steering=steering)
    model.vllm_entrypoint.reset_prefix_cache()
    assert logprobs(steering=steering) == steered, "the steered run read the unsteered run's cached prefix"
    assert logprobs() == plain, "the unsteered run read the steered run's cached prefix"
    assert steered != plain


def test_a_steering_the_engine_cannot_read_is_refused_and_the_engine_goes_on(caching_engine):
    """A hand-made ``extra_args`` steering (a block the model lacks) is refused by name, not raised in the worker."""
    from vllm import SamplingParams

    from vlenvoys.wire.requests import STEER_KEY as KEY
    from vlenvoys.wire.steering import Entry, text

    model = caching_engine
    spec = text([Entry((7,), torch.ones(model.hidden_size).numpy().tobytes(), None)])  # past every client's check
    params = SamplingParams(temperature=0.0, max_tokens=2, extra_args={KEY: spec})
    (output,) = model.vllm_entrypoint.generate(["The sun"], params, use_tqdm=False)
    (refused, *_) = model.vllm_entrypoint.llm_engine.collective_rpc("vlenvoys_steer_failures", args=([output.request_id],))
    assert "blocks [7]: the model has blocks 0 to 2" in refused[output.request_id]
    assert len(vlenvoys.generate(model, ["The sun"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2


def test_chunked_prefill_is_refused_not_short(caching_engine):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(caching_engine.args[0])(testing.PROMPTS[3])["input_ids"]
    assert len(ids) > 16
    with pytest.raises(RuntimeError, match="chunk"):
        run(caching_engine, [ids])


def _memory() -> tuple[float, float]:
    """Resident memory in MiB of this process and of its engine processes."""
    me = psutil.Process(os.getpid())
    engine = sum(child.memory_info().rss for child in me.children(recursive=True))
    return me.memory_info().rss / 2**20, engine / 2**20


@pytest.mark.parametrize("subject", ["LlamaForCausalLM"], indirect=True)
def test_soak_three_hundred_requests(subject):
    """300 traced requests in a row: reads, edits, faulty writes; every result checked.

    A request whose saves leaked into another's would not equal its own baseline.
    """
    model = subject.model
    prompts = subject.prompts
    baseline = [run(model, [prompt])[0] for prompt in prompts]

    def edit(model):
        model.layers[1].mlp.mlp_output[:] = 0

    edited = [run(model, [prompt], edit_first=edit)[0][1] for prompt in prompts]
    samples = []
    for request in range(300):
        index = request % len(prompts)
        prompt = prompts[index]
        kind = request % 10
        if kind == 9:
            with pytest.raises(vlenvoys.InvalidWrite):
                run(model, [prompt], edit_first=lambda m: setattr(m.layers[1], "layer_output", torch.zeros(1, 1, 1)))
        elif kind % 2:
            (_, logits), = run(model, [prompt], edit_first=edit)
            assert torch.equal(logits, edited[index]), request
        else:
            with model.trace(prompt, temperature=0.0):
                stream = model.layers[1].layer_output.save()
                logits = model.logits.save()
            assert torch.equal(stream, baseline[index][0]) and torch.equal(logits, baseline[index][1]), request
        if request in (50, 299):
            samples.append(_memory())
    (client_early, engine_early), (client_late, engine_late) = samples
    record(subject.name, "soak client RSS growth MiB (req 50->300)", client_late - client_early)
    record(subject.name, "soak engine RSS growth MiB (req 50->300)", engine_late - engine_early)
    assert client_late - client_early < 100
    assert engine_late - engine_early < 100


@pytest.fixture(scope="module")
def async_engine(tmp_path_factory):
    """A tiny Llama on vLLM's async engine, where an untraced request can run beside a traced one.

    Its tests run their coroutines on one event loop (`on_the_engine_loop`): vLLM's async engine
    serves the loop it first ran on, and waits forever on any later one.
    """
    import asyncio

    path = testing.tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("async"))
    loop = asyncio.new_event_loop()
    with oracle.engine(str(path), mode="async") as model:
        _LOOPS[id(model)] = loop  # not an attribute: an envoy given one travels to the worker whole, loop and all
        yield model
        _LOOPS.pop(id(model))
    pending = asyncio.all_tasks(loop)  # the engine's output handler: cancelled, as asyncio.run would
    for task in pending:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


_LOOPS: dict = {}


def on_the_engine_loop(model, coroutine):
    return _LOOPS[id(model)].run_until_complete(coroutine)


def test_a_plain_request_sharing_the_step_is_untouched(async_engine):
    """An untraced request in flight beside a traced one that edits: its tokens and logprobs are as alone."""
    import asyncio

    from nnsight.intervention.interleaver import Mediator

    model = async_engine
    plain_prompt, traced_prompt = [1, 5, 7, 9, 11, 13], [1, 2, 3, 4, 5]

    async def plain_alone():
        return (await model.generate([plain_prompt], max_tokens=8, temperature=0.0, logprobs=3))[0]

    async def side_by_side(edit: bool):
        plain = asyncio.create_task(model.generate([plain_prompt], max_tokens=8, temperature=0.0, logprobs=3))
        await asyncio.sleep(0)  # the plain request is submitted first
        with model.trace(traced_prompt, temperature=0.0, max_tokens=3) as tracer:
            steps = list().save()
            for _ in tracer.iter[0:3]:
                stream = model.layers[1].layer_output
                mediator = Mediator.current("batch")
                steps.append((mediator.batch_group[1], mediator.interleaver.batcher.total))
                if edit:
                    stream[:] += 5.0
        traced = await tracer.backend
        return (await plain)[0], traced

    async def scenario():
        return await plain_alone(), await side_by_side(False), await side_by_side(True)

    alone, (plain, traced), (plain_beside_edit, edited) = on_the_engine_loop(model, scenario())
    assert any(total > rows for rows, total in traced.saves["steps"]), "the two requests never shared a step"

    def logprobs(output):
        return [{token: entry.logprob for token, entry in step.items()} for step in output.outputs[0].logprobs]

    for beside in (plain, plain_beside_edit):
        assert beside.outputs[0].token_ids == alone.outputs[0].token_ids
        # Exactly on the CPU engine; on a GPU within the oracle's bound (see same_rows).
        for step, step_alone in zip(logprobs(beside), logprobs(alone), strict=True):
            assert step.keys() == step_alone.keys()
            assert same_rows(torch.tensor(list(step.values())), torch.tensor(list(step_alone.values())))
    assert edited.outputs[0].token_ids != traced.outputs[0].token_ids, "the edit must change its own request"


def test_a_client_that_disconnects_mid_request_leaves_nothing_behind(async_engine):
    """A traced request whose consumer goes away mid-generation (its stream closed, then another's task
    cancelled): the request is aborted, its block is wound up on the worker, and the engine serves as before."""
    import asyncio
    import contextlib

    model, prompt = async_engine, [1, 5, 7, 9, 11, 13]

    def long_trace():
        with model.trace(prompt, temperature=0.0, max_tokens=60, ignore_eos=True) as tracer:
            streams = list().save()
            for _ in tracer.iter[0:60]:
                streams.append(model.layers[1].layer_output)
        return tracer.backend

    async def first_token():
        with model.trace(prompt, temperature=0.0, max_tokens=1) as tracer:
            model.layers[1].layer_output.save()
        return (await tracer.backend).outputs[0].token_ids

    async def left_behind():
        await asyncio.sleep(0.2)
        counts = await model.vllm_entrypoint.collective_rpc("nnsight_request_count")
        return counts, model.vllm_entrypoint.output_processor.get_num_unfinished_requests()

    async def scenario():
        before, seen = await first_token(), {}
        stream = long_trace().__aiter__()
        await stream.__anext__()
        await stream.__anext__()
        await stream.aclose()
        seen["closes its stream"] = (*await left_behind(), await first_token())

        async def consume(backend):
            async for _ in backend:
                pass

        task = asyncio.create_task(consume(long_trace()))
        await asyncio.sleep(0.5)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        seen["is cancelled"] = (*await left_behind(), await first_token())
        return before, seen

    before, seen = on_the_engine_loop(model, scenario())
    for disconnect, (counts, unfinished, after) in seen.items():
        assert counts == [0], f"a client that {disconnect}: its block must be wound up on the worker"
        assert unfinished == 0, f"a client that {disconnect}: its request must not run on"
        assert after == before, f"a client that {disconnect}: the engine must go on serving"


def test_a_refused_load_leaves_no_process_group_behind(tmp_path):
    """nnsight brings a process group up to build a model's tree and takes it down before the engine starts. A load
    vLLM refused in between left it up (or half up, and every later load failed: "pipeline model parallel group is
    not initialized"); a refused load now takes it down, and the next load starts as the first did."""
    path = str(testing.tiny_model("LlamaForCausalLM", tmp_path))
    assert not torch.distributed.is_initialized(), "a load before this test left a process group up"
    with pytest.raises(Exception, match="max_model_len"):
        vlenvoys.load(path, max_model_len=-5)
    assert not torch.distributed.is_initialized()

