"""Activation datasets with other tools (#49 item 4): `Activations` as a torch ``IterableDataset``, a corpus streamed
with ``datasets.load_dataset`` (``"hf:NAME"``), and `export` to SAELens' cached activations, which SAELens trains on.

SAELens runs where it is installed (`nox -s "family(family='llama')"` installs it beside vLLM); elsewhere its test
skips, saying so. The export's own test needs only ``datasets`` (the ``datasets`` extra).
"""

from __future__ import annotations

import json

import pytest
import torch
import vlenvoys_testing as testing
from torch.utils.data import DataLoader, IterableDataset
from typer.testing import CliRunner
from vlenvoys.activations import Activations, collect_dataset, documents, export
from vlenvoys.cli import app
from vlenvoys.values.names import TRANSFORMER_LENS

on_tiny_llama = pytest.mark.parametrize("subject", ["LlamaForCausalLM"], indirect=True)

CORPUS = list(testing.PROMPTS) + [
    "A language model reads a sequence of tokens and predicts the next one.",
    "One, two, three, four, five, six, seven, eight, nine, ten.",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday are the days of the week.",
    "When it is small and random, its answers make no sense, but its numbers can still be checked.",
]
CONTEXT = 16
VALUES = ["attention_head_outputs", "layer_output", "mlp_neurons"]
SAE_LENS_MISSING = "sae-lens is not installed here (the llama family's nox session installs it beside vLLM: nox -s family)"


def needs_datasets():
    return pytest.importorskip("datasets", reason="the datasets extra (vlenvoys-core[datasets]) is not installed")


def everything(folder) -> dict[str, torch.Tensor]:
    """Every row of a folder, in order, with its window and position."""
    written = Activations(folder)
    (rows,) = written.batches(10**9, keys=[*written.keys, "window", "position"])
    return rows


@pytest.fixture(scope="module")
def acts(subject, tmp_path_factory):
    """Three values of block 1 of the corpus, float32, three windows a shard."""
    folder = tmp_path_factory.mktemp("interop") / "acts"
    return collect_dataset(
        subject.model, CORPUS, folder, VALUES, [1], context_length=CONTEXT, dtype="float32", shard_tokens=3 * CONTEXT, progress=False
    )


@on_tiny_llama
def test_activations_is_an_iterable_dataset_of_rows_or_batches(subject, acts):
    """Iterated, a folder gives its rows one by one (a DataLoader batches them) or, with batch_size, the batches
    `batches` gives; a DataLoader's workers share the shards, so each row comes once; set_epoch reshuffles."""
    full = everything(acts.folder)
    count = len(full["token_ids"])
    assert len(acts.shards) >= 3 and count == len(acts)
    assert isinstance(acts, IterableDataset)
    rows = list(acts)  # the dataset collect_dataset returns: rows, in order
    assert len(rows) == count and set(rows[0]) == {*acts.keys, "token_ids"}
    assert rows[0]["layer_output.1"].shape == (128,) and rows[0]["attention_head_outputs.1"].shape == (4, 32)
    assert torch.equal(torch.stack([row["layer_output.1"] for row in rows]), full["layer_output.1"])
    assert torch.equal(torch.stack([row["token_ids"] for row in rows]), full["token_ids"])

    assert len(list(Activations(acts.folder, keys="layer_output.1", drop_last=True))) == count  # rows: every one
    stacked = list(DataLoader(Activations(acts.folder, keys="layer_output.1"), batch_size=7))
    assert set(stacked[0]) == {"layer_output.1", "token_ids"} and stacked[0]["layer_output.1"].shape == (7, 128)
    assert torch.equal(torch.cat([batch["layer_output.1"] for batch in stacked]), full["layer_output.1"])

    batched = Activations(acts.folder, batch_size=10, keys=["mlp_neurons.1", "window"])
    assert len(batched) == -(-count // 10) and len(Activations(acts.folder, batch_size=10, drop_last=True)) == count // 10
    ordered = list(batched)
    assert len(ordered) == len(batched) and set(ordered[0]) == {"mlp_neurons.1", "window", "token_ids"}
    assert torch.equal(torch.cat([batch["mlp_neurons.1"] for batch in ordered]), full["mlp_neurons.1"])

    # Two worker processes: every row once, whichever worker read its shard.
    shuffled = Activations(acts.folder, batch_size=10, shuffle=True, seed=5, keys=["layer_output.1", "window", "position"])
    loaded = list(DataLoader(shuffled, batch_size=None, num_workers=2))
    places = torch.cat([batch["window"] * CONTEXT + batch["position"] for batch in loaded])
    assert sorted(places.tolist()) == list(range(count))
    order = torch.argsort(places)
    assert torch.equal(torch.cat([batch["layer_output.1"] for batch in loaded])[order], full["layer_output.1"])
    in_one = torch.cat([batch["window"] * CONTEXT + batch["position"] for batch in shuffled])
    assert sorted(in_one.tolist()) == list(range(count)) and not torch.equal(in_one, torch.arange(count))
    assert torch.equal(torch.cat([batch["window"] * CONTEXT + batch["position"] for batch in shuffled]), in_one)  # seeded
    shuffled.set_epoch(1)
    again = torch.cat([batch["window"] * CONTEXT + batch["position"] for batch in shuffled])
    assert sorted(again.tolist()) == list(range(count)) and not torch.equal(again, in_one)
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        Activations(acts.folder, batch_size=0)
    with pytest.raises(KeyError, match="not in this dataset"):
        Activations(acts.folder, keys=["layer_output.0"])
    with pytest.raises(TypeError, match="seed must be an int"):
        Activations(acts.folder, shuffle=True, seed="x")
    with pytest.raises(ValueError, match="epoch must be a non-negative int"):
        shuffled.set_epoch(-1)


@on_tiny_llama
def test_a_streamed_dataset_is_a_source(subject, acts, tmp_path):
    """``"hf:NAME"`` is ``datasets.load_dataset(NAME, streaming=True)``: here a local folder laid out as a hub
    dataset's (CI has no hub). Its windows and values are those of the same texts given as a list."""
    datasets = needs_datasets()
    folder = tmp_path / "corpus"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "train.jsonl").write_text("".join(json.dumps({"body": text, "id": index}) + "\n" for index, text in enumerate(CORPUS)))
    (folder / "data" / "test.jsonl").write_text(json.dumps({"body": "A held-out document."}) + "\n")
    named = f"hf:{folder}"
    assert list(documents(named, "body", split="train")) == CORPUS
    assert list(documents(named, "body", split="test")) == ["A held-out document."]
    with pytest.raises(ValueError, match=r"holds the splits \['train', 'test'\]; pass one of them"):
        list(documents(named, "body"))
    with pytest.raises(ValueError, match=r"has no split 'validation'; it holds \['train', 'test'\]"):
        list(documents(named, "body", split="validation"))
    with pytest.raises(ValueError, match="row 0 of hf:.* has no field 'text'"):
        list(documents(named, split="train"))
    both = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": CORPUS}), "test": datasets.Dataset.from_dict({"body": ["x"]})})
    assert list(documents(both, "body", split="train")) == CORPUS  # a DatasetDict in memory too
    with pytest.raises(FileNotFoundError, match="a Hugging Face dataset is named hf:NAME"):
        list(documents(tmp_path / "missing.jsonl"))
    # The command takes --split and --subset, and refuses a split the source lacks before it starts an engine.
    checkpoint = str(subject.model.vllm_entrypoint.llm_engine.vllm_config.model_config.model)
    command = ["collect", named, checkpoint, "--context-length", str(CONTEXT), "--field", "body", "--out", str(tmp_path / "cli")]
    refused = CliRunner().invoke(app, [*command, "--split", "validation"])
    assert refused.exit_code == 1 and "has no split 'validation'" in " ".join(refused.output.split())
    assert "starting vLLM" not in refused.output and not (tmp_path / "cli").exists()

    streamed = collect_dataset(
        subject.model, named, tmp_path / "acts", VALUES, [1], context_length=CONTEXT, field="body", split="train",
        dtype="float32", shard_tokens=3 * CONTEXT, progress=False,
    )
    assert streamed.plan.source == f"{named} (split train)"
    got, want = everything(streamed.folder), everything(acts.folder)
    for key in want:
        assert torch.equal(got[key], want[key]), key  # the same windows in the same batches: bit for bit on the CPU
    # Continued, the run is the same plan; another split is another plan.
    assert collect_dataset(subject.model, named, tmp_path / "acts", VALUES, [1], context_length=CONTEXT, field="body", split="train",
                           dtype="float32", shard_tokens=3 * CONTEXT, progress=False).complete
    with pytest.raises(FileExistsError, match=r"source: .*\(split train\)' -> .*\(split test\)'"):
        collect_dataset(subject.model, named, tmp_path / "acts", VALUES, [1], context_length=CONTEXT, field="body", split="test",
                        dtype="float32", shard_tokens=3 * CONTEXT, progress=False)


@on_tiny_llama
def test_export_writes_sae_lens_cached_activations(subject, acts, tmp_path):
    """A `datasets` dataset saved to disk: a row per window, a column per value named by its TransformerLens hook
    (`context_length` rows of the value's width, heads flattened), and the window's token ids."""
    datasets = needs_datasets()
    out = export(acts.folder, tmp_path / "sae")
    saved = datasets.load_from_disk(str(out))
    full = everything(acts.folder)
    windows = len(acts) // CONTEXT
    hooks = {"attention_head_outputs.1": "blocks.1.attn.hook_z", "layer_output.1": "blocks.1.hook_resid_post",
             "mlp_neurons.1": "blocks.1.mlp.hook_post"}
    assert sorted(saved.column_names) == sorted([*hooks.values(), "token_ids"]) and len(saved) == windows
    assert saved.features["token_ids"] == datasets.Sequence(datasets.Value("int32"), length=CONTEXT)
    assert saved.features["blocks.1.hook_resid_post"] == datasets.Array2D(shape=(CONTEXT, 128), dtype="float32")
    assert saved.features["blocks.1.attn.hook_z"].shape == (CONTEXT, 4 * 32)
    table = saved.with_format("torch")[:]
    for key, column in hooks.items():
        assert torch.equal(table[column].reshape(len(acts), -1), full[key].reshape(len(acts), -1)), key
    assert torch.equal(table["token_ids"].reshape(-1).int(), full["token_ids"])
    described = json.loads(saved.info.description)
    assert described["columns"] == hooks and described["plan"]["context_length"] == CONTEXT

    half = export(Activations(acts.folder), tmp_path / "half", keys="layer_output.1", dtype="float16", shuffle=True, seed=1)
    assert datasets.load_from_disk(str(half)).column_names == ["blocks.1.hook_resid_post", "token_ids"]
    assert datasets.load_from_disk(str(half)).features["blocks.1.hook_resid_post"].dtype == "float16"
    shuffled = datasets.load_from_disk(str(half)).with_format("torch")[:]
    firsts = full["token_ids"].reshape(windows, CONTEXT)
    order = [next(index for index in range(windows) if torch.equal(firsts[index], row.int())) for row in shuffled["token_ids"]]
    assert sorted(order) == list(range(windows)) and order != list(range(windows))
    want = full["layer_output.1"].reshape(windows, CONTEXT, -1)[order].half()
    assert torch.equal(shuffled["blocks.1.hook_resid_post"].half(), want)  # (read back as float32, torch's formatter's default)

    renamed = export(acts.folder, tmp_path / "named", keys=["layer_output.1"], names={"layer_output.1": "resid"})
    assert datasets.load_from_disk(str(renamed)).column_names == ["resid", "token_ids"]

    with pytest.raises(FileExistsError, match="is not an empty folder"):
        export(acts.folder, out)
    with pytest.raises(ValueError, match="format must be one of sae_lens"):
        export(acts.folder, tmp_path / "x", format="parquet")
    with pytest.raises(ValueError, match="Arrow has no bfloat16"):
        export(acts.folder, tmp_path / "x", dtype="bfloat16")
    with pytest.raises(KeyError, match="not in this dataset"):
        export(acts.folder, tmp_path / "x", keys=["layer_output.0"])
    norms = collect_dataset(subject.model, CORPUS, tmp_path / "norms", "mlp_norm_output", [0], context_length=CONTEXT, max_tokens=2 * CONTEXT,
                            progress=False)
    with pytest.raises(ValueError, match=r"mlp_norm_output.0 \(TransformerLens has no hook holding mlp_norm_output: .*pass a column name"):
        export(norms.folder, tmp_path / "x")
    assert TRANSFORMER_LENS["mlp_norm_output"] is None
    no_bos = collect_dataset(subject.model, CORPUS, tmp_path / "no_bos", "layer_output", [0], context_length=CONTEXT, positions="no_bos",
                             max_tokens=2 * CONTEXT, progress=False)
    with pytest.raises(ValueError, match="keeps positions='no_bos': its windows keep different numbers of rows"):
        export(no_bos.folder, tmp_path / "x")
    last = collect_dataset(subject.model, CORPUS, tmp_path / "last", "layer_output", [0], context_length=CONTEXT, positions="last",
                           max_tokens=4 * CONTEXT, progress=False)
    assert datasets.load_from_disk(str(export(last.folder, tmp_path / "last-sae"))).features["blocks.0.hook_resid_post"].shape == (1, 128)
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".*.shards"))


@on_tiny_llama
def test_sae_lens_trains_on_an_export(subject, acts, tmp_path):
    """SAELens' own ActivationsStore reads the export as a cache it wrote (``cached_activations_path``), and its
    SAETrainer trains a standard SAE on it, configured as its runner configures one."""
    pytest.importorskip("sae_lens", reason=SAE_LENS_MISSING)
    from sae_lens import (
        LanguageModelSAERunnerConfig,
        LoggingConfig,
        SAETrainer,
        StandardTrainingSAE,
        StandardTrainingSAEConfig,
    )
    from sae_lens.training.activations_store import ActivationsStore

    out = export(acts.folder, tmp_path / "sae")
    config = LanguageModelSAERunnerConfig(
        sae=StandardTrainingSAEConfig(d_in=128, d_sae=256), model_name="tiny-llama", hook_name="blocks.1.hook_resid_post",
        dataset_path="unused: the activations are cached", context_size=CONTEXT, use_cached_activations=True,
        cached_activations_path=str(out), training_tokens=20 * 8, train_batch_size_tokens=8, store_batch_size_prompts=2,
        n_batches_in_buffer=2, device="cpu", dtype="float32", logger=LoggingConfig(log_to_wandb=False), n_batches_for_norm_estimate=2,
    )
    store = ActivationsStore(
        model=None, dataset=None, streaming=False, hook_name=config.hook_name, hook_head_index=None, context_size=config.context_size,
        d_in=config.sae.d_in, n_batches_in_buffer=config.n_batches_in_buffer, total_training_tokens=config.training_tokens,
        store_batch_size_prompts=config.store_batch_size_prompts, train_batch_size_tokens=config.train_batch_size_tokens,
        prepend_bos=config.prepend_bos, normalize_activations=config.sae.normalize_activations, device=torch.device("cpu"),
        dtype=config.dtype, cached_activations_path=config.cached_activations_path,
    )
    full = everything(acts.folder)
    cached = store.cached_activation_dataset[:]
    assert torch.equal(cached["blocks.1.hook_resid_post"].reshape(-1, 128), full["layer_output.1"])
    assert torch.equal(cached["token_ids"].reshape(-1).long(), full["token_ids"].long())
    batch = next(store)
    assert batch.shape == (8, 128)
    assert all((full["layer_output.1"] == row).all(-1).any() for row in batch), "the store's rows are ours"

    sae = StandardTrainingSAE(config.sae)
    before = sae.W_enc.detach().clone()
    trainer = SAETrainer(cfg=config.to_sae_trainer_config(), sae=sae, data_provider=store)
    trained = trainer.fit()
    assert trainer.n_training_steps == 20 and trainer.n_training_samples == 160
    assert torch.isfinite(trained.W_enc).all() and not torch.equal(trained.W_enc.detach(), before)
