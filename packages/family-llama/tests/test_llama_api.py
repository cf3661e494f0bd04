"""nnterp's model API on vLLM (accessors, steer, skip, lens) and the CLI, on the tiny Llama."""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from typer.testing import CliRunner

import vlenvoys
import vlenvoys_testing as testing
from vlenvoys.cli import app
from vlenvoys_testing.conformance import close, logits_of

on_tiny_llama = pytest.mark.parametrize("subject", ["LlamaForCausalLM"], indirect=True)


@on_tiny_llama
def test_sizes_match_the_config(subject):
    config, model = subject.reference.config, subject.model
    assert (model.num_layers, model.num_heads, model.hidden_size, model.vocab_size) == (
        config.num_hidden_layers,
        config.num_attention_heads,
        config.hidden_size,
        config.vocab_size,
    )


@on_tiny_llama
def test_accessors_are_the_block_values(subject):
    model, prompt = subject.model, subject.prompts[1]
    with model.trace(prompt, temperature=0.0):
        got = list().save()
        for i in range(model.num_layers):
            got.append(
                (
                    model.layers_input[i],
                    model.attention_probabilities[i],
                    model.attentions_output[i],
                    model.mlps_output[i],
                    model.layers_output[i],
                )
            )
    expected = subject.expected(1)["values"]
    for i, (entering, pattern, attention, mlp, leaving) in enumerate(got):
        for value, name in (
            (entering, "layer_input"),
            (pattern, "attention_probabilities"),
            (attention, "attention_output"),
            (mlp, "mlp_output"),
            (leaving, "layer_output"),
        ):
            assert (value.cpu() - expected[name][i]).abs().max() <= 1e-4, (name, i)


@on_tiny_llama
def test_steer_equals_the_same_edit_by_hand(subject):
    model, prompt = subject.model, subject.prompts[2]
    vector = torch.linspace(-2, 2, subject.hidden_size)

    def by_hand(model):
        stream = model.layers[1].layer_output
        stream[:, [1, 3]] += 1.5 * vector.to(stream.device)

    steered = logits_of(model, prompt, lambda m: m.steer([1], vector, factor=1.5, token_positions=[1, 3]))
    assert torch.equal(steered, logits_of(model, prompt, by_hand))
    assert not torch.equal(steered, logits_of(model, prompt))


@on_tiny_llama
def test_steer_takes_nnterps_positions_and_batch_index_zero(subject):
    model, prompt = subject.model, subject.prompts[2]
    vector = torch.linspace(-2, 2, subject.hidden_size)
    expected = logits_of(model, prompt, lambda m: m.steer(1, vector, token_positions=[1, 3]))
    for same in ({"positions": [1, 3]}, {"token_positions": [1, 3], "batch_index": 0}):
        assert torch.equal(logits_of(model, prompt, lambda m: m.steer(1, vector, **same)), expected)
    for wrong, message in (
        ({"positions": [1], "token_positions": [1]}, "Cannot specify both"),
        ({"batch_index": 1}, "its own vLLM request"),
    ):
        with pytest.raises(ValueError, match=message):
            logits_of(model, prompt, lambda m: m.steer(1, vector, **wrong))
    # A position the prompt does not have: an IndexError that says how many tokens there are (torch's names
    # "dimension 0"), and the engine serves on.
    tokens = len(prompt)  # token ids
    for outside in ([1, tokens], -tokens - 1):
        with pytest.raises(IndexError, match=f"the stream of this step has {tokens} tokens"):
            logits_of(model, prompt, lambda m: m.steer(1, vector, token_positions=outside))
    assert torch.equal(logits_of(model, prompt, lambda m: m.steer(1, vector, token_positions=[1, 3])), expected)
    # In a trace steer runs on the engine, whose warnings stay there; a call in the client warns
    # the same way before its read fails (no trace: nnsight's ValueError).
    with pytest.warns(DeprecationWarning, match="use `token_positions`"), pytest.raises(ValueError):
        model.steer(1, vector, positions=[1])


@on_tiny_llama
def test_project_on_vocab_refuses_a_vector_of_another_width(subject):
    model, prompt = subject.model, subject.prompts[2]
    with pytest.raises(ValueError, match=rf"shape \[\.\.\., {subject.hidden_size}\] \(hidden_size\), got \[7\]"):
        logits_of(model, prompt, lambda m: m.project_on_vocab(torch.zeros(7)))
    with model.trace(prompt, temperature=0.0):
        lens = model.project_on_vocab(model.layers[-1].layer_output).save()
        logits = model.logits.save()
    assert torch.allclose(lens[0, -1].cpu(), logits.reshape(-1).cpu(), atol=1e-4), "the last block's lens is the logits"


@on_tiny_llama
def test_skip_layer_passes_the_input_on(subject):
    model, prompt = subject.model, subject.prompts[2]
    skipped = logits_of(model, prompt, lambda m: m.skip_layer(1))
    by_hand = logits_of(model, prompt, lambda m: m.layers[1].skip(m.layers[1].layer_input))
    assert torch.equal(skipped, by_hand)
    assert not torch.equal(skipped, logits_of(model, prompt))


@on_tiny_llama
def test_steer_takes_layers_in_any_order(subject):
    """nnterp sorts the layers; a later block cannot be edited before an earlier one."""
    model, prompt = subject.model, subject.prompts[2]
    vector = torch.linspace(-1, 1, subject.hidden_size)
    backwards = logits_of(model, prompt, lambda m: m.steer([2, 0, -1], vector))
    forwards = logits_of(model, prompt, lambda m: m.steer([0, 2], vector))
    assert torch.equal(backwards, forwards)
    assert not torch.equal(forwards, logits_of(model, prompt))


@on_tiny_llama
def test_next_token_probs_is_the_softmax_of_the_logits(subject):
    model, prompt = subject.model, subject.prompts[1]
    with model.trace(prompt, temperature=0.0):
        logits = model.logits.save()
        probabilities = model.next_token_probs.save()
    assert probabilities.shape == (1, subject.reference.config.vocab_size)
    assert torch.allclose(probabilities, logits.float().softmax(-1))
    assert abs(probabilities.sum().item() - 1) < 1e-5


@on_tiny_llama
def test_input_ids_are_the_prompts_tokens_then_each_steps_token(subject):
    """The prefill's ids per invoke; on each decode step the token the step before chose (greedy)."""
    model, prompts = subject.model, subject.prompts[:2]
    with model.trace(temperature=0.0, max_tokens=3) as tracer:
        results = dict().save()
        for number, prompt in enumerate(prompts):
            with tracer.invoke(prompt):
                steps = list()
                for _ in tracer.iter[0:3]:
                    ids = model.input_ids
                    steps.append((ids, model.input_size, model.logits.argmax(-1)))
                results[number] = steps
    for number, prompt in enumerate(prompts):
        (ids, size, chosen), *decoded = results[number]
        assert ids.dtype == torch.int64
        assert torch.equal(ids.cpu(), torch.tensor([prompt]))
        assert tuple(size) == (1, len(prompt))
        for ids, size, next_chosen in decoded:
            assert tuple(size) == (1, 1)
            assert torch.equal(ids, chosen.reshape(1, 1).to(torch.int64))
            chosen = next_chosen


@on_tiny_llama
def test_input_ids_are_read_only(subject):
    from vlenvoys import ReadOnly

    model, prompt = subject.model, subject.prompts[1]
    with pytest.raises(ReadOnly, match="input_ids is read-only"):
        with model.trace(prompt, temperature=0.0):
            model.input_ids = torch.zeros(1, len(prompt), dtype=torch.int64)
    assert torch.equal(logits_of(model, prompt), logits_of(model, prompt))


@on_tiny_llama
def test_topk_closest_tokens_of_the_last_stream_are_the_logits_top_k(subject):
    model, prompt = subject.model, subject.prompts[1]
    with model.trace(prompt, temperature=0.0):
        stream = model.layers[-1].layer_output[0]
        last = model.get_topk_closest_tokens(stream[-1], k=4).save()
        every = model.get_topk_closest_tokens(stream, k=4).save()
        logits = model.logits.save()
    top = logits[0].float().softmax(-1).topk(4)
    expected = model.probs_to_dict(top.indices, top.values)
    assert list(expected) == model.tokenizer.convert_ids_to_tokens(top.indices.tolist())
    assert isinstance(every, list) and len(every) == len(prompt)
    for got in (last, every[-1]):
        assert list(got) == list(expected)
        assert all(abs(got[token] - probability) <= 1e-5 for token, probability in expected.items())
    for wrong, message in (
        (torch.zeros(subject.hidden_size + 1), "does not match model hidden size"),
        (torch.zeros(1, 2, subject.hidden_size), "Expected 1D or 2D"),
    ):
        with pytest.raises(ValueError, match=message):
            with model.trace(prompt, temperature=0.0):
                model.get_topk_closest_tokens(wrong).save()
    with pytest.raises(ValueError, match="inside a trace"):
        model.get_topk_closest_tokens(torch.zeros(subject.hidden_size))
    with pytest.raises(ValueError, match="ids \\[n\\] and their probabilities"):
        model.probs_to_dict(top.indices, top.values[:2])
    with pytest.raises(ValueError, match="per row"):
        model.probs_to_dict(top.indices[None], top.values[None])


@on_tiny_llama
def test_steer_refuses_a_vector_of_another_width(subject):
    model, prompt = subject.model, subject.prompts[2]
    baseline = logits_of(model, prompt)
    hidden = subject.hidden_size
    for vector, error, message in (
        (torch.ones(hidden + 3), ValueError, rf"expected shape \[{hidden}\]"),
        (torch.ones(2, hidden), ValueError, rf"or \[1, {hidden}\], got \[2, {hidden}\]"),  # not a row per position
        (torch.ones(hidden, dtype=torch.bool), TypeError, "expected a real tensor"),
    ):
        with pytest.raises(error, match=message):
            logits_of(model, prompt, lambda m, vector=vector: m.steer(1, vector))
        with pytest.raises(error, match=message):  # the same check, before anything is submitted
            vlenvoys.Steering(1, vector).encode(model)
    assert torch.equal(logits_of(model, prompt), baseline)


@on_tiny_llama
def test_steer_and_steering_take_the_same_vectors(subject):
    """A new user's trial: ``model.steer`` took an integer or ``[1, hidden]`` vector that `vlenvoys.Steering`
    refused. Both take what nnterp's steer adds, and steer alike."""
    from vllm import SamplingParams

    model, prompt = subject.model, subject.prompts[2]
    whole = torch.arange(subject.hidden_size) % 5 - 2  # int64
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5, detokenize=False)
    plain = vlenvoys.generate(model, [prompt], params, progress=False)[0].outputs[0].logprobs[0]
    for vector in (whole, whole[None].float(), whole[None]):
        by_trace = logits_of(model, prompt, lambda m, vector=vector: m.steer(1, vector, factor=0.5))
        assert torch.equal(by_trace, logits_of(model, prompt, lambda m: m.steer(1, 0.5 * whole.float())))
        steered = vlenvoys.generate(model, [prompt], params, steering=vlenvoys.Steering(1, vector, 0.5),
                                    progress=False)[0].outputs[0].logprobs[0]
        assert steered != plain
        top = by_trace.topk(5)
        assert sorted(steered) == sorted(top.indices.tolist())


@on_tiny_llama
def test_generate_as_a_block_is_a_trace_and_called_plainly_runs_the_engine(subject):
    model, prompt = subject.model, "the quick brown fox"

    def tokens(result):
        return list((result[0] if isinstance(result, list) else result).outputs[0].token_ids)

    with model.generate(prompt, max_new_tokens=3, temperature=0.0) as tracer:
        stream = model.layers[1].layer_output.save()
        generated = tracer.result.save()
    with model.trace(prompt, max_tokens=3, temperature=0.0) as tracer:
        expected_stream = model.layers[1].layer_output.save()
        expected = tracer.result.save()
    assert torch.equal(stream, expected_stream)
    assert tokens(generated) == tokens(expected) and len(tokens(expected)) == 3
    assert tokens(model.generate(prompt, max_tokens=3, temperature=0.0)) == tokens(expected)


@on_tiny_llama
def test_a_block_that_does_not_exist_is_an_index_error(subject):
    model = subject.model
    for read in (lambda: model.layers[3].layer_output, lambda: model.layers_output[-4]):
        with pytest.raises(IndexError, match="blocks 0 to 2"):
            with model.trace(subject.prompts[0], temperature=0.0):
                read().save()
    assert torch.equal(logits_of(model, subject.prompts[0]), logits_of(model, subject.prompts[0]))


@on_tiny_llama
def test_an_out_of_order_read_says_the_order(subject):
    from nnsight.intervention.interleaver import OutOfOrderError

    model = subject.model
    said = r"A value of block 1 \(read at the input of model\.model\.layers\.1\.self_attn\.attn\) was requested after the model had run past it\.\n"
    with pytest.raises(OutOfOrderError, match=said + "Read and write values in the order the model computes them"):
        with model.trace(subject.prompts[1], temperature=0.0):
            model.layers[2].layer_output.save()
            model.layers[1].self_attn.attention_probabilities.save()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return testing.tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("cli"))


def test_lens_command(tiny_llama, tmp_path):
    out = tmp_path / "lens.png"
    result = CliRunner().invoke(app, ["lens", str(tiny_llama), "--prompt", testing.PROMPTS[1], "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "final prediction" in result.output
    assert out.stat().st_size > 10_000


def test_patterns_command(tiny_llama, tmp_path):
    out = tmp_path / "patterns.png"
    result = CliRunner().invoke(app, ["patterns", str(tiny_llama), "--layer", "1", "--prompt", testing.PROMPTS[1], "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.stat().st_size > 10_000


def test_collect_command(tiny_llama, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(testing.PROMPTS))
    out = tmp_path / "values.safetensors"
    result = CliRunner().invoke(
        app,
        ["collect", str(prompts), str(tiny_llama), "--layers", "0,-1", "--out", str(out), "--batch", "3"],
    )
    assert result.exit_code == 0, result.output
    assert out.stat().st_mode & 0o777 == prompts.stat().st_mode & 0o777  # a new file's mode, not safetensors' 0600
    tensors = load_file(str(out))
    assert len(tensors) == 2 * len(testing.PROMPTS)
    with safe_open(str(out), "pt") as saved:
        metadata = saved.metadata()
    assert json.loads(metadata["prompts"]) == list(testing.PROMPTS)
    assert (metadata["value"], json.loads(metadata["layers"]), metadata["model"]) == ("layer_output", [0, 2], str(tiny_llama))
    from transformers import AutoTokenizer

    from vlenvoys_testing import oracle

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    reference = oracle.load_reference(tiny_llama)
    for index, text in enumerate(testing.PROMPTS):
        ids = tokenizer(text)["input_ids"]
        expected = oracle.reference(reference, ids)["values"]["layer_output"]
        for layer in (0, 2):  # -1 is saved as block 2
            got = tensors[f"layer_output.{layer}.{index}"]
            assert got.shape == (len(ids), reference.config.hidden_size)
            assert (got - expected[layer][0]).abs().max() <= 1e-4


def test_commands_refuse_bad_options_before_starting_vllm(tiny_llama, tmp_path):
    runner = CliRunner()
    missing = tmp_path / "no-such-folder" / "lens.png"
    result = runner.invoke(app, ["lens", str(tiny_llama), "--out", str(missing)])
    assert result.exit_code == 1 and "there is no folder" in result.output
    result = runner.invoke(app, ["patterns", str(tiny_llama), "--layer", "-4"])
    assert result.exit_code == 1 and "blocks 0 to 2" in result.output
    assert runner.invoke(app, ["lens", str(tiny_llama), "--top", "0"]).exit_code == 2
    # Typed options (#49): a misspelt value says the nearest, a block must be an integer, dtype and positions are choices.
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a prompt\n")

    def said(result) -> str:  # the message, out of rich's box
        return " ".join(result.output.replace("\u2502", " ").split())

    result = runner.invoke(app, ["collect", str(prompts), str(tiny_llama), "--value", "layer_outptu"])
    assert result.exit_code == 2 and "did you mean 'layer_output'" in said(result), result.output
    result = runner.invoke(app, ["collect", str(prompts), str(tiny_llama), "--layers", "0,one"])
    assert result.exit_code == 2 and "expected block indices" in said(result), result.output
    for option, bad in (("--dtype", "int8"), ("--positions", "first")):
        result = runner.invoke(app, ["collect", str(prompts), str(tiny_llama), "--context-length", "8", option, bad])
        assert result.exit_code == 2 and option in result.output, result.output
    result = runner.invoke(app, ["collect", str(prompts), str(tiny_llama), "--layers", "0", "--layers", "-4"])
    assert result.exit_code == 1 and "blocks 0 to 2" in result.output, result.output  # repeated: both are checked


@on_tiny_llama
def test_containers_saved_above_the_invokes_hold_every_invokes_entries(subject):
    """As sequential invokes on transformers leave them: per-invoke sub-lists, one flat list, pre-sized slots."""
    model, prompts = subject.model, subject.prompts[:3]
    with model.trace(temperature=0.0, max_tokens=1) as tracer:
        rows = [list() for _ in prompts].save()
        flat = list().save()
        slots = [None] * len(prompts)
        slots = slots.save()
        for number, prompt in enumerate(prompts):
            with tracer.invoke(prompt):
                stream = model.layers[0].layer_output
                rows[number].append(stream[0, -1])
                rows[number].append(number)
                flat.append(stream.shape[1])
                slots[number] = model.logits[0]  # the last position's, [vocab]
    assert [len(each) for each in rows] == [2, 2, 2] and [each[1] for each in rows] == [0, 1, 2]
    assert flat == [len(prompt) for prompt in prompts]
    for number in range(len(prompts)):
        # The oracle's hooks, not transformers' output_hidden_states: that installs recorders holding a
        # ContextVar on the shared reference model, and the later traces that capture `subject` stop pickling.
        expected = subject.expected(number)
        want = expected["values"]["layer_output"][0][0, -1]
        assert close(subject, "saved above the invokes: layer_output", rows[number][0].cpu(), want)
        assert close(subject, "saved above the invokes: logits", slots[number].cpu(), expected["logits"])


@on_tiny_llama
def test_envoys_travel_by_path_unless_the_client_gave_them_something_of_its_own(subject):
    """A trace's requests name the worker's envoys; an attribute set on a client envoy makes them travel whole."""
    model, prompt = subject.model, subject.prompts[0]
    assert model._travels_by_path()
    with model.trace(prompt, temperature=0.0, max_tokens=1):
        plain = model.layers[1].layer_output.save()
    assert not any("_persistent_id" in envoy.__dict__ for envoy in model.modules()), "the tags are the trace's only"
    model.layers[1].scale = 3.0  # only the client's envoy has it
    try:
        assert not model._travels_by_path()
        with model.trace(prompt, temperature=0.0, max_tokens=1):
            scaled = (model.layers[1].layer_output * model.layers[1].scale).save()
    finally:
        del model.layers[1].scale
    assert model._travels_by_path()
    assert torch.equal(scaled.cpu(), plain.cpu() * 3.0)


def generated(result) -> int:
    """How many tokens a trace's request generated (``tracer.result``: its vLLM RequestOutput)."""
    return len(result.outputs[0].token_ids)


@on_tiny_llama
def test_a_trace_is_one_forward_pass_unless_it_asks_for_more(subject):
    """As on transformers and nnterp, a trace is one forward (max_tokens=1); what the user names wins (#49)."""
    model, prompts = subject.model, subject.prompts[:2]
    with model.trace(prompts[0], temperature=0.0) as tracer:
        one = tracer.result.save()
    with model.trace(prompts[0], temperature=0.0, max_new_tokens=3, ignore_eos=True) as tracer:
        three = tracer.result.save()
    assert (generated(one), generated(three)) == (1, 3)
    with model.trace(temperature=0.0, ignore_eos=True) as tracer:
        results = list().save()
        with tracer.invoke(prompts[0]):
            results.append(tracer.result)
        with tracer.invoke(prompts[1], max_tokens=2):
            results.append(tracer.result)
    assert [generated(result) for result in results] == [1, 2]
    with model.trace(temperature=0.0, max_tokens=4, ignore_eos=True) as tracer:
        with tracer.invoke(prompts[0]):
            four = tracer.result.save()
    assert generated(four) == 4
    # A trace that steps through a generation keeps vLLM's own length (16), as a `model.generate` block does.
    with model.trace(prompts[0], temperature=0.0, ignore_eos=True) as tracer:
        steps = list().save()
        for _ in tracer.iter[0:3]:
            steps.append(model.layers[0].layer_output.shape[1])
        stepped = tracer.result.save()
    assert steps == [len(prompts[0]), 1, 1] and generated(stepped) == 16
    with model.generate(prompts[0], temperature=0.0, ignore_eos=True) as tracer:
        default = tracer.result.save()
    assert generated(default) == 16
    # min_tokens alone asks for a generation: it is not cut to one token (nor refused by vLLM as above max_tokens).
    with model.trace(prompts[0], temperature=0.0, min_tokens=2, ignore_eos=True) as tracer:
        at_least = tracer.result.save()
    assert generated(at_least) == 16


@on_tiny_llama
def test_a_blocks_raw_output_warns_once_where_it_is_read_and_stays_readable(subject):
    """vLLM's block returns (hidden_states, residual): output[0] is not the stream; the warning says where it is."""
    model, prompt = subject.model, subject.prompts[1]
    with pytest.warns(vlenvoys.RawOutputWarning, match=r"\.layer_output") as warned:
        with model.trace(prompt, temperature=0.0):
            raw = model.layers[1].output[0].save()
            stream = model.layers[1].layer_output.save()
    raw_warnings = [entry for entry in warned if entry.category is vlenvoys.RawOutputWarning]
    assert [entry.filename for entry in raw_warnings] == [__file__], "once, at the user's line"
    assert raw.shape == (len(prompt), subject.hidden_size) and not torch.equal(raw.cpu(), stream[0].cpu())
    with warnings.catch_warnings():
        warnings.simplefilter("error", vlenvoys.RawOutputWarning)
        with model.trace(prompt, temperature=0.0):
            model.layers[1].mlp.output.save()  # a sublayer's output is its contribution: no pointer needed
            model.layers[1].layer_output.save()


@on_tiny_llama
def test_a_blocks_raw_input_warns_that_it_is_vllms_first_argument_and_points_at_layer_input(subject):
    """vLLM's Llama layer takes (positions, hidden_states, residual): a raw .input is the positions (#49 item 5)."""
    model, prompt = subject.model, subject.prompts[1]
    with pytest.warns(vlenvoys.RawOutputWarning, match=r"the first argument, positions.*\.layer_input"):
        with model.trace(prompt, temperature=0.0):
            positions = model.layers[2].input.save()
            stream = model.layers[2].layer_input.save()
    assert positions.tolist() == list(range(len(prompt))), "vLLM's first argument: the positions"
    assert stream.shape == (1, len(prompt), subject.hidden_size)
    with pytest.warns(vlenvoys.RawOutputWarning, match=r"every argument"):
        with model.trace(prompt, temperature=0.0):
            model.layers[2].inputs.save()


@on_tiny_llama
def test_a_misspelt_value_name_says_the_standard_name_it_is_close_to(subject):
    model, prompt = subject.model, subject.prompts[0]
    with pytest.raises(AttributeError, match=r"layer_ouput.*did you mean 'layer_output'\?"):
        with model.trace(prompt, temperature=0.0):
            model.layers[0].layer_ouput.save()
    with pytest.raises(AttributeError, match=r"attention_output.*self_attn\.attention_output"):
        with model.trace(prompt, temperature=0.0):
            model.layers[0].attention_output.save()
    with pytest.raises(AttributeError, match=r"did you mean 'mlp_neurons'\?"):
        with model.trace(prompt, temperature=0.0):
            model.layers[0].mlp.mlp_neuron.save()
    assert torch.equal(logits_of(model, prompt), logits_of(model, prompt))


@on_tiny_llama
def test_a_trace_draws_no_bar_nor_logs_vllms_info_and_long_calls_draw_one_bar(subject, capfd):
    """Traces print nothing of their own unless asked; collect and generate draw one bar unless progress=False (#49)."""
    from vllm import SamplingParams

    model, prompt = subject.model, subject.prompts[0]
    assert logging.getLogger("vllm").getEffectiveLevel() == logging.WARNING, "load quiets vLLM's INFO log"
    capfd.readouterr()
    with model.trace(prompt, temperature=0.0):
        model.logits.save()
    model.generate("The sun", max_tokens=2)  # nnsight's plain run, outside a block
    vlenvoys.collect(model, [prompt], "layer_output", 0, progress=False)
    vlenvoys.generate(model, [prompt], SamplingParams(max_tokens=2), progress=False)
    # None, collect's default before it drew bars, is False, as it was then.
    vlenvoys.collect(model, [prompt, prompt], "layer_output", 0, progress=None)
    vlenvoys.generate(model, [prompt], SamplingParams(max_tokens=2), progress=None)
    quiet = capfd.readouterr()
    assert "%|" not in quiet.err + quiet.out, quiet.err
    with model.trace(prompt, temperature=0.0, progress=True):
        model.logits.save()
    assert "Processed prompts" in capfd.readouterr().err
    vlenvoys.collect(model, [prompt, prompt], "layer_output", 0)
    assert "2/2" in capfd.readouterr().err
    vlenvoys.generate(model, [prompt], SamplingParams(max_tokens=2))
    assert "Processed prompts" in capfd.readouterr().err
    # The earlier forms still work, with a DeprecationWarning.
    counted = []
    with pytest.warns(DeprecationWarning, match="progress=True"):
        vlenvoys.collect(model, [prompt, prompt], "layer_output", 0, progress=counted.append)
    assert sum(counted) == 2
    with pytest.warns(DeprecationWarning, match="progress="):
        vlenvoys.generate(model, [prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert "%|" not in capfd.readouterr().err
