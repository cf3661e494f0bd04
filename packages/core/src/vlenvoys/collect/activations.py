"""Activation datasets: standard values of a text corpus, streamed to disk in shards.

Training a sparse autoencoder, a transcoder or a probe takes the values of
millions of tokens: more than memory holds, collected over hours. This module
cuts a corpus into fixed windows of tokens, reads the chosen values of every
window with `vlenvoys.collect`'s fast path (one hook per module per step),
and writes them to a folder of shards as they leave the engine::

    import vlenvoys
    from vlenvoys.activations import collect_dataset

    model = vlenvoys.load()
    shards = collect_dataset(model, "corpus.jsonl", "acts", "layer_output", [10], context_length=128)
    for batch in shards.batches(4096, shuffle=True):
        batch["layer_output.10"]      # [4096, hidden_size]

The folder holds ``shard-00000.safetensors``, ... and ``manifest.json``.
Shards are safetensors files rather than Arrow tables: Arrow has no bfloat16,
the dtype activations are usually kept in, and a safetensors file maps
straight into a torch tensor without a copy. Each shard holds, for the N
tokens kept from its windows:

- ``"{value}.{layer}"``: ``[N, ...]`` the value at each token, in the chosen
  dtype (``[N, hidden_size]`` for the streams, ``[N, heads, head_dim]`` for
  the heads, ``[N, intermediate_size]`` for the neurons);
- ``"token_ids"``: ``[N]`` int32, the token at each row;
- ``"window"``: ``[N]`` int64, the window each row comes from (counting the
  run's windows from 0);
- ``"position"``: ``[N]`` int32, the row's position in its window;

and in its metadata the run's plan (model, values, layers, dtype, windows).
A shard is written under a temporary name and renamed when complete, and the
manifest lists a shard only after that, so a run killed at any point leaves
only complete shards behind; run the same call again and it continues after
the last one.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import itertools
import json
import operator
import os
import queue
import random
import sys
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..engine.handover import InThread, Rows, read_rows
from ..engine.requests import check_engine, shared_call_path
from ..values.support import support
from ..wire.shm import row_bytes
from .prompts import checked_reads, progress_bar, scheduled_at_once, stream

__all__ = ["POSITIONS", "Activations", "Plan", "collect_dataset", "documents", "windows"]

#: Which positions of each window are kept: every one, every one but the BOS tokens, or the last.
POSITIONS = ("all", "no_bos", "last")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MANIFEST = "manifest.json"
#: What every shard holds of each row beside the values: its token, its window and its position in that window.
ROW_KEYS = ("token_ids", "window", "position")
FORMAT = "vlenvoys-activations/1"
#: How a corpus names a dataset `documents` streams with ``datasets.load_dataset``: ``"hf:NAME"``.
HUB = "hf:"
#: Documents tokenized per call of the tokenizer (a fast tokenizer batches them across threads).
TOKENIZED_AT_ONCE = 256
#: Non-empty texts tokenized both by the tokenizer and by its Rust tokenizer alone before the second is trusted (`_Tokenizing`).
CHECKED_TEXTS = 32
#: The interpreter's switch interval while a dataset is collected, in seconds (Python's default: 0.005).
#: A thread that gives the GIL up (a torch call, a read, a wait on the engine) waits up to this long to
#: have it back while another thread runs Python, and four threads share it here (measured on an H200
#: at 6ec2ebb, when windows were copied with torch calls: 0.49-0.77 of plain prefill with it, 0.49 without).
SWITCH_INTERVAL = 1e-4
#: Rows read at a time when `Activations` is iterated row by row.
ROWS_AT_ONCE = 4096


def documents(source: Any, field: str = "text", *, split: str | None = None, subset: str | None = None) -> Iterator[str]:
    """The documents of a corpus, one string each, read lazily.

    Args:
        source: A text file (``.txt`` and any other suffix not below: one
            document per non-empty line), a JSON Lines file (``.jsonl``:
            one object per line, the document under ``field``), a file
            ``datasets`` reads (``.parquet``, ``.csv``, ``.arrow``), a folder
            written by ``datasets.Dataset.save_to_disk``, a ``datasets``
            dataset (or iterable dataset), ``"hf:NAME"`` (a Hugging Face
            dataset, streamed: see below), or any iterable of strings.
        field: The column or key holding the text (JSON Lines and ``datasets`` sources).
        split: The split to read of a source with several (``"train"``; a
            ``"hf:"`` dataset, a ``DatasetDict`` or its ``save_to_disk`` folder).
            None reads the only one there is.
        subset: A ``"hf:"`` dataset's subset (its configuration, ``load_dataset``'s ``name``).

    ``"hf:NAME"`` is read by ``datasets.load_dataset(NAME, name=subset,
    streaming=True)``, then its ``split`` (or its only one): the rows are
    streamed as they are read, never downloaded whole. NAME is a dataset on the Hugging Face hub
    (``"hf:HuggingFaceFW/fineweb-edu"`` with ``subset="sample-10BT"``), or
    any path ``load_dataset`` takes, such as a local folder of ``.jsonl``,
    ``.parquet`` or ``.csv`` files laid out as a hub dataset's. A path that
    exists is always read as that file or folder, even one named ``hf:...``.

    Raises:
        FileNotFoundError: no such file or folder.
        ValueError: a record without ``field`` (named by its line or row),
            a text that is not a string, a JSON line that does not parse, a
            source with several splits and no ``split``, or a split it does not have.
        ImportError: a ``datasets`` source without the ``datasets`` package.
    """
    if isinstance(source, (str, os.PathLike)):
        path, named = Path(source), os.fspath(source)
        if _hub(source):
            yield from _records(_streamed(named[len(HUB) :], split, subset), field, named)
            return
        if not path.exists():
            raise FileNotFoundError(f"no such file or folder: {path} (a Hugging Face dataset is named {HUB}NAME)")
        if path.is_dir():
            yield from _records(_load_from_disk(path, split), field, path)
        elif path.suffix == ".jsonl":
            yield from _json_lines(path, field)
        elif path.suffix in {".parquet", ".csv", ".arrow"}:
            yield from _records(_datasets().load_dataset(path.suffix[1:], data_files=str(path), split="train"), field, path)
        else:
            with path.open(encoding="utf-8") as lines:
                yield from (line.rstrip("\n") for line in lines if line.strip())
    elif hasattr(source, "column_names") or hasattr(source, "features"):
        yield from _records(_one_split(source, split, "the dataset"), field, "the dataset")
    else:
        for index, text in enumerate(source):
            if not isinstance(text, str):
                raise ValueError(f"document {index} is a {type(text).__name__}, not a string")
            yield text


def _streamed(name: str, split: str | None, subset: str | None) -> Any:
    """``load_dataset(name, name=subset, streaming=True)``'s ``split`` (or its only one): its rows, streamed."""
    if not name:
        raise ValueError(f"{HUB!r} names no dataset; write {HUB}NAME (a hub dataset, or a folder load_dataset reads)")
    datasets = _datasets()
    loaded = datasets.load_dataset(name, name=subset, streaming=True)
    return _one_split(loaded, split, f"{HUB}{name}")


def _one_split(loaded: Any, split: str | None, where: Any) -> Any:
    """``split`` of a dataset dict (the only one there is without ``split``); a dataset as it is, unless ``split`` names another."""
    if not isinstance(loaded, dict):  # DatasetDict and IterableDatasetDict are dicts of their splits
        if split is not None and getattr(loaded, "split", None) not in (None, split):
            raise ValueError(f"{where} holds the split {loaded.split!r}, not {split!r}")
        return loaded
    splits = list(loaded.keys())
    if split is None:
        if len(splits) != 1:
            raise ValueError(f"{where} holds the splits {splits}; pass one of them (split=, --split)")
        split = splits[0]
    if split not in loaded:
        raise ValueError(f"{where} has no split {split!r}; it holds {splits}")
    return loaded[split]


def _datasets() -> Any:
    try:
        import datasets
    except ImportError as error:
        raise ImportError("this source is read with the `datasets` package: pip install datasets") from error
    return datasets


def _load_from_disk(path: Path, split: str | None = None) -> Any:
    if (path / MANIFEST).exists():
        raise ValueError(f"{path} is a folder of activation shards (collect_dataset's output), not a corpus")
    # A Dataset's folder holds state.json, a DatasetDict's dataset_dict.json: any other folder is refused
    # whether or not `datasets` is installed.
    written = [name for name in ("state.json", "dataset_dict.json") if (path / name).exists()]
    datasets = _datasets() if written else None
    try:
        if datasets is None:
            raise FileNotFoundError("it has neither state.json nor dataset_dict.json")
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as error:
        raise ValueError(
            f"{path} is a folder but not one datasets' save_to_disk wrote ({error}); a corpus is a text, .jsonl, "
            ".parquet or .csv file, or such a folder"
        ) from None
    return _one_split(loaded, split, path)


def _records(rows: Iterable[dict], field: str, where: Any) -> Iterator[str]:
    for index, row in enumerate(rows):
        if field not in row:
            raise ValueError(f"row {index} of {where} has no field {field!r} (it has {sorted(row)}); pick one with field= (--field)")
        text = row[field]
        if not isinstance(text, str):
            raise ValueError(f"row {index} of {where}: {field!r} holds a {type(text).__name__}, not a string")
        yield text


def _json_lines(path: Path, field: str) -> Iterator[str]:
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path} line {number} is not JSON: {error}") from None
            if not isinstance(row, dict) or field not in row:
                keys = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise ValueError(f"{path} line {number} has no field {field!r} (it has {keys}); pick one with field= (--field)")
            if not isinstance(row[field], str):
                raise ValueError(f"{path} line {number}: {field!r} holds a {type(row[field]).__name__}, not a string")
            yield row[field]


def windows(texts: Iterable[str], tokenizer: Any, context_length: int, *, bos: bool = True) -> Iterator[list[int]]:
    """Token windows of ``context_length`` ids, packed from ``texts`` as SAE training code packs them.

    The documents are tokenized without special tokens and concatenated, each
    after the first preceded by a separator (the BOS token, or EOS where the
    tokenizer has no BOS); the stream is cut into windows, each starting with
    BOS when ``bos`` (then ``context_length - 1`` tokens of the stream follow it).
    A last window shorter than ``context_length`` is dropped, as SAE training
    code drops it, so every window has the same length.

    Raises:
        ValueError: ``context_length`` below 2 with ``bos`` (or below 1), or
            ``bos`` on a tokenizer with neither a BOS nor an EOS token.
    """
    begin = _begin_token(tokenizer)
    if bos and begin is None:
        raise ValueError("this tokenizer has neither a BOS nor an EOS token; pass bos=False")
    if context_length < (2 if bos else 1):
        raise ValueError(f"context_length must be at least {2 if bos else 1}, got {context_length}")
    separator = begin
    body = context_length - 1 if bos else context_length
    stream: list[int] = []
    first = True
    texts = iter(texts)
    tokenize = _Tokenizing(tokenizer)
    while chunk := list(itertools.islice(texts, TOKENIZED_AT_ONCE)):
        for ids in tokenize(chunk):
            if not first and separator is not None:
                stream.append(separator)
            first = False
            stream.extend(ids)
        cut = len(stream) - len(stream) % body
        for start in range(0, cut, body):
            yield ([begin] if bos else []) + stream[start : start + body]
        del stream[:cut]


class _Tokenizing:
    """Texts to their token ids without special tokens: ``tokenizer``'s call, made cheaper where it gives the same ids.

    A fast tokenizer's call is its Rust tokenizer's ``encode_batch`` and then,
    in Python, a dict of lists per text (attention masks, ...): on the thread
    that tokenizes ahead, that holds the GIL the engine-driving thread needs.
    A private copy of the Rust tokenizer, set as the call sets it (no
    truncation, no padding, special tokens split as ``split_special_tokens``
    says), gives the same ids with the GIL held only to make each text's
    list. It is used only where the tokenizer's call path is transformers'
    shared code (`vlenvoys.engine.requests.shared_call_path`: no subclass prepares text in Python)
    and the Rust tokenizer copies (a custom Python pre-tokenizer does not);
    the first `CHECKED_TEXTS` non-empty texts are also tokenized both ways,
    and a difference there calls the tokenizer as it is from then on.
    ``direct``: whether the copy is used (None while the check goes on).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.direct: bool | None = None
        self.checked = 0  # non-empty texts tokenized both ways, the same
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or not hasattr(backend, "encode_batch_fast") or not shared_call_path(tokenizer):
            self.direct = False
            return
        try:
            self.own = copy.deepcopy(backend)  # its settings are its own: the tokenizer's stay as they were
        except Exception:  # a custom Python component does not pickle, and so does not copy
            self.direct = False
            return
        self.own.no_truncation()
        self.own.no_padding()
        self.own.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))

    def called(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]

    def rust(self, texts: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self.own.encode_batch_fast(texts, add_special_tokens=False)]

    def __call__(self, texts: list[str]) -> list[list[int]]:
        if self.direct is False:
            return self.called(texts)
        ids = self.rust(texts)
        if self.direct is None:
            count, end = 0, 0  # the texts checked now: those up to the last non-empty one still wanted
            for end, text in enumerate(texts, start=1):
                count += bool(text)
                if self.checked + count >= CHECKED_TEXTS:
                    break
            if ids[:end] != self.called(texts[:end]):
                self.direct = False
                return self.called(texts)
            self.checked += count
            self.direct = True if self.checked >= CHECKED_TEXTS else None
        return ids


def _begin_token(tokenizer: Any) -> int | None:
    """The token that starts a window and separates documents: BOS, or EOS where there is none."""
    return tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id


@dataclass(frozen=True)
class Plan:
    """What a run collects: a folder holds one plan's shards, and a rerun continues only the same plan."""

    model: str
    values: list[str]
    layers: list[int]
    context_length: int
    bos: bool
    dtype: str
    positions: str
    source: str
    field: str
    shard_windows: int

    def differences(self, other: dict) -> list[str]:
        """``"name: theirs -> ours"`` for each setting that differs from a manifest's plan."""
        ours = asdict(self)
        return [f"{key}: {other.get(key)!r} -> {value!r}" for key, value in ours.items() if other.get(key) != value]


def _describe(source: Any, split: str | None = None, subset: str | None = None) -> str:
    """How the plan names a source: a path as given (absolute), an ``"hf:"`` name as given, else what kind of
    object it is; then its subset and split where they were given."""
    if isinstance(source, (str, os.PathLike)) and not _hub(source):
        named = str(Path(source).absolute())
    elif isinstance(source, (str, os.PathLike)):
        named = os.fspath(source)
    else:
        named = f"<{type(source).__name__}>"
    return named + (f" (subset {subset})" if subset is not None else "") + (f" (split {split})" if split is not None else "")


def _hub(source: Any) -> bool:
    """Whether ``source`` names a dataset `documents` streams (``"hf:NAME"``, no such file or folder)."""
    return isinstance(source, (str, os.PathLike)) and os.fspath(source).startswith(HUB) and not Path(source).exists()


class _Shards:
    """The output folder: its manifest, and shards written whole (temporary name, then rename)."""

    def __init__(self, folder: Path, plan: Plan, limit: int | None) -> None:
        self.folder, self.plan, self.limit = folder, plan, limit
        self.manifest = folder / MANIFEST
        self.done: list[dict] = []
        self.complete = False
        #: The window limit of the run that wrote the manifest (None: the whole source; absent before it was kept).
        self.limit_before: int | None = None

    def open(self) -> None:
        """Check the folder against the plan; take over a previous run of the same plan.

        Raises:
            FileExistsError: another run's shards are there (a different plan,
                or shards without a manifest), or ``folder`` is a file.
        """
        if self.folder.exists() and not self.folder.is_dir():
            raise FileExistsError(f"{self.folder} is a file; collect_dataset writes a folder of shards")
        if not self.folder.exists():
            return  # made with the first shard: a run refused before it leaves nothing behind
        # A shard or manifest a killed run left half-written: ours end in .tmp; safetensors' save_file writes
        # through a temporary file of its own first (Rust's tempfile: ".tmp" and six characters).
        for stale in [*self.folder.glob("*.tmp"), *self.folder.glob(".tmp??????")]:
            if stale.is_file():
                stale.unlink()
        if self.manifest.exists():
            manifest = json.loads(self.manifest.read_text())
            differences = self.plan.differences(manifest.get("plan", {}))
            if manifest.get("format") != FORMAT or differences:
                raise FileExistsError(
                    f"{self.folder} holds the shards of another run (its setting -> this run's: "
                    f"{'; '.join(differences) or manifest.get('format')}); write to a new folder, or remove this one to start over"
                )
            self.done, self.complete = manifest["shards"], manifest["complete"]
            self.limit_before = manifest.get("max_windows")
            for shard in self.done:
                if not (self.folder / shard["file"]).exists():
                    raise FileExistsError(f"{self.folder}: the manifest lists {shard['file']}, which is missing; remove the folder to start over")
        elif any(self.folder.glob("shard-*.safetensors")):
            raise FileExistsError(f"{self.folder} holds shards but no {MANIFEST}; write to a new folder, or empty this one")

    @property
    def windows_done(self) -> int:
        return self.done[-1]["windows"][1] if self.done else 0

    def stopped_at_limit(self) -> bool:
        """Whether a complete run ended at its own ``max_tokens`` rather than at the source's end, below this run's limit."""
        done = self.windows_done
        return self.limit_before is not None and done == self.limit_before and (self.limit is None or self.limit > done)

    def drop_short_last(self) -> None:
        """Forget a last shard shorter than the plan's (a run's end), to collect its windows again with those after.

        The folder then has the shards a run to the larger limit would have written.
        """
        if self.done and self.done[-1]["windows"][1] - self.done[-1]["windows"][0] < self.plan.shard_windows:
            last = self.done.pop()
            self._write_manifest(self.done)  # the manifest stops listing it before the file goes
            (self.folder / last["file"]).unlink(missing_ok=True)

    def check_unchanged(self, cut: Iterator[list[int]]) -> None:
        """Draw the windows the shards already hold from ``cut``, each checked against the tokens the shards recorded.

        Reading a shard's token ids, windows and positions costs little beside
        tokenizing its windows again, which skipping them takes anyway.

        Raises:
            FileExistsError: the source now makes other windows (edited, shortened, another list of texts).
        """
        from safetensors import safe_open

        for shard in self.done:
            first, last = shard["windows"]
            drawn = list(itertools.islice(cut, last - first))
            if len(drawn) < last - first:
                raise FileExistsError(
                    f"{self.folder}: the source now makes {first + len(drawn)} windows, fewer than the {last} these shards "
                    "hold; it changed since they were written: write to a new folder, or remove this one to start over"
                )
            with safe_open(str(self.folder / shard["file"]), framework="pt") as stored:
                ids, window, position = (stored.get_tensor(key).numpy() for key in ROW_KEYS)
            expected = numpy.array(drawn, dtype=numpy.int32)[window - first, position]
            if not numpy.array_equal(expected, ids):
                changed = int(window[numpy.argmax(expected != ids)])
                raise FileExistsError(
                    f"{self.folder}: the source changed since these shards were written (window {changed}, in "
                    f"{shard['file']}, now holds other tokens); write to a new folder, or remove this one to start over"
                )

    def write(self, tensors: dict[str, torch.Tensor], first: int, last: int) -> None:
        """Shard number ``len(done)``: windows ``first`` to ``last - 1``, then the manifest that lists it."""
        name = f"shard-{len(self.done):05d}.safetensors"
        self.folder.mkdir(parents=True, exist_ok=True)
        metadata = {"plan": json.dumps(asdict(self.plan)), "windows": json.dumps([first, last]), "format": FORMAT}
        target = self.folder / name
        try:
            save_readable(tensors, str(target) + ".tmp", metadata)
            os.replace(str(target) + ".tmp", target)
            shard = {"file": name, "windows": [first, last], "tokens": int(tensors["token_ids"].shape[0])}
            self._write_manifest(self.done + [shard])
            self.done.append(shard)  # complete only once the manifest lists it
        except OSError as error:
            Path(str(target) + ".tmp").unlink(missing_ok=True)
            full = " (the disk is full)" if error.errno == errno.ENOSPC else ""
            raise OSError(
                error.errno,
                f"writing {name} failed{full}: {error.strerror or error}; the {len(self.done)} shards before it are "
                f"complete in {self.folder}: free the space and run the same collection again to continue after them",
            ) from error

    def finish(self) -> None:
        self.complete = True
        self._write_manifest(self.done)

    def _write_manifest(self, done: list[dict]) -> None:
        manifest = {
            "format": FORMAT,
            "plan": asdict(self.plan),
            "complete": self.complete,
            "max_windows": self.limit,
            "tokens": sum(shard["tokens"] for shard in done),
            "shards": done,
        }
        temporary = self.manifest.with_suffix(".json.tmp")
        temporary.write_text(json.dumps(manifest, indent=1))
        os.replace(temporary, self.manifest)


def open_shards(out: str | os.PathLike, plan: Plan, max_tokens: int | None) -> _Shards:
    """The output folder checked against a run's plan and ``max_tokens``; ``complete`` when nothing is left to collect.

    A complete run that stopped at a smaller ``max_tokens`` than this one is
    reopened, to collect the windows after it. The CLI calls this before it
    starts an engine.

    Raises:
        FileExistsError: as `_Shards.open`, or the folder holds more windows than ``max_tokens`` allows.
        ValueError: ``max_tokens`` less than one window.
    """
    limit = window_limit(max_tokens, plan.context_length)
    shards = _Shards(Path(out), plan, limit)
    shards.open()
    if limit is not None and shards.windows_done > limit:
        raise FileExistsError(
            f"{out} already holds {shards.windows_done} windows ({shards.windows_done * plan.context_length} tokens), "
            f"more than max_tokens {max_tokens} allows; read fewer rows of it (Activations), or write to a new folder"
        )
    if shards.complete and shards.stopped_at_limit():
        shards.complete = False
        shards.drop_short_last()
    return shards


def _new_file_mode() -> int:
    """The mode ``open`` gives a new file here: 0666 less the process's umask (read, not set: threads share it)."""
    try:
        with open("/proc/self/status") as status:
            mask = next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = 0o022
    return 0o666 & ~mask


class _Ahead:
    """An iterator drawn on a thread of its own, up to ``depth`` chunks of ``chunk`` items ahead of its reader.

    The corpus is read and tokenized (the fast tokenizer runs without the GIL)
    while the client drives the engine; an error reaches the reader at the item
    where it happened. `close` stops the thread early.
    """

    def __init__(self, items: Iterable, depth: int = 4, chunk: int = 64) -> None:
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._work, args=(iter(items), chunk), name="vlenvoys-windows", daemon=True)
        self.thread.start()

    def _put(self, item: Any) -> bool:
        while not self.stopped.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _work(self, items: Iterator, chunk: int) -> None:
        try:
            while batch := list(itertools.islice(items, chunk)):
                if not self._put(batch):
                    return
            self._put(None)
        except BaseException as error:
            self._put(error)

    def __iter__(self) -> Iterator:
        while True:
            got = self.queue.get()
            if got is None:
                return
            if isinstance(got, BaseException):
                raise got
            yield from got

    def close(self) -> None:
        self.stopped.set()
        self.thread.join()


class _Writer(InThread):
    """Writes shards on a thread of its own, one behind the engine: the forward goes on while a shard is written."""

    def __init__(self, shards: _Shards) -> None:
        self.shards = shards
        #: Shards' value tensors written and free to fill again: memory the system has already given
        #: (a new shard-sized tensor costs a page fault and a zeroed page per 4 KiB at its first write).
        self.free: queue.SimpleQueue = queue.SimpleQueue()
        # One shard waiting at most: memory stays flat.
        super().__init__(self._write, depth=1, name="vlenvoys-shard-writer")

    def _write(self, tensors: dict, first: int, last: int, buffers: dict[str, torch.Tensor]) -> None:
        try:
            self.shards.write(tensors, first, last)
        finally:
            self.free.put(buffers)

    def put(self, tensors: dict, first: int, last: int, buffers: dict[str, torch.Tensor]) -> None:
        """Write ``tensors`` (views of ``buffers``, which are free to reuse once written) as windows ``first`` to ``last - 1``."""
        self(tensors, first, last, buffers)

    def buffers(self, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
        """Tensors of these shapes and dtypes for a shard: a written shard's where they match, else new ones."""
        while True:
            try:
                free = self.free.get_nowait()
            except queue.Empty:
                try:
                    return {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in shapes.items()}
                except RuntimeError as error:  # torch's allocator: "[enforce fail at alloc_cpu.cpp] ... can't allocate"
                    size = sum(row_bytes(shape, dtype) for shape, dtype in shapes.values())
                    raise MemoryError(
                        f"a shard of {self.shards.plan.shard_windows} windows takes {size / 2**30:.1f} GiB of memory, "
                        f"which this machine cannot give ({error}); pass a smaller shard_tokens"
                    ) from None
            if {key: (tuple(tensor.shape), tensor.dtype) for key, tensor in free.items()} == shapes:
                return free


class _Assembler:
    """Windows' values in window order, cut into shards of ``shard_windows`` windows each.

    Each window's kept rows are read once, from the engine's files straight
    into their place in the shard's tensors (`read_rows`; rows of another
    dtype are read, then converted): the place is known when the window is
    drawn, from the rows the windows before it in the shard keep. It runs on
    a thread beside the one driving the engine, so it makes few torch calls
    (each gives the GIL up and waits for it again): a shard's token ids and
    positions are built as Python lists.
    """

    def __init__(self, plan: Plan, first_window: int, writer: _Writer, begin: int | None, limit: int | None = None) -> None:
        self.plan, self.writer, self.begin, self.limit = plan, writer, begin, limit
        self.dtype = DTYPES[plan.dtype]
        self.start = first_window  # the first window of the shard being assembled
        self.first = first_window  # the run's first window: the stream counts its prompts from here
        #: Per window drawn and not yet written: (token ids, kept runs of positions [start, stop), first row in its shard).
        self.placed: dict[int, tuple[list[int], list[tuple[int, int]], int]] = {}
        self.rows_in: dict[int, int] = {}  # shard start window -> rows placed so far
        self.buffers: dict[int, dict[str, torch.Tensor]] = {}  # shard start window -> its value tensors
        self.bytes: dict[int, dict[str, memoryview]] = {}  # shard start window -> its value tensors' bytes
        self.arrived: set[int] = set()

    def register(self, window: int, ids: list[int]) -> list[int]:
        """A window drawn from the corpus: where its rows go. Returns ``ids`` (for the stream)."""
        runs = self._kept(ids)
        shard = window - (window - self.first) % self.plan.shard_windows
        row = self.rows_in.get(shard, 0)
        self.rows_in[shard] = row + sum(stop - start for start, stop in runs)
        self.placed[window] = (ids, runs, row)
        return ids

    def deliver(self, windows: list[tuple[int, dict[str, torch.Tensor | Rows]]]) -> None:
        """Windows' values in, each ``(offset, values)`` (the stream's ``offset``-th prompt); every shard now whole out to the writer.

        A value is a ``[1, tokens, ...]`` tensor, or `Rows` not yet read (`stream`'s ``unread``): those in
        the stored dtype are read from the engine's files straight into the shard (`read_rows`), the others
        read together into one tensor per value, then converted into the shard with one copy (a read and a
        copy per window cost the CPU engine's client 0.4 ms a window, float32 into bfloat16). A value of an
        integer dtype is stored in its own.
        """
        unread, targets, sources = [], [], []
        converted: dict[str, list] = {}  # key -> (rows, runs, shard tensor, first row) read, then converted
        for offset, values in windows:
            window = self.first + offset
            _, runs, row = self.placed[window]
            shard = window - (window - self.first) % self.plan.shard_windows
            if shard not in self.buffers:
                # The rows a shard keeps at most: its windows, no more than the run's limit leaves.
                count = self.plan.shard_windows if self.limit is None else min(self.plan.shard_windows, self.limit - shard)
                most = count * self.plan.context_length
                # Values of an integer dtype (a mixture of experts' chosen experts) stay in it: bfloat16 holds
                # integers exactly only up to 256.
                shapes = {
                    key: ((most, *_row_shape(value)), self.dtype if value.dtype.is_floating_point else value.dtype)
                    for key, value in values.items()
                }
                buffers = self.buffers[shard] = self.writer.buffers(shapes)
                self.bytes[shard] = {key: memoryview(buffer.view(-1).view(torch.uint8).numpy()) for key, buffer in buffers.items()}
            buffers = self.buffers[shard]
            for key, value in values.items():
                if isinstance(value, Rows) and value.dtype == buffers[key].dtype:
                    unread.append((value, runs, self.bytes[shard][key], row))
                    continue
                if isinstance(value, Rows):
                    converted.setdefault(key, []).append((value, runs, buffers[key], row))
                    continue
                at = row
                for start, stop in runs:
                    targets.append(buffers[key][at : at + stop - start])
                    sources.append(value[0, start:stop])
                    at += stop - start
        read_rows(unread)
        for waiting in converted.values():
            first = waiting[0][0]
            kept = [sum(stop - start for start, stop in runs) for _, runs, _, _ in waiting]
            read = torch.empty((sum(kept), *first.shape), dtype=first.dtype)  # a value's rows share shape and dtype
            flat, starts = memoryview(read.view(-1).view(torch.uint8).numpy()), itertools.accumulate(kept, initial=0)
            read_rows([(rows, runs, flat, start) for (rows, runs, _, _), start in zip(waiting, starts)])
            at = 0
            for (_, _, buffer, row), count in zip(waiting, kept):
                targets.append(buffer[row : row + count])  # a window's kept rows lie back to back in its shard
                sources.append(read[at : at + count])
                at += count
        if targets:
            torch._foreach_copy_(targets, sources)
        del unread, targets, sources
        self.arrived.update(self.first + offset for offset, _ in windows)
        while all(index in self.arrived for index in range(self.start, self.start + self.plan.shard_windows)):
            self._flush(self.start + self.plan.shard_windows)

    def _kept(self, ids: list[int]) -> list[tuple[int, int]]:
        """The positions kept of a window, as runs ``(start, stop)``."""
        if self.plan.positions == "last":
            return [(len(ids) - 1, len(ids))]
        if self.plan.positions == "no_bos" and self.begin is not None:
            runs, start = [], None
            for position, token in enumerate(ids):
                if token == self.begin and start is not None:
                    runs.append((start, position))
                    start = None
                elif token != self.begin and start is None:
                    start = position
            return runs if start is None else [*runs, (start, len(ids))]
        return [(0, len(ids))]

    def _flush(self, end: int) -> None:
        windows = range(self.start, end)
        placed = [self.placed.pop(index) for index in windows]
        self.arrived.difference_update(windows)
        rows = self.rows_in.pop(self.start)
        buffers = self.buffers.pop(self.start)
        del self.bytes[self.start]
        shard = {key: buffer[:rows] for key, buffer in buffers.items()}
        # Built with numpy from the kept runs, the ids read once from their lists: this runs beside the
        # engine-driving thread and holds the GIL throughout (a tensor per window cost a second per 1e6
        # tokens on an H200's host, and Python lists of every position and window 10 us a window on the CPU).
        pieces = [(index, start, stop) for index, (_, runs, _) in zip(windows, placed) for start, stop in runs]
        table = numpy.array(pieces, dtype=numpy.int64).reshape(-1, 3)  # window, start, stop
        lengths = table[:, 2] - table[:, 1]
        ids = itertools.chain.from_iterable(tokens[start:stop] for tokens, runs, _ in placed for start, stop in runs)
        shard["token_ids"] = torch.from_numpy(numpy.fromiter(ids, dtype=numpy.int32, count=rows))
        # A row's position: its start's, plus how far into its run it lies.
        offsets = numpy.repeat(numpy.cumsum(lengths) - lengths - table[:, 1], lengths)
        shard["position"] = torch.from_numpy((numpy.arange(rows) - offsets).astype(numpy.int32))
        shard["window"] = torch.from_numpy(numpy.repeat(table[:, 0], lengths))
        self.writer.put(shard, self.start, end, buffers)
        self.start = end

    def finish(self) -> None:
        """The last, shorter shard: the windows left after the last full one."""
        if self.arrived:
            self._flush(self.start + len(self.arrived))


def collect_dataset(
    model: Any,
    source: Any,
    out: str | os.PathLike,
    values: str | Sequence[str],
    layers: int | Sequence[int],
    *,
    context_length: int,
    field: str = "text",
    split: str | None = None,
    subset: str | None = None,
    bos: bool = True,
    dtype: str | torch.dtype = "bfloat16",
    positions: str = "all",
    shard_tokens: int = 2**16,
    max_tokens: int | None = None,
    batch_size: int | None = None,
    progress: bool = True,
) -> Activations:
    """Collect block values of a corpus, window by window, into a folder of shards.

    The corpus (`documents`) is packed into windows (`windows`); every window
    is one request of the engine, read as `vlenvoys.collect` reads it (the
    prefill's values, at every position, equal to a trace's reads of the same
    window). Values are written as they leave the engine: the client holds at
    most the windows in flight and two shards, the engine only the windows in
    flight, however long the corpus; a thread writes each shard while the
    engine runs the next windows.

    Rerun the same call after an interruption (an error, Ctrl-C, a killed
    process) and it continues after the last complete shard: the windows are
    cut again from the source, those already written are checked against the
    shards' token ids and skipped. A folder whose run completed is returned as
    it is, without reading the source again, unless that run stopped at a
    smaller ``max_tokens``: a larger one collects the windows after it (its
    last, shorter shard again with them, so the shards are those one run to
    the larger limit writes).

    Args:
        model: A model from `vlenvoys.load` on the synchronous engine.
        source: A corpus, as `documents` reads it.
        out: The folder of shards (created if missing).
        values: A block value name (``"layer_output"``, ``"mlp_neurons"``, ...) or several.
        layers: A block index or several (negative ones count from the end).
        context_length: Tokens per window, BOS included; at most the engine's ``max_model_len`` - 1
            (each window's request generates one token).
        field: The text's key in a JSON Lines or ``datasets`` source.
        split: The split to read of a source with several (see `documents`; None: the only one).
        subset: An ``"hf:NAME"`` source's subset (its configuration; see `documents`).
        bos: Start each window with the BOS token (see `windows`).
        dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"`` (or the torch dtype): how the values are stored.
        positions: ``"all"``, ``"no_bos"`` (drop every BOS token, window
            starts and document separators) or ``"last"`` (the last token of each window).
        shard_tokens: Tokens of windows per shard (rounded down to whole windows, at least one).
        max_tokens: Stop after this many tokens of windows (rounded down to whole windows).
        batch_size: Windows in flight on the engine (default: its ``max_num_seqs``).
        progress: Show a progress bar (tokens, tokens/s, and the time left where the total is known), as
            `vlenvoys.collect`'s ``progress=True`` (on by default here: a corpus takes long).

    Returns:
        The folder's `Activations`.

    Raises:
        ValueError: ``context_length`` longer than the engine serves, an
            unknown ``dtype`` or ``positions``, a corpus too short for one
            window, an attention pattern (not a row per token), or what
            `documents` and `vlenvoys.collect` raise for their inputs
            (`NoSuchBlock` for a block that does not exist).
        TypeError: ``values`` not a name or a list of names, ``layers``,
            ``context_length``, ``shard_tokens`` or ``max_tokens`` not ints.
        Unavailable: a value this model cannot serve (``vlenvoys.support``).
        MemoryError: one shard's values do not fit in memory (``shard_tokens`` too large).
        FileExistsError: ``out`` holds another run's shards (a different
            plan), more windows than ``max_tokens`` allows, or shards of
            windows the source no longer makes (it changed).
        OSError: a shard could not be written (a full disk): the shards
            before it stay complete, and the same call continues after them.
    """
    check_engine(model)
    longest = int(model.vllm_entrypoint.llm_engine.vllm_config.model_config.max_model_len)
    if isinstance(context_length, int) and context_length >= longest:
        # Each window is a request of one generated token: prompt and token must fit in max_model_len.
        raise ValueError(
            f"context_length {context_length} is longer than this engine serves: at most {longest - 1} "
            f"(max_model_len {longest}, less the one token each window's request generates)"
        )
    names = _names(values, "values")
    reads = checked_reads(model, names, layers)
    check_rows_per_token(model, names)
    plan = make_plan(
        str(model.vllm_entrypoint.llm_engine.vllm_config.model_config.model),
        names,
        [layer for layer, _, _ in reads],
        context_length=context_length,
        bos=bos,
        dtype=dtype,
        positions=positions,
        source=source,
        field=field,
        shard_tokens=shard_tokens,
        split=split,
        subset=subset,
    )
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be a positive int or None, got {batch_size!r}")
    shards = open_shards(out, plan, max_tokens)
    limit = shards.limit
    if shards.complete:
        return Activations(out)

    tokenizer = model.tokenizer
    cut = windows(documents(source, field, split=split, subset=subset), tokenizer, context_length, bos=bos)
    shards.check_unchanged(cut)
    cut = itertools.islice(cut, None if limit is None else limit - shards.windows_done)
    first = next(cut, None)
    if first is None:
        if shards.done:  # the last run ended after its last shard, before it said so
            shards.finish()
            return Activations(out)
        raise ValueError(f"{_describe(source, split, subset)} holds fewer tokens than one window of {context_length}")
    start = shards.windows_done

    total = None if limit is None else (limit - start) * context_length
    if total is None and isinstance(source, (str, os.PathLike)) and not _hub(source) and Path(source).is_file():
        total = _count_windows(source, field, tokenizer, context_length, bos, start) * context_length
    writer = _Writer(shards)
    assembler = _Assembler(plan, start, writer, _begin_token(tokenizer), limit)
    bar = _progress_bar(progress, total)
    in_flight = batch_size or scheduled_at_once(model)
    # Three threads beside the client's, which only drives the engine: the corpus is tokenized
    # ahead, each take of windows' values is read into their shard (`stream`'s), and each whole shard is written.
    ahead = _Ahead(cut)
    try:
        with _switching_every(SWITCH_INTERVAL):
            stream(
                model,
                itertools.starmap(assembler.register, enumerate(itertools.chain([first], ahead), start=start)),
                reads,
                assembler.deliver,
                batch_size=in_flight,
                progress=(lambda finished: bar.update(finished * context_length)) if bar is not None else None,
                unread=True,
                together=True,
            )
            assembler.finish()
            writer.close()
    except BaseException:
        writer.stop()  # the values already out of the engine are in their shards: those whole are written before the error goes up
        raise
    finally:
        ahead.close()
        if bar is not None:
            bar.close()
    shards.finish()
    return Activations(out)


def _names(given: Any, label: str) -> list[str]:
    """A name or a sequence of names, as a list; TypeError naming ``label`` otherwise."""
    if isinstance(given, str):
        return [given]
    if isinstance(given, Sequence) and all(isinstance(name, str) for name in given):
        return list(given)
    raise TypeError(f"{label} must be a name or a list of names, got {given!r}")


def check_rows_per_token(model: Any, names: list[str]) -> None:
    """ValueError for a value that is not a row per token (an attention pattern: ``[1, heads, tokens, tokens]`` a window)."""
    patterns = sorted({row.value for row in support(model) if row.value in names and row.layout == "Pattern"})
    if patterns:
        raise ValueError(
            f"{', '.join(patterns)}: a pattern is [1, heads, tokens, tokens] per window, not a row per token, and a shard "
            "holds rows per token; read patterns with vlenvoys.collect or a trace"
        )


def save_readable(tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str]) -> None:
    """safetensors' ``save_file``, the file then given the mode a new file gets here (safetensors makes it 0600)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, _new_file_mode())


def _row_shape(value: torch.Tensor | Rows) -> tuple[int, ...]:
    """One token's row of a value: `Rows`' own shape, or a ``[1, tokens, ...]`` tensor's after its first two axes."""
    return value.shape if isinstance(value, Rows) else tuple(value.shape[2:])


@contextlib.contextmanager
def _switching_every(interval: float) -> Iterator[None]:
    """The interpreter's switch interval set to ``interval`` seconds for the block (see `SWITCH_INTERVAL`)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def make_plan(
    model: str,
    values: Sequence[str],
    layers: Sequence[int],
    *,
    context_length: int,
    bos: bool,
    dtype: str | torch.dtype,
    positions: str,
    source: Any,
    field: str,
    shard_tokens: int,
    split: str | None = None,
    subset: str | None = None,
) -> Plan:
    """The plan of a run, its settings checked (``layers`` non-negative); the CLI makes it before any engine starts.

    Raises:
        ValueError: an unknown ``dtype`` or ``positions``, ``shard_tokens`` below 1,
            ``context_length`` below 2 with ``bos`` (or below 1).
        TypeError: ``context_length`` or ``shard_tokens`` not an int.
    """
    name = dtype if isinstance(dtype, str) else next((key for key, each in DTYPES.items() if each == dtype), None)
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if positions not in POSITIONS:
        raise ValueError(f"positions must be one of {', '.join(POSITIONS)}, got {positions!r}")
    for label, number in (("context_length", context_length), ("shard_tokens", shard_tokens)):
        if not _is_int(number):
            raise TypeError(f"{label} must be an int, got {number!r}")
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be at least 1, got {shard_tokens}")
    if context_length < (2 if bos else 1):  # as `windows` says it, before anything divides by it
        raise ValueError(f"context_length must be at least {2 if bos else 1}, got {context_length}")
    return Plan(
        model=str(Path(model).absolute()) if Path(model).exists() else model,  # a local checkpoint, wherever the run starts
        values=sorted(set(values)),
        layers=sorted(set(layers)),
        context_length=context_length,
        bos=bos,
        dtype=name,
        positions=positions,
        source=_describe(source, split, subset),
        field=field,
        shard_windows=max(1, shard_tokens // context_length),
    )


def _is_int(number: Any) -> bool:
    """An int, and not a bool (which Python counts as one: ``max_tokens=True`` is a mistake, not 1)."""
    return isinstance(number, int) and not isinstance(number, bool)


def window_limit(max_tokens: int | None, context_length: int) -> int | None:
    """How many windows ``max_tokens`` allows (None: all of them)."""
    if max_tokens is None:
        return None
    if not _is_int(max_tokens):
        raise TypeError(f"max_tokens must be an int or None, got {max_tokens!r}")
    if max_tokens < context_length:
        raise ValueError(f"max_tokens {max_tokens} is less than one window of {context_length} tokens")
    return max_tokens // context_length


def _count_windows(source: Any, field: str, tokenizer: Any, context_length: int, bos: bool, skipped: int) -> int:
    """How many windows a file source makes (one pass of the tokenizer), for the progress bar's time left."""
    return max(0, sum(1 for _ in windows(documents(source, field), tokenizer, context_length, bos=bos)) - skipped)


def _progress_bar(shown: bool, total: int | None) -> Any:
    return progress_bar(total, "tok", unit_scale=True, smoothing=0.1) if shown else None


class Activations(IterableDataset):
    """A folder of activation shards written by `collect_dataset`, read back; a torch ``IterableDataset``.

    ``len(activations)`` is the number of rows (tokens kept) over every
    shard; `keys` the value tensors' names (``"layer_output.10"``, ...);
    `shard` one shard's tensors; `batches` rows in batches,
    shuffled or in order, for training.

    Iterated (``for row in activations``, or a ``torch.utils.data.DataLoader``),
    it gives what the options below ask `batches` for: one row at a time,
    ``{key: [...]}`` for each of ``keys`` and ``token_ids`` (a DataLoader
    stacks them into batches), or whole batches with ``batch_size`` (then
    ``len`` is the number of batches, and a DataLoader takes them as they
    are with ``batch_size=None``). In a DataLoader's worker processes each
    worker reads its share of the shards (shard ``i`` goes to worker ``i %
    num_workers``, after the shards are shuffled), so every row comes once;
    each worker's last batch may then be short. With ``shuffle``, call
    `set_epoch` before each epoch to shuffle it differently::

        data = Activations("acts", batch_size=4096, shuffle=True, keys=["layer_output.10"])
        loader = torch.utils.data.DataLoader(data, batch_size=None, num_workers=2)
        for epoch in range(3):
            data.set_epoch(epoch)
            for batch in loader:
                batch["layer_output.10"]      # [4096, hidden_size]

    Args:
        folder: The folder `collect_dataset` wrote.
        batch_size: Iterating gives batches of this many rows; None (the default)
            gives every row, one at a time.
        keys: What iterating gives of each row, as `batches` takes them.
        extra_keys: Added beside ``keys`` (``window``, ``position``), as `batches` takes them.
        shuffle: Iterate in a random order, as `batches` shuffles.
        seed: The shuffle's seed (with the epoch `set_epoch` set).
        buffer_shards: Shards whose rows are mixed together when shuffled, as `batches` takes it.
        drop_last: Leave out a last batch shorter than ``batch_size`` (rows: changes nothing).

    Raises:
        FileNotFoundError: no such folder, or one without a manifest.
        ValueError, TypeError, KeyError: options `batches` refuses.
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        *,
        batch_size: int | None = None,
        keys: str | Sequence[str] | None = None,
        extra_keys: str | Sequence[str] = (),
        shuffle: bool = False,
        seed: int = 0,
        buffer_shards: int = 4,
        drop_last: bool = False,
    ) -> None:
        self.folder = Path(folder)
        manifest = self.folder / MANIFEST
        if not self.folder.is_dir():
            raise FileNotFoundError(f"{self.folder} is not a folder" if self.folder.exists() else f"{self.folder} does not exist")
        if not manifest.exists():
            raise FileNotFoundError(f"{self.folder} holds no {MANIFEST}: it is not a folder collect_dataset wrote")
        self.manifest: dict = json.loads(manifest.read_text())
        self.plan = Plan(**self.manifest["plan"])
        if batch_size is not None:
            _check_positive(batch_size, "batch_size")
        self.batch_size = batch_size
        self.options = {"keys": self._wanted(keys, extra_keys), "shuffle": shuffle, "seed": seed, "buffer_shards": buffer_shards, "drop_last": drop_last}
        _check_positive(buffer_shards, "buffer_shards")
        self._check_seed(seed)
        #: The epoch `set_epoch` set: shuffled runs draw their order from the seed and it.
        self.epoch = 0

    def __len__(self) -> int:
        """The rows over every shard; with ``batch_size``, the batches iterating gives (in one process)."""
        rows = int(self.manifest["tokens"])
        if self.batch_size is None:
            return rows
        return rows // self.batch_size if self.options["drop_last"] else -(-rows // self.batch_size)

    def __repr__(self) -> str:
        state = "complete" if self.complete else "incomplete"
        return f"Activations({str(self.folder)!r}: {int(self.manifest['tokens'])} tokens in {len(self.manifest['shards'])} shards, {state}, {self.keys})"

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """Rows, or batches of ``batch_size``, as the options ask; in a DataLoader's worker, that worker's share."""
        worker = get_worker_info()
        share = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        options = {**self.options, "seed": self._epoch_seed()}
        if self.batch_size is not None:
            yield from self._batches(self.batch_size, share=share, **options)
            return
        for batch in self._batches(ROWS_AT_ONCE, share=share, **{**options, "drop_last": False}):  # every row
            count = batch["token_ids"].shape[0]
            for index in range(count):
                yield {key: tensor[index] for key, tensor in batch.items()}

    def set_epoch(self, epoch: int) -> None:
        """Shuffle the next iterations as epoch ``epoch`` (a shuffled dataset's order depends on ``seed`` and it)."""
        if not _is_int(epoch) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        self.epoch = epoch

    def _epoch_seed(self) -> int:
        seed = self.options["seed"]
        if self.epoch == 0:
            return seed  # epoch 0 is the seed's own order, as `batches` gives it
        return int(numpy.random.SeedSequence([seed % 2**63, self.epoch]).generate_state(1, numpy.uint64)[0] % 2**63)

    @property
    def complete(self) -> bool:
        """Whether the run that wrote the folder finished (else a rerun continues it)."""
        return bool(self.manifest["complete"])

    @property
    def keys(self) -> list[str]:
        """The values' tensor names, ``"{value}.{layer}"``."""
        return [f"{value}.{layer}" for layer in self.plan.layers for value in self.plan.values]

    @property
    def shards(self) -> list[Path]:
        return [self.folder / shard["file"] for shard in self.manifest["shards"]]

    def shard(self, index: int) -> dict[str, torch.Tensor]:
        """Shard ``index``'s tensors (each key of `keys`, ``token_ids``, ``window``, ``position``), loaded into memory.

        Raises:
            IndexError: no shard ``index`` (negative ones count from the end).
            TypeError: ``index`` is not an integer (a bool neither).
        """
        from safetensors.torch import load_file

        count = len(self.shards)
        try:
            if isinstance(index, bool):
                raise TypeError
            index = operator.index(index)  # a numpy or 0-d torch integer too
        except TypeError:
            raise TypeError(f"a shard index is an int, got {index!r}") from None
        if not -count <= index < count:
            raise IndexError(f"shard {index}: this dataset has {count} shards (0 to {count - 1})")
        return load_file(str(self.shards[index]))

    def batches(
        self,
        batch_size: int,
        *,
        keys: str | Sequence[str] | None = None,
        extra_keys: str | Sequence[str] = (),
        shuffle: bool = False,
        seed: int = 0,
        buffer_shards: int = 4,
        drop_last: bool = False,
    ) -> Iterator[dict[str, torch.Tensor]]:
        """Rows in batches: ``{key: [batch_size, ...]}`` for the values, ``token_ids`` and any ``extra_keys``.

        ``keys`` chooses which values each batch holds, *replacing* the
        default (every value, the `keys` property): ``keys=["layer_output.5"]`` gives that
        value and ``token_ids``. ``extra_keys`` *adds* tensors beside the
        values (the default ones, or those ``keys`` chose): each row's
        ``window`` (int64) and ``position`` (int32, in its window), typically,
        as ``batches(64, extra_keys=["window", "position"])``. ``token_ids``
        is always there.

        In order, shard after shard, without ``shuffle``; with it, the shards
        in a random order and the rows of ``buffer_shards`` shards at a time
        in a random order (memory: that many shards), seeded by ``seed``.
        The last batch is shorter unless ``drop_last``. Every shard, whatever
        process calls it (iterating the dataset shares the shards among a DataLoader's workers).

        Raises:
            ValueError: ``batch_size`` or ``buffer_shards`` not a positive int, or ``keys`` naming no value
                (``keys=["window"]`` would drop every value: that is ``extra_keys=["window"]``).
            TypeError: ``keys`` or ``extra_keys`` not a name or a list of names, ``seed`` not an int.
            KeyError: a key the dataset does not hold.
        """
        for label, number in (("batch_size", batch_size), ("buffer_shards", buffer_shards)):
            _check_positive(number, label)
        wanted = self._wanted(keys, extra_keys)
        self._check_seed(seed)
        return self._batches(batch_size, keys=wanted, shuffle=shuffle, seed=seed, buffer_shards=buffer_shards, drop_last=drop_last)

    def _wanted(self, keys: str | Sequence[str] | None, extra_keys: str | Sequence[str] = ()) -> list[str]:
        """The keys a batch holds: ``keys`` (default every value), checked, then ``extra_keys`` and ``token_ids``."""
        chosen = _names(keys, "keys") if keys is not None else self.keys
        extra = _names(extra_keys, "extra_keys")
        unknown = [key for key in [*chosen, *extra] if key not in self.keys and key not in ROW_KEYS]
        if unknown:
            raise KeyError(f"{unknown} not in this dataset; it holds {self.keys} and each row's {', '.join(ROW_KEYS)}")
        if not any(key in self.keys for key in chosen):
            raise ValueError(
                f"keys={chosen!r} names no value: keys replaces the default (every value, {self.keys}) rather than "
                f"adding to it; to add {chosen!r} beside the values, pass extra_keys={chosen!r}"
            )
        return list(dict.fromkeys([*chosen, *extra, "token_ids"]))

    @staticmethod
    def _check_seed(seed: Any) -> None:
        if not _is_int(seed):
            raise TypeError(f"seed must be an int, got {seed!r}")

    def _batches(
        self, batch_size: int, *, keys: list[str], shuffle: bool, seed: int, buffer_shards: int, drop_last: bool,
        share: tuple[int, int] = (0, 1),
    ) -> Iterator[dict[str, torch.Tensor]]:
        """`batches` of checked options, over the shards of ``share`` (``(worker, workers)``: every ``workers``-th shard of the order)."""
        generator = torch.Generator().manual_seed(seed)
        order = list(range(len(self.shards)))
        if shuffle:
            random.Random(seed).shuffle(order)
        worker, workers = share
        order = order[worker::workers]
        group = buffer_shards if shuffle else 1
        left: dict[str, torch.Tensor] | None = None
        for begin in range(0, len(order), group):
            loaded = [self.shard(index) for index in order[begin : begin + group]]
            rows = {key: torch.cat(([left[key]] if left else []) + [shard[key] for shard in loaded]) for key in keys}
            count = rows["token_ids"].shape[0]
            permutation = torch.randperm(count, generator=generator) if shuffle else None
            whole = count - count % batch_size
            for start in range(0, whole, batch_size):
                chosen = permutation[start : start + batch_size] if permutation is not None else slice(start, start + batch_size)
                yield {key: rows[key][chosen] for key in keys}
            rest = permutation[whole:] if permutation is not None else slice(whole, count)
            left = {key: rows[key][rest] for key in keys} if whole < count else None
        if left is not None and not drop_last:
            yield left


def _check_positive(number: Any, label: str) -> None:
    if not _is_int(number) or number < 1:
        raise ValueError(f"{label} must be a positive int, got {number!r}")
