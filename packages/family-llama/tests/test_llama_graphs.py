"""An engine that replays CUDA graphs (``vlenvoys.load(..., cuda_graphs=True)``): steering and collection on it.

Its decode steps replay graphs captured with the steering hooks of every
block in them (`vlenvoys.worker.steerer.Steerer`); each step's plan reaches the
replay through buffers at fixed addresses. On the CPU engine, which has no
graphs, these tests run the same hooks eagerly; on a GPU they check the
replays (GPU_RESULTS.md).
"""

from __future__ import annotations

import pytest
import torch

import vlenvoys
import vlenvoys_testing as testing
from vlenvoys_testing import oracle
from vlenvoys_testing.conformance import close, same_rows, steered_in_a_trace
from vlenvoys.wire.requests import STEER_KEY as KEY
from vlenvoys.wire.steering import Entry, text
from vlenvoys.worker.steerer import REFUSED

on_llama = pytest.mark.parametrize("subject", ["LlamaForCausalLM"], indirect=True)
STEPS = 6


@pytest.fixture(scope="module")
def graph_engine(tmp_path_factory):
    """The tiny Llama (the subject's weights: same architecture and seed) on an engine with CUDA graphs."""
    path = testing.tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("graphs"))
    with oracle.engine(str(path), cuda_graphs=True) as model:
        yield model


def logprobs_of(output) -> list[tuple[int, float]]:
    generated = output.outputs[0]
    return [(token, step[token].logprob) for token, step in zip(generated.token_ids, generated.logprobs, strict=True)]


@on_llama
def test_steered_generation_equals_steering_in_a_trace_on_the_eager_engine(subject, graph_engine):
    """Every prompt's tokens and log-probabilities: steered (block 1, every position) and not, side by side."""
    from vllm import SamplingParams

    prompts = subject.prompts
    vector = 3 * torch.randn(subject.model.hidden_size, generator=torch.Generator().manual_seed(5))
    steered = [number % 2 == 0 for number in range(len(prompts))]
    steering = [vlenvoys.Steering(1, vector, 2.0) if flag else None for flag in steered]
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=1)
    outputs = vlenvoys.generate(graph_engine, prompts, params, steering=steering)
    traced = steered_in_a_trace(subject.model, prompts, steered, vector, 2.0, STEPS)
    for number, (output, logits) in enumerate(zip(outputs, traced, strict=True)):
        assert list(output.outputs[0].token_ids) == [int(step.argmax()) for step in logits], number
        for (token, offered), step in zip(logprobs_of(output), logits, strict=True):
            want = step.float().log_softmax(-1)[token]
            assert close(subject, "graph engine: steered generation vs a trace", torch.tensor([offered]), want[None])
    plain = vlenvoys.generate(graph_engine, prompts[:1], params)[0]
    assert list(plain.outputs[0].token_ids) != list(outputs[0].outputs[0].token_ids), "the steering must show"


@on_llama
def test_positions_steer_only_the_generated_tokens(subject, graph_engine):
    """``positions=slice(len(prompt), None)``: the prompt's stream is untouched, so the first token is the plain one."""
    from vllm import SamplingParams

    prompt = subject.prompts[0]
    vector = 3 * torch.randn(subject.model.hidden_size, generator=torch.Generator().manual_seed(6))
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=1)
    plain = logprobs_of(vlenvoys.generate(graph_engine, [prompt], params)[0])
    late = vlenvoys.Steering([0, 2], vector, 4.0, positions=slice(len(prompt), None))
    steered = logprobs_of(vlenvoys.generate(graph_engine, [prompt], params, steering=late)[0])
    assert steered[0] == plain[0]
    assert steered != plain


@on_llama
def test_collect_equals_the_eager_engines(subject, graph_engine):
    """collect reads prefill steps, which this engine runs eagerly: the eager engine's values."""
    eager = vlenvoys.collect(subject.model, subject.prompts, "layer_output", [0, 2])
    graphs = vlenvoys.collect(graph_engine, subject.prompts, "layer_output", [0, 2])
    for key, rows in eager.items():
        for want, got in zip(rows, graphs[key], strict=True):
            assert same_rows(got, want, subject), key


def test_traces_are_refused_by_name(graph_engine):
    with pytest.raises(NotImplementedError, match="replays CUDA graphs"):
        with graph_engine.trace([1, 2, 3]):
            pass


def test_a_stream_the_steering_overflows_is_left_unsteered_and_refused(graph_engine):
    """A hand-made steering past float32's range at three blocks: refused by name, the engine's cache stays clean."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=1)
    prompt = [1, 5, 9, 13, 17]
    before = logprobs_of(vlenvoys.generate(graph_engine, [prompt], params)[0])
    # In the wire format, past the check every client makes (`vlenvoys.wire.steering.entry`).
    huge = torch.full((graph_engine.hidden_size,), 3e38).numpy().tobytes()
    spec = text([Entry((0, 1, 2), huge, None)])
    overflowing = SamplingParams(max_tokens=STEPS, ignore_eos=True, extra_args={KEY: spec})
    (output,) = graph_engine.vllm_entrypoint.generate([{"prompt_token_ids": prompt}], overflowing, use_tqdm=False)
    answers = graph_engine.vllm_entrypoint.llm_engine.collective_rpc("vlenvoys_steer_failures", args=([output.request_id],))
    assert answers[0] == {output.request_id: REFUSED}
    # Its non-finite rows never reached the key/value cache that the next request's blocks reuse.
    assert logprobs_of(vlenvoys.generate(graph_engine, [prompt], params)[0]) == before


def test_a_stopped_engine_says_so(graph_engine):
    """Last in this module: it stops the module's engine (the fixture's own shutdown then does nothing)."""
    vlenvoys.shutdown(graph_engine)
    with pytest.raises(RuntimeError, match="stopped by vlenvoys.shutdown"):
        with graph_engine.trace("The sun", temperature=0.0):
            graph_engine.logits.save()
    with pytest.raises(RuntimeError, match="engine is not running"):
        vlenvoys.collect(graph_engine, ["The sun"], "layer_output", 0)
    with pytest.raises(RuntimeError, match="not running"):
        vlenvoys.generate(graph_engine, ["The sun"])
