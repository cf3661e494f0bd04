"""An engine that replays CUDA graphs (``vlenvoys.load(..., cuda_graphs=True)``): steering and collection on it.

Its decode steps replay graphs captured with the steering hooks of every
block in them (`vlenvoys.worker.steerer.Steerer`); each step's plan reaches the
replay through buffers at fixed addresses. On the CPU engine, which has no
graphs, these tests run the same hooks eagerly; on a GPU they check the
replays (GPU_RESULTS.md).
"""

from __future__ import annotations

import linecache
import types

import pytest
import torch

import vlenvoys
import vlenvoys_testing as testing
from vlenvoys_testing import oracle
from vlenvoys_testing.conformance import close, same_rows, steered_in_a_trace
from vlenvoys.wire.requests import EAGER_KEY
from vlenvoys.wire.requests import STEER_KEY as KEY
from vlenvoys.wire.steering import Entry, text
from vlenvoys.worker.steerer import REFUSED

on_llama = pytest.mark.parametrize("subject", ["LlamaForCausalLM"], indirect=True)
STEPS = 6


#: The trace sites the graph engine declares (#48): the stream at every block, the attention's output at block 1.
SITES = {"layer_output": "all", "attention_output": [1]}


@pytest.fixture(scope="module")
def graph_engine(tmp_path_factory):
    """The tiny Llama (the subject's weights: same architecture and seed) on an engine with CUDA graphs."""
    path = testing.tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("graphs"))
    with oracle.engine(str(path), cuda_graphs=True, sites=SITES) as model:
        yield model


@pytest.fixture
def sent(graph_engine, monkeypatch):
    """How many requests the graph engine has been sent since the test began."""
    engine = graph_engine.vllm_entrypoint.llm_engine
    count = [0]
    add = engine.add_request

    def counted(*args, **kwargs):
        count[0] += 1
        return add(*args, **kwargs)

    monkeypatch.setattr(engine, "add_request", counted)
    return count


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


def test_traces_without_declared_sites_are_refused_by_name(tmp_path):
    """An engine with graphs and no ``sites``: a trace is refused, naming sites= (the replays would skip its block)."""
    path = testing.tiny_model("LlamaForCausalLM", tmp_path / "model")
    with pytest.raises(ValueError, match="sites= declares what a trace may read on an engine that replays"):
        vlenvoys.load(path, sites={"layer_output": "all"})  # no graphs: nothing to declare
    with pytest.raises(ValueError, match="'layer_ouput' is not a standard block value; did you mean 'layer_output'"):
        vlenvoys.load(path, cuda_graphs=True, sites={"layer_ouput": "all"})
    with pytest.raises(vlenvoys.NoSuchBlock, match="block 9 is outside the model's 3 blocks"):
        vlenvoys.load(path, cuda_graphs=True, sites={"layer_output": [0, 9]})
    with oracle.engine(str(path), cuda_graphs=True) as undeclared:
        with pytest.raises(NotImplementedError, match="replays CUDA graphs.*sites=\\{'layer_output': 'all'\\}"):
            with undeclared.trace([1, 2, 3]):
                pass


def each_step_as_the_eager_engines(subject, prompts, got, want, steps):
    """Each prompt's reads (block 0's stream, block 1's attention output, the last block's stream, the logits) at
    each of ``steps`` steps: whole rows, equal to the eager engine's."""
    for prompt, mine, theirs in zip(prompts, got, want, strict=True):
        assert len(mine) == len(theirs) == steps
        for step, (ours, eager) in enumerate(zip(mine, theirs, strict=True)):
            tokens = len(prompt) if step == 0 else 1
            for name, a, b in zip(("layers_output[0]", "attention_output", "layer_output", "logits"), ours, eager,
                                  strict=True):
                if name != "logits":
                    assert a.shape == (1, tokens, subject.hidden_size), (name, step, a.shape)
                assert same_rows(a, b, subject), (name, step)


@on_llama
def test_a_trace_reads_declared_sites_on_every_step_as_the_eager_engine(subject, graph_engine):
    """#48: a generation traced on the graph engine serves its declared sites on the prefill and on every decode
    step, whole (never a short or missing row) and equal to the eager engine's."""
    steps = 5

    def read(model):
        with model.trace(temperature=0.0, max_tokens=steps, ignore_eos=True) as tracer:
            rows = list().save()
            for prompt in subject.prompts[:2]:
                with tracer.invoke(prompt):
                    mine = []
                    for _ in tracer.iter[0:steps]:
                        mine.append((model.layers_output[0], model.layers[1].self_attn.attention_output,
                                     model.layers[-1].layer_output, model.logits))
                    rows.append(mine)
        return rows

    got, want = read(graph_engine), read(subject.model)
    each_step_as_the_eager_engines(subject, subject.prompts[:2], got, want, steps)


@pytest.mark.parametrize(
    "body, eager",
    [
        ("model.layers[2].layer_output.save()", False),
        ("model.steer(1, torch.ones(model.hidden_size))", False),
        ("model.skip_layer(1)", True),
        ("model.input_ids.save()", True),
    ],
)
def test_a_block_that_waits_off_the_sites_asks_for_eager_steps(graph_engine, monkeypatch, body, eager):
    """A block that names what a graph broken only at the sites would pass (the embedding's input, a block's input
    for ``skip_layer``) marks its requests: their steps run eagerly (`vlenvoys.worker.sited`); other blocks do not."""
    engine = graph_engine.vllm_entrypoint.llm_engine
    marks = []
    add = engine.add_request

    def seen(request_id, prompt, params, *args, **kwargs):
        marks.append(bool((params.extra_args or {}).get(EAGER_KEY)))
        return add(request_id, prompt, params, *args, **kwargs)

    monkeypatch.setattr(engine, "add_request", seen)
    source = f"with model.trace([1, 2, 3], max_tokens=2):\n    {body}\n"
    name = f"<trace {len(linecache.cache)}>"  # nnsight reads a block's source through linecache
    linecache.cache[name] = (len(source), None, source.splitlines(keepends=True), name)
    exec(compile(source, name, "exec"), {"model": graph_engine, "torch": torch})
    assert marks == [eager]


@on_llama
@pytest.mark.skipif(not torch.cuda.is_available(), reason="sited graphs are CUDA graphs (the CPU engine has none)")
def test_traced_decode_steps_replay_the_graph_broken_at_the_sites(subject, tmp_path, monkeypatch):
    """#48, sited graphs (``VLENVOYS_SITED_GRAPHS=1``): each captured graph holds one break per declared site, a
    traced decode step replays one, and its reads and steering equal the eager engine's."""
    from vlenvoys.engine.processes import runner_choice

    monkeypatch.setenv("VLENVOYS_SITED_GRAPHS", "1")  # read here (V1 chosen) and in the engine's processes
    path = testing.tiny_model("LlamaForCausalLM", tmp_path)
    steps = 5
    if runner_choice() == "v2":  # captured through V1's seams: refused by name on V2 (asked for, or vLLM's only one)
        with pytest.raises(ValueError, match="sited graphs are captured through vLLM's V1 model runner"):
            with oracle.engine(str(path), cuda_graphs=True, sites=SITES):
                pass
        return
    with oracle.engine(str(path), cuda_graphs=True, sites=SITES) as model:
        engine = model.vllm_entrypoint.llm_engine
        before = engine.collective_rpc("vlenvoys_sited_stats")[0]
        assert before is not None and before["graphs"] > 0, before
        assert before["breaks"] == [len(before["locations"])], before
        vector = torch.ones(subject.hidden_size)

        def traced(on):
            with on.trace(temperature=0.0, max_tokens=steps, ignore_eos=True) as tracer:
                rows = list().save()
                for prompt in subject.prompts[:3]:  # 3 rows in a graph captured for 4: the padded batch trimmed
                    with tracer.invoke(prompt):
                        mine = list()
                        for _ in tracer.iter[0:steps]:
                            on.steer(0, vector)  # in forward order: the steered stream is read next, then later blocks
                            mine.append((on.layers_output[0], on.layers[1].self_attn.attention_output,
                                         on.layers[-1].layer_output, on.logits))
                        rows.append(mine)
            return rows

        got, want = traced(model), traced(subject.model)
        after = engine.collective_rpc("vlenvoys_sited_stats")[0]
    assert after["replays"] - before["replays"] >= steps - 1, (before, after)  # the decode steps, not eager ones
    each_step_as_the_eager_engines(subject, subject.prompts[:3], got, want, steps)


@pytest.mark.parametrize(
    "body, refused",
    [
        ("model.layers[0].self_attn.attention_output.save()", "model.layers\\[0\\].attention_output is not a declared site"),
        ("model.layers[1].mlp.mlp_output.save()", "model.layers\\[1\\].mlp_output is not a declared site"),
        ("model.layers[1].output.save()", "\\.output is a module's raw value"),
        ("[model.layers[i].self_attn.attention_output.save() for i in range(3)]", "cannot tell before the trace runs"),
        ("model.attentions_output[2].save()", "model.layers\\[2\\].attention_output is not a declared site"),
        ("model.layers[block].self_attn.attention_output.save()", "model.layers\\[2\\].attention_output"),
        ("model.steer(block, torch.ones(model.hidden_size))", None),
        ("helper(model)", "in _helper .*test_llama_graphs.py\\), line [0-9]+: attention_output is read at a block"),
        ("reader.read(model)", "in Reader.read .*model.layers\\[0\\].attention_output is not a declared site"),
        ("opaque(model)", "opaque is handed the model or one of its modules, and its source cannot be read"),
        ("(lambda block: model.layers[block].self_attn.attention_output.save())(1)", "cannot tell"),
        ("model.layers[7].layer_output.save()", "block 7 is outside the model's 3 blocks"),
        ("model.output.save()", "\\.output is a module's raw value"),
        ("model.attentions_output[1].save()", None),
        ("model.steer(layers=[0, 2], steering_vector=torch.ones(model.hidden_size))", None),
        ("out.layer_output = model.layers[2].layer_output.save()", None),
        ("[layer.layer_output.save() for layer in model.layers]", None),
    ],
)
def test_an_undeclared_site_is_refused_by_name_before_anything_is_sent(graph_engine, sent, body, refused):
    """#48: a trace reaching a site the engine did not declare is refused, naming it and the declaration, before any
    of its requests is sent; what is declared at every block may be read at any block however it is named."""
    block = 2  # noqa: F841 (read by the checked trace's frame)
    opaque = {}
    exec("def opaque(model):\n    return model.layers[0].self_attn.attention_output.save()\n", opaque)  # no source to read
    namespace = {"model": graph_engine, "torch": torch, "block": block, "helper": _helper, "reader": Reader(),
                 "opaque": opaque["opaque"], "out": types.SimpleNamespace()}
    source = f"with model.trace([1, 2, 3]) as tracer:\n    {body}\n"
    name = f"<trace {len(linecache.cache)}>"  # nnsight reads a block's source through linecache
    linecache.cache[name] = (len(source), None, source.splitlines(keepends=True), name)
    if refused is None:
        exec(compile(source, name, "exec"), namespace)
        assert sent[0] == 1
        return
    with pytest.raises(ValueError, match=refused) as error:
        exec(compile(source, name, "exec"), namespace)
    if "handed" not in refused and "outside" not in refused:
        assert "declared: layer_output at every block; attention_output at block 1" in str(error.value)
    assert sent[0] == 0


def _helper(model):
    return [model.layers[i].self_attn.attention_output.save() for i in range(3)]


class Reader:
    def read(self, model):
        return model.layers[0].self_attn.attention_output.save()


def test_an_installed_edit_is_refused_on_the_graph_engine(graph_engine):
    """model.edit() would run its block on every request, so every step would lose its graphs."""
    with pytest.raises(NotImplementedError, match="model.edit\\(\\) installs a block every request runs"):
        with graph_engine.edit() as (tracer, edit):
            graph_engine.layers[0].layer_output.save()


def test_values_declared_at_every_block_are_read_however_the_block_is_named(graph_engine, sent):
    with graph_engine.trace([1, 2, 3]):
        streams = list().save()
        for layer in graph_engine.layers:
            streams.append(layer.layer_output)
    assert sent[0] == 1 and [tuple(each.shape) for each in streams] == [(1, 3, graph_engine.hidden_size)] * 3


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
