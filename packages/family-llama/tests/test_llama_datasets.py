"""vlenvoys.activations (`vlenvoys.collect.activations`): a corpus cut into windows, its values streamed to shards equal to transformers' and collect's."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import numpy
import pytest
import torch
from typer.testing import CliRunner

import vlenvoys_testing as testing

from vlenvoys_testing import oracle
from vlenvoys.activations import Activations, collect_dataset, documents, windows
from vlenvoys.cli import app
from vlenvoys.collect import collect
from vlenvoys_testing.conformance import close, same_rows

on_tiny_llama = pytest.mark.parametrize("subject", ["LlamaForCausalLM"], indirect=True)

#: Documents of a few to a few dozen tokens: windows of 16 cross document boundaries.
CORPUS = list(testing.PROMPTS) + [
    "A language model reads a sequence of tokens and predicts the next one.",
    "One, two, three, four, five, six, seven, eight, nine, ten.",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday are the days of the week.",
    "When it is small and random, its answers make no sense, but its numbers can still be checked.",
    "Some people drink tea with honey, others with nothing at all.",
]
CONTEXT = 16
VALUES = ["attention_output", "layer_output", "mlp_neurons"]


def corpus_file(folder) -> str:
    path = folder / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": text, "id": index}) + "\n" for index, text in enumerate(CORPUS)))
    return str(path)


def rows(folder) -> dict[str, torch.Tensor]:
    """Every shard's tensors, concatenated in shard order."""
    written = Activations(folder)
    shards = [written.shard(index) for index in range(len(written.shards))]
    return {key: torch.cat([shard[key] for shard in shards]) for key in shards[0]}


def file_bytes(folder) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.glob("shard-*.safetensors"))}


def assert_same_dataset(folder, other, subject) -> None:
    """The same rows of the same windows; values as `same_rows` holds a request's values computed in other batches."""
    got, want = rows(folder), rows(other)
    assert got.keys() == want.keys()
    for key in ("token_ids", "window", "position"):
        assert torch.equal(got[key], want[key]), key
    for key in got.keys() - {"token_ids", "window", "position"}:
        assert same_rows(got[key], want[key], subject), key


def stored_as(got: torch.Tensor, full: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``got`` is the float32 ``full`` rounded to ``dtype`` (within one rounding, and float32's bound on a GPU)."""
    scale = full.abs().amax(-1, keepdim=True).clamp(min=1.0)
    return got.dtype == dtype and bool(((got.float() - full).abs() <= full.abs() * torch.finfo(dtype).eps + 1e-4 * scale).all())


def engine_is_idle(model) -> bool:
    engine = model.vllm_entrypoint.llm_engine
    return not engine.has_unfinished_requests() and not any(engine.collective_rpc("nnsight_request_count"))  # each rank's


@pytest.fixture(scope="module")
def full_run(subject, tmp_path_factory):
    """One complete run in float32, three windows a shard, the reference the other tests compare with."""
    folder = tmp_path_factory.mktemp("full") / "acts"
    source = corpus_file(folder.parent)
    written = collect_dataset(
        subject.model, source, folder, VALUES, [0, -1], context_length=CONTEXT, dtype="float32", shard_tokens=3 * CONTEXT, progress=False
    )
    cut = list(windows(documents(source), subject.model.tokenizer, CONTEXT))
    return folder, source, written, cut


@on_tiny_llama
def test_shards_equal_transformers_and_collect(subject, full_run):
    folder, _, written, cut = full_run
    model, last = subject.model, subject.model.num_layers - 1
    assert len(cut) >= 7, "the corpus should make several shards"
    assert written.complete and len(written) == len(cut) * CONTEXT
    assert written.keys == [f"{value}.{layer}" for layer in (0, last) for value in VALUES]
    assert len(written.shards) == -(-len(cut) // 3) and not list(folder.glob("*.tmp"))
    manifest_mode = (folder / "manifest.json").stat().st_mode
    assert all(shard.stat().st_mode == manifest_mode for shard in written.shards), "shards are as readable as the manifest"
    got = rows(folder)
    assert got["token_ids"].tolist() == [token for window in cut for token in window]
    assert got["window"].tolist() == [index for index in range(len(cut)) for _ in range(CONTEXT)]
    assert got["position"].tolist() == list(range(CONTEXT)) * len(cut)
    assert all(window[0] == model.tokenizer.bos_token_id for window in cut)
    by_collect = collect(model, cut, VALUES, [0, last], batch_size=4)
    for index, value, layer, tensor in each_window_against_transformers(subject, got, cut, [0, last], "dataset"):
        assert tensor.dtype == torch.float32
        assert same_rows(tensor, by_collect[f"{value}.{layer}"][index][0], subject), (value, layer, index)
    assert engine_is_idle(model)


def each_window_against_transformers(subject, got: dict, cut: list, layers: list[int], label: str):
    """Each window's rows of each value at ``layers`` held to transformers' (the oracle's bound, recorded as ``label``);
    yields (window, value, layer, rows) for more checks."""
    for index, window in enumerate(cut):
        expected = oracle.reference(subject.reference, window, subject.layout)["values"]
        for value in VALUES:
            for layer in layers:
                tensor = got[f"{value}.{layer}"][index * CONTEXT : (index + 1) * CONTEXT]
                assert close(subject, f"{label}: {value}", tensor, expected[value][layer][0]), (value, layer, index)
                yield index, value, layer, tensor


@pytest.mark.parametrize("subject", ["Qwen2ForCausalLM-kv1-tp2"], indirect=True)
def test_shards_of_a_two_rank_engine_equal_transformers(subject, tmp_path):
    """Tensor parallelism (#51): a dataset collected on two ranks (heads and neurons split, the one key/value head
    copied on both) holds transformers' values, as one rank's does (`test_shards_equal_transformers_and_collect`)."""
    model, last = subject.model, subject.model.num_layers - 1
    source = corpus_file(tmp_path)
    written = collect_dataset(model, source, tmp_path / "acts", VALUES, [0, last], context_length=CONTEXT, dtype="float32",
                              progress=False)
    cut = list(windows(documents(source), model.tokenizer, CONTEXT))
    assert written.complete and len(written) == len(cut) * CONTEXT
    got = rows(tmp_path / "acts")
    assert got["token_ids"].tolist() == [token for window in cut for token in window]
    assert len(list(each_window_against_transformers(subject, got, cut, [0, last], "dataset on two ranks"))) == len(cut) * 6
    assert engine_is_idle(model)


@on_tiny_llama
def test_the_worker_counts_the_time_collections_take(subject, full_run):
    """`vlenvoys.worker.collector.stats`, for benchmarks: hooks and takes grow with a collection; the copies off the
    device are timed by CUDA events on a GPU engine only (a CPU engine copies in the hook, counted there)."""
    _, _, _, cut = full_run
    engine = subject.model.vllm_entrypoint.llm_engine
    (before,) = engine.collective_rpc("vlenvoys_collect_stats")
    collect(subject.model, cut[:4], ["layer_output"], [0])
    (after,) = engine.collective_rpc("vlenvoys_collect_stats")
    assert after["hook_seconds"] > before["hook_seconds"] and after["take_seconds"] > before["take_seconds"]
    assert (after["copy_seconds"] > before["copy_seconds"]) == (subject.device_type == "cuda")
    assert after["chunks"] >= 1 and after["made_bytes"] >= before["made_bytes"]


@on_tiny_llama
def test_positions_and_dtype(subject, full_run, tmp_path):
    folder, source, _, cut = full_run
    full, bos = rows(folder), subject.model.tokenizer.bos_token_id
    no_bos = collect_dataset(
        subject.model, source, tmp_path / "no_bos", "layer_output", [0], context_length=CONTEXT, positions="no_bos", progress=False
    )
    got, kept = rows(no_bos.folder), full["token_ids"] != bos
    assert kept.sum() < len(kept), "the corpus should hold BOS separators"
    assert torch.equal(got["token_ids"], full["token_ids"][kept])
    assert torch.equal(got["position"], full["position"][kept])
    assert stored_as(got["layer_output.0"], full["layer_output.0"][kept], torch.bfloat16)
    last = collect_dataset(
        subject.model, source, tmp_path / "last", "mlp_neurons", [0], context_length=CONTEXT, positions="last", dtype=torch.float16,
        max_tokens=4 * CONTEXT + 5, progress=False,
    )
    got, ends = rows(last.folder), full["position"] == CONTEXT - 1
    assert len(last) == 4 and got["window"].tolist() == [0, 1, 2, 3]
    assert stored_as(got["mlp_neurons.0"], full["mlp_neurons.0"][ends][:4], torch.float16)


@on_tiny_llama
def test_batches_add_extra_keys_to_the_values_and_refuse_keys_without_a_value(subject, full_run):
    """``keys`` chooses the values (replacing the default, every value); ``extra_keys`` adds beside them (#49)."""
    _, _, written, _ = full_run
    first = next(written.batches(4, extra_keys=["window", "position"]))
    assert first.keys() == {*written.keys, "token_ids", "window", "position"}
    chosen = next(written.batches(4, keys=["layer_output.0"], extra_keys="window"))
    assert chosen.keys() == {"layer_output.0", "token_ids", "window"}
    with pytest.raises(ValueError, match=r"keys=\['window'\] names no value.*extra_keys=\['window'\]"):
        next(written.batches(4, keys=["window"]))
    with pytest.raises(KeyError, match="not in this dataset"):
        next(written.batches(4, extra_keys=["layer_input.0"]))


@on_tiny_llama
def test_batches_give_each_row_once(subject, full_run):
    _, _, written, _ = full_run
    full = rows(written.folder)
    ordered = list(written.batches(10))
    assert [len(batch["token_ids"]) for batch in ordered[:-1]] == [10] * (len(ordered) - 1)
    assert torch.equal(torch.cat([batch["layer_output.0"] for batch in ordered]), full["layer_output.0"])
    shuffled = list(written.batches(7, keys=["layer_output.0"], shuffle=True, seed=3, buffer_shards=2))
    assert set(shuffled[0]) == {"layer_output.0", "token_ids"}
    together = torch.cat([batch["layer_output.0"] for batch in shuffled])
    assert not torch.equal(together, full["layer_output.0"])
    # The same rows, each as often: their distinct rows and counts agree.
    for mine, theirs in zip(torch.unique(together, dim=0, return_counts=True), torch.unique(full["layer_output.0"], dim=0, return_counts=True)):
        assert torch.equal(mine, theirs)
    again = torch.cat([batch["layer_output.0"] for batch in written.batches(7, keys=["layer_output.0"], shuffle=True, seed=3, buffer_shards=2)])
    assert torch.equal(again, together)  # seeded
    dropped = list(written.batches(7, drop_last=True))
    assert all(len(batch["token_ids"]) == 7 for batch in dropped) and len(dropped) == len(written) // 7
    with pytest.raises(KeyError, match="not in this dataset"):
        next(written.batches(4, keys=["layer_input.0"]))


@on_tiny_llama
def test_an_interrupted_run_continues_after_its_last_complete_shard(subject, full_run, tmp_path, monkeypatch):
    folder, source, _, cut = full_run
    out = tmp_path / "acts"
    from vlenvoys.collect import activations

    deliver, delivered = activations._Assembler.deliver, []

    def interrupted(self, windows):
        room = 5 - len(delivered)  # a shard of three written, the next half assembled
        delivered.extend(offset for offset, _ in windows[:room])
        deliver(self, windows[:room])
        if len(windows) > room:
            raise KeyboardInterrupt

    monkeypatch.setattr(activations._Assembler, "deliver", interrupted)
    arguments = dict(context_length=CONTEXT, dtype="float32", shard_tokens=3 * CONTEXT, progress=False)
    with pytest.raises(KeyboardInterrupt):
        collect_dataset(subject.model, source, out, VALUES, [0, -1], batch_size=2, **arguments)
    assert engine_is_idle(subject.model)
    partial = Activations(out)
    assert not partial.complete and len(partial.shards) == 1 and not list(out.glob("*.tmp"))
    before = {path.name: path.stat().st_mtime_ns for path in out.glob("shard-*.safetensors")}
    (out / ".tmpa1B2c3").write_bytes(b"what safetensors' save_file leaves of a shard when the process is killed")
    monkeypatch.setattr(activations._Assembler, "deliver", deliver)
    resumed = collect_dataset(subject.model, source, out, VALUES, [0, -1], **arguments)
    assert resumed.complete
    assert {name: (out / name).stat().st_mtime_ns for name in before} == before  # not written again
    assert_same_dataset(out, folder, subject)  # the same shards as the run never interrupted
    assert sorted(path.name for path in out.iterdir()) == ["manifest.json", *(shard["file"] for shard in resumed.manifest["shards"])]
    assert collect_dataset(subject.model, source, out, VALUES, [0, -1], **arguments).complete  # done: returned as it is


@on_tiny_llama
def test_a_larger_max_tokens_continues_a_run_and_a_changed_source_is_refused(subject, full_run, tmp_path):
    folder, source, _, cut = full_run
    out = tmp_path / "acts"
    arguments = dict(context_length=CONTEXT, dtype="float32", shard_tokens=3 * CONTEXT, progress=False)
    first = collect_dataset(subject.model, source, out, VALUES, [0, -1], max_tokens=4 * CONTEXT, **arguments)
    assert first.complete and len(first) == 4 * CONTEXT
    with pytest.raises(FileExistsError, match=rf"already holds 4 windows \({4 * CONTEXT} tokens\), more than max_tokens {2 * CONTEXT}"):
        collect_dataset(subject.model, source, out, VALUES, [0, -1], max_tokens=2 * CONTEXT, **arguments)
    written = file_bytes(out)
    assert len(collect_dataset(subject.model, source, out, VALUES, [0, -1], max_tokens=4 * CONTEXT, **arguments)) == 4 * CONTEXT
    assert file_bytes(out) == written  # the same limit: returned as it is
    more = collect_dataset(subject.model, source, out, VALUES, [0, -1], max_tokens=6 * CONTEXT, **arguments)
    assert more.complete and len(more) == 6 * CONTEXT
    assert file_bytes(out)["shard-00000.safetensors"] == written["shard-00000.safetensors"]  # a whole shard is kept
    # The shorter last shard (window 3) is collected again with windows 4 and 5: shards of 3 windows, as one run writes.
    assert [shard["windows"] for shard in more.manifest["shards"]] == [[0, 3], [3, 6]]
    everything = collect_dataset(subject.model, source, out, VALUES, [0, -1], **arguments)  # no limit: the rest of the source
    assert len(everything) == len(cut) * CONTEXT
    assert everything.manifest["shards"] == Activations(folder).manifest["shards"]
    assert_same_dataset(out, folder, subject)

    # Shards of a source that was edited since, or of another list of texts, are not continued.
    edited = tmp_path / "edited.jsonl"
    edited.write_text(Path(source).read_text())
    collect_dataset(subject.model, edited, tmp_path / "e", "layer_output", [0], max_tokens=3 * CONTEXT, **arguments)  # one whole shard
    lines = edited.read_text().splitlines()
    edited.write_text("\n".join([json.dumps({"text": "An edited first document."}), *lines[1:]]) + "\n")
    with pytest.raises(FileExistsError, match=r"the source changed since these shards were written \(window 0, in shard-00000"):
        collect_dataset(subject.model, edited, tmp_path / "e", "layer_output", [0], **arguments)
    collect_dataset(subject.model, CORPUS, tmp_path / "l", "layer_output", [0], max_tokens=3 * CONTEXT, **arguments)
    fewer = len(list(windows(CORPUS[:2], subject.model.tokenizer, CONTEXT)))
    assert fewer < 3
    with pytest.raises(FileExistsError, match=f"the source now makes {fewer} windows, fewer than the 3 these shards hold"):
        collect_dataset(subject.model, CORPUS[:2], tmp_path / "l", "layer_output", [0], **arguments)
    assert engine_is_idle(subject.model)


@on_tiny_llama
def test_a_full_disk_keeps_the_shards_before_and_a_rerun_continues(subject, full_run, tmp_path, monkeypatch):
    import safetensors.torch

    folder, source, _, _ = full_run
    out, save, calls = tmp_path / "acts", safetensors.torch.save_file, []

    def full_disk(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 3:
            with open(filename, "wb") as partial:
                partial.write(b"half a shard")
            raise OSError(errno.ENOSPC, "No space left on device")
        save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    arguments = dict(context_length=CONTEXT, dtype="float32", shard_tokens=3 * CONTEXT, progress=False)
    with pytest.raises(OSError, match=r"shard-00002.safetensors failed \(the disk is full\).*the 2 shards before it are complete") as raised:
        collect_dataset(subject.model, source, out, VALUES, [0, -1], **arguments)
    assert raised.value.errno == errno.ENOSPC
    assert engine_is_idle(subject.model)
    assert len(Activations(out).shards) == 2 and not list(out.glob("*.tmp"))
    monkeypatch.setattr(safetensors.torch, "save_file", save)
    assert collect_dataset(subject.model, source, out, VALUES, [0, -1], **arguments).complete
    assert_same_dataset(out, folder, subject)


@on_tiny_llama
def test_bad_inputs_are_refused_and_the_engine_goes_on(subject, full_run, tmp_path):
    folder, source, _, _ = full_run
    model = subject.model
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="fewer tokens than one window of 16"):
        collect_dataset(model, empty, tmp_path / "a", "layer_output", [0], context_length=CONTEXT, progress=False)
    with pytest.raises(ValueError, match=r"line 1 has no field 'body' \(it has \['id', 'text'\]\)"):
        collect_dataset(model, source, tmp_path / "b", "layer_output", [0], context_length=CONTEXT, field="body", progress=False)
    broken = tmp_path / "broken.jsonl"  # a bad record after some windows are on the engine: read ahead, raised in turn
    broken.write_text(Path(source).read_text() + '{"body": "no text here"}\n')
    with pytest.raises(ValueError, match=rf"line {len(CORPUS) + 1} has no field 'text'"):
        collect_dataset(model, broken, tmp_path / "i", "layer_output", [0], context_length=CONTEXT, shard_tokens=CONTEXT, progress=False)
    assert engine_is_idle(model)
    longest = model.vllm_entrypoint.llm_engine.vllm_config.model_config.max_model_len
    with pytest.raises(ValueError, match=f"longer than this engine serves: at most {longest - 1}"):
        collect_dataset(model, source, tmp_path / "c", "layer_output", [0], context_length=longest, progress=False)
    with pytest.raises(ValueError, match="dtype must be one of"):
        collect_dataset(model, source, tmp_path / "d", "layer_output", [0], context_length=CONTEXT, dtype="int8", progress=False)
    with pytest.raises(ValueError, match="positions must be one of"):
        collect_dataset(model, source, tmp_path / "e", "layer_output", [0], context_length=CONTEXT, positions="first", progress=False)
    with pytest.raises(ValueError, match="context_length must be at least 2, got 0"):
        collect_dataset(model, source, tmp_path / "z", "layer_output", [0], context_length=0, progress=False)
    with pytest.raises(ValueError, match=r"attention_probabilities: a pattern is \[1, heads, tokens, tokens\] per window"):
        collect_dataset(model, source, tmp_path / "p", ["layer_output", "attention_probabilities"], [0], context_length=CONTEXT, progress=False)
    with pytest.raises(ValueError, match="'no_such_value' is not a block value; choose from this model's: layer_input"):
        collect_dataset(model, source, tmp_path / "f", "no_such_value", [0], context_length=CONTEXT, progress=False)
    with pytest.raises(FileNotFoundError):
        collect_dataset(model, tmp_path / "missing.txt", tmp_path / "g", "layer_output", [0], context_length=CONTEXT, progress=False)
    assert not any((tmp_path / name).exists() for name in "abcdefgp")  # a refused run leaves no folder
    before = file_bytes(folder)
    with pytest.raises(FileExistsError, match=r"another run \(its setting -> this run's: layers: \[0, 2\] -> \[1\]"):
        collect_dataset(model, source, folder, VALUES, [1], context_length=CONTEXT, dtype="float32", shard_tokens=3 * CONTEXT, progress=False)
    assert file_bytes(folder) == before
    with pytest.raises(FileNotFoundError, match="not a folder collect_dataset wrote"):
        Activations(tmp_path)
    with pytest.raises(FileNotFoundError, match="nowhere does not exist"):
        Activations(tmp_path / "nowhere")
    shard_count = len(Activations(folder).shards)
    with pytest.raises(IndexError, match=rf"shard 99: this dataset has {shard_count} shards \(0 to {shard_count - 1}\)"):
        Activations(folder).shard(99)
    assert torch.equal(Activations(folder).shard(-1)["window"], rows(folder)["window"][-len(Activations(folder).shard(-1)["window"]) :])
    with pytest.raises(ValueError, match="buffer_shards must be a positive int, got 0"):
        next(Activations(folder).batches(4, shuffle=True, buffer_shards=0))
    assert torch.equal(Activations(folder).shard(numpy.int64(1))["window"], Activations(folder).shard(torch.tensor(1))["window"])
    for index in (True, "0", 1.0):
        with pytest.raises(TypeError, match="a shard index is an int"):
            Activations(folder).shard(index)
    assert next(Activations(folder).batches(4, keys="layer_output.0")).keys() == {"layer_output.0", "token_ids"}
    with pytest.raises(TypeError, match="seed must be an int, got 'x'"):
        next(Activations(folder).batches(4, shuffle=True, seed="x"))
    with pytest.raises(TypeError, match="max_tokens must be an int or None, got 1.5"):
        collect_dataset(model, source, tmp_path / "m", "layer_output", [0], context_length=CONTEXT, max_tokens=1.5, progress=False)
    with pytest.raises(TypeError, match="values must be a name or a list of names, got 5"):
        collect_dataset(model, source, tmp_path / "n", 5, [0], context_length=CONTEXT, progress=False)
    with pytest.raises(MemoryError, match="pass a smaller shard_tokens"):
        collect_dataset(model, source, tmp_path / "o", "layer_output", [0], context_length=CONTEXT, shard_tokens=2**60, progress=False)
    assert engine_is_idle(model) and not any((tmp_path / name).exists() for name in "mno")
    # A shard_tokens beyond the run's max_tokens takes the memory of the windows the run collects.
    capped = collect_dataset(model, source, tmp_path / "q", "layer_output", [0], context_length=CONTEXT, shard_tokens=2**60,
                             max_tokens=2 * CONTEXT, dtype="float32", progress=False)
    # The same windows in other batches: bit-identical on the CPU engine, within the bound on a GPU's batch-shaped kernels.
    assert same_rows(rows(capped.folder)["layer_output.0"], rows(folder)["layer_output.0"][: 2 * CONTEXT], subject)
    with pytest.raises(ValueError, match="is a folder of activation shards .collect_dataset's output., not a corpus"):
        collect_dataset(model, folder, tmp_path / "j", "layer_output", [0], context_length=CONTEXT, progress=False)
    (tmp_path / "plain-folder").mkdir()
    with pytest.raises(ValueError, match="is a folder but not one datasets' save_to_disk wrote"):
        collect_dataset(model, tmp_path / "plain-folder", tmp_path / "k", "layer_output", [0], context_length=CONTEXT, progress=False)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        next(Activations(folder).batches(0))
    assert not (tmp_path / "j").exists() and not (tmp_path / "k").exists()
    assert engine_is_idle(model)
    again = collect_dataset(model, CORPUS, tmp_path / "h", "layer_output", [0], context_length=CONTEXT, dtype="float32", progress=False)
    assert same_rows(rows(again.folder)["layer_output.0"], rows(folder)["layer_output.0"], subject)  # a list of strings: the same windows


@on_tiny_llama
def test_a_saved_dataset_is_a_source(subject, full_run, tmp_path):
    datasets = pytest.importorskip("datasets", reason="the datasets extra (vlenvoys-core[datasets]) is not installed")

    folder, _, _, _ = full_run
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": CORPUS}).save_to_disk(str(saved))
    got = collect_dataset(subject.model, saved, tmp_path / "acts", "layer_output", [0, -1], context_length=CONTEXT, dtype="float32", progress=False)
    for key in ("token_ids", "window", "position", "layer_output.0", "layer_output.2"):
        assert same_rows(rows(got.folder)[key], rows(folder)[key], subject), key
    # A DatasetDict's folder of one split reads as that split; of two, the user is asked to pick one.
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": CORPUS})}).save_to_disk(str(tmp_path / "dict"))
    assert list(documents(tmp_path / "dict")) == list(documents(saved)) == list(CORPUS)
    split = datasets.Dataset.from_dict({"text": CORPUS})
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(tmp_path / "two"))
    with pytest.raises(ValueError, match=r"holds the splits \['train', 'test'\]; pass one of them"):
        list(documents(tmp_path / "two"))


def packed(texts, tokenizer, context_length) -> list[list[int]]:
    """SAE training code's packing, written out: the tokenizer's own call, a BOS before each window and between documents."""
    bos, stream = tokenizer.bos_token_id, []
    for index, ids in enumerate(tokenizer(list(texts), add_special_tokens=False)["input_ids"]):
        stream += ([bos] if index else []) + ids
    body = context_length - 1
    return [[bos, *stream[start : start + body]] for start in range(0, len(stream) - body + 1, body)]


#: Texts a tokenizer may treat apart: special tokens' spellings, other scripts, runs of spaces and newlines.
AWKWARD = [
    "<|endoftext|> and <s> </s> <|im_start|>user\nhi<|im_end|> written as text",
    "Ünïcödé: 東京は日本の首都です。 Привет, мир! 😀👍",
    "   leading spaces, trailing ones   \n\n\ttabs\r\n",
    "",
    "x" * 300,
]


@pytest.mark.parametrize("which", ["tiny", "SmolLM2"])
def test_windows_hold_the_tokenizers_own_ids(which, tmp_path):
    """`windows` tokenizes with the fast tokenizer's Rust half alone (no Python dict per text, the GIL left to the
    thread driving the engine); its windows are the tokenizer's own call's, packed, on special tokens' spellings,
    other scripts and whitespace; a tokenizer whose call prepares text in Python is called as it is."""
    from transformers import AutoTokenizer

    from vlenvoys.collect.activations import CHECKED_TEXTS, _Tokenizing
    from vlenvoys.weights import WeightsUnavailable, smollm2_path

    if which == "tiny":
        folder = testing.tiny_model("LlamaForCausalLM", tmp_path / "model")
    else:
        try:
            folder = smollm2_path()
        except WeightsUnavailable as error:
            pytest.skip(str(error))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = CORPUS * 4 + AWKWARD  # the awkward ones after the texts the check tokenizes both ways
    assert sum(map(bool, CORPUS * 4)) >= CHECKED_TEXTS
    assert list(windows(texts, tokenizer, CONTEXT)) == packed(texts, tokenizer, CONTEXT)
    split = AutoTokenizer.from_pretrained(folder, split_special_tokens=True)
    assert list(windows(texts, split, CONTEXT)) == packed(texts, split, CONTEXT)
    for each in (tokenizer, split):
        tokenizing = _Tokenizing(each)
        assert tokenizing(texts) == each(texts, add_special_tokens=False)["input_ids"] and tokenizing.direct
        assert tokenizing(AWKWARD) == each(AWKWARD, add_special_tokens=False)["input_ids"]  # after the check

    class Lowercasing(type(tokenizer)):
        """Prepares each text in Python before its Rust tokenizer sees it."""

        def __call__(self, texts, **kwargs):
            return super().__call__([text.lower() for text in texts], **kwargs)

    lowercasing = Lowercasing.from_pretrained(folder)
    assert list(windows(texts, lowercasing, CONTEXT)) == packed(texts, lowercasing, CONTEXT)
    # Its class defines __call__ itself: called as it is from the start, even on texts the Rust tokenizer gets right.
    tokenizing = _Tokenizing(lowercasing)
    assert tokenizing.direct is False and tokenizing(["lower case"]) == lowercasing(["lower case"], add_special_tokens=False)["input_ids"]
    # A Rust tokenizer that differs on the checked texts (here: lowercasing them) is dropped for the call.
    from tokenizers import normalizers

    tokenizing = _Tokenizing(tokenizer)
    tokenizing.own.normalizer = normalizers.Lowercase()
    assert tokenizing(["A Capital", *texts]) == tokenizer(["A Capital", *texts], add_special_tokens=False)["input_ids"]
    assert tokenizing.direct is False
    # vLLM's wrappers only delegate: the engine's own tokenizer takes the Rust path.
    from vllm.tokenizers.hf import get_cached_tokenizer, maybe_make_thread_pool

    wrapped = maybe_make_thread_pool(get_cached_tokenizer(AutoTokenizer.from_pretrained(folder)))
    tokenizing = _Tokenizing(wrapped)
    assert tokenizing(texts) == tokenizer(texts, add_special_tokens=False)["input_ids"] and tokenizing.direct


def test_collect_command_writes_shards(tmp_path):
    """The CLI's windows mode on its own engine; a second run finds the collection complete without starting one."""
    model = testing.tiny_model("LlamaForCausalLM", tmp_path / "model")
    source = corpus_file(tmp_path)
    out = tmp_path / "acts"
    command = ["collect", source, str(model), "--context-length", str(CONTEXT), "--value", "layer_output,mlp_neurons", "--layers", "0,-1"]
    command += ["--out", str(out), "--shard-tokens", "64", "--max-tokens", "100", "--dtype", "float32", "--positions", "no_bos"]
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 0, result.output
    written = Activations(out)
    assert written.complete and written.keys == ["layer_output.0", "mlp_neurons.0", "layer_output.2", "mlp_neurons.2"]
    assert written.plan.context_length == CONTEXT and written.plan.positions == "no_bos"
    got = rows(out)
    assert sorted(set(got["window"].tolist())) == list(range(6))  # 100 tokens: six whole windows
    from transformers import AutoTokenizer

    reference = oracle.load_reference(model)
    window = list(windows(documents(source), AutoTokenizer.from_pretrained(model), CONTEXT))[1]
    expected = oracle.reference(reference, window)["values"]["layer_output"][2][0]
    mine = got["window"] == 1
    assert (got["layer_output.2"][mine] - expected[got["position"][mine].long()]).abs().max() <= 1e-4
    again = CliRunner().invoke(app, command)
    assert again.exit_code == 0 and "already holds this collection, complete" in " ".join(again.output.split())  # rich wraps lines
    other = CliRunner().invoke(app, command[:-2] + ["--positions", "last"])
    assert other.exit_code == 1 and "positions: 'no_bos' -> 'last'" in " ".join(other.output.split())
    whole = CliRunner().invoke(app, ["collect", source, str(model), "--context-length", "256", "--out", str(tmp_path / "whole")])
    assert whole.exit_code == 1 and "at most 255 (256 positions)" in " ".join(whole.output.split())  # before any engine
    pattern = CliRunner().invoke(app, command[:5] + ["--value", "attention_probabilities", "--out", str(tmp_path / "pattern")])
    assert pattern.exit_code == 1 and "a pattern is [1, heads, tokens, tokens] per window" in " ".join(pattern.output.split())
    assert "starting vLLM" not in pattern.output  # refused before any engine


@pytest.mark.parametrize("subject", ["MixtralForCausalLM"], indirect=True)
def test_chosen_experts_stay_integers_and_equal_collects(subject, tmp_path):
    """A mixture of experts' chosen experts (int64 indices) are stored as int64 whatever the dtype asked for
    (bfloat16 holds integers exactly only up to 256), the weights in that dtype; each window's rows, read back
    with their ``window`` and ``position``, are `collect`'s of the window's tokens."""
    values = ["mlp_router_experts", "mlp_router_weights"]
    written = collect_dataset(subject.model, corpus_file(tmp_path), tmp_path / "acts", values, [0], context_length=CONTEXT, progress=False)
    (got,) = written.batches(10**6, keys=[f"{value}.0" for value in values] + ["window", "position"])
    assert got["mlp_router_experts.0"].dtype == torch.int64 and got["mlp_router_weights.0"].dtype == torch.bfloat16
    first = got["window"] == 0
    assert torch.equal(got["position"][first], torch.arange(CONTEXT, dtype=torch.int32))
    want = collect(subject.model, [got["token_ids"][first].tolist()], values, [0])
    assert torch.equal(got["mlp_router_experts.0"][first], want["mlp_router_experts.0"][0][0].cpu())
    assert torch.equal(got["mlp_router_weights.0"][first], want["mlp_router_weights.0"][0][0].cpu().bfloat16())


@on_tiny_llama
def test_windows_finished_before_an_interrupt_are_written(subject, full_run, tmp_path, monkeypatch):
    """An interrupt keeps every window the progress bar counted as finished: those not yet taken are taken first.
    A new user's Ctrl-C, the bar at half of a corpus on the CPU engine, left no shard: values are taken once as many
    windows have finished as are in flight (256 there). Here 512 are in flight, more than a step computes, and the
    interrupt comes in the engine's third step."""
    from vlenvoys.collect import activations

    class Bar:
        tokens = 0

        def update(self, tokens):
            Bar.tokens += tokens

        def close(self):
            pass

    engine = subject.model.vllm_entrypoint.llm_engine
    step, steps = engine.step, []

    def interrupted():
        steps.append(None)
        if len(steps) == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(activations, "_progress_bar", lambda shown, total: Bar())
    monkeypatch.setattr(engine, "step", interrupted)
    out = tmp_path / "acts"
    arguments = dict(context_length=CONTEXT, dtype="float32", shard_tokens=CONTEXT, progress=True)
    with pytest.raises(KeyboardInterrupt):
        collect_dataset(subject.model, CORPUS * 40, out, ["layer_output"], [0], batch_size=512, **arguments)
    monkeypatch.undo()
    assert engine_is_idle(subject.model)
    finished = Bar.tokens // CONTEXT
    written = [shard["windows"] for shard in Activations(out).manifest["shards"]] if out.exists() else []
    assert finished and written == [[window, window + 1] for window in range(finished)], (finished, written[-3:])
