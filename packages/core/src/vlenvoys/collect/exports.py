"""Activation datasets in other tools' layouts: `export` writes a folder of shards as SAELens' cached activations.

SAELens trains a sparse autoencoder on activations it caches itself
(``CacheActivationsRunner``) or on any folder in the same layout, named by
``cached_activations_path``: a Hugging Face ``datasets.Dataset`` saved with
``save_to_disk``, one row per window of ``context_size`` tokens, holding

- one column per hook, named as TransformerLens names it
  (``"blocks.3.hook_resid_post"``), each row ``[context_size, d_in]``
  (``datasets.Array2D``);
- ``"token_ids"``: the window's tokens, ``context_size`` int32.

`export` writes a `collect_dataset` folder that way: each value
``"{value}.{layer}"`` under its TransformerLens hook
(`vlenvoys.values.names.TRANSFORMER_LENS`), a value of several heads
flattened to ``heads * head_dim`` as SAELens flattens ``hook_z``::

    from vlenvoys.activations import collect_dataset, export

    collect_dataset(model, "corpus.jsonl", "acts", "layer_output", [3], context_length=128)
    export("acts", "acts-saelens")        # then, in SAELens: cached_activations_path="acts-saelens",
                                          # hook_name="blocks.3.hook_resid_post", context_size=128
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..values.names import transformer_lens_name
from .activations import Activations

__all__ = ["FORMATS", "export"]

#: The layouts `export` writes.
FORMATS = ("sae_lens",)
#: The dtypes an exported column may hold (Arrow, which ``datasets`` writes, has no bfloat16).
EXPORT_DTYPES = ("float32", "float16")
#: The columns of each window beside the values.
TOKENS = "token_ids"


def export(
    folder: str | os.PathLike | Activations,
    out: str | os.PathLike,
    format: str = "sae_lens",
    *,
    keys: str | Sequence[str] | None = None,
    names: Mapping[str, str] | None = None,
    dtype: str = "float32",
    shuffle: bool = False,
    seed: int = 0,
    progress: bool = True,
) -> Path:
    """Write the activation dataset in ``folder`` (`collect_dataset`'s) to ``out`` in another tool's layout.

    ``format="sae_lens"``: SAELens' cached activations (see the module's
    docstring), a ``datasets`` dataset saved to disk that SAELens'
    ``ActivationsStore`` reads with ``cached_activations_path=out``. Its
    ``context_size`` is the collection's ``context_length`` (a window's rows);
    its ``d_in`` a row's width. The dataset's description (``info.description``)
    holds the collection's plan and which column holds which of its keys, as JSON.

    The shards are converted one at a time (memory: one shard), each saved
    beside ``out`` first and the whole then saved to ``out``, so the disk
    holds the export twice until it is done.

    Args:
        folder: A folder `collect_dataset` wrote, complete, or its `Activations`.
        out: The folder to write; it must not exist, or be empty.
        format: ``"sae_lens"``.
        keys: The values to write, ``"{value}.{layer}"`` (default: every one).
        names: A column name for a key, where TransformerLens' name is not
            the one wanted or it has none (``{"mlp_norm_output.3": "blocks.3.ln2.hook_normalized"}``).
        dtype: The columns' dtype: ``"float32"`` or ``"float16"``.
        shuffle: Write the windows in a random order (``datasets``' ``shuffle(seed=seed)``);
            SAELens reads a cache in its order and mixes only the rows of its buffer.
        seed: The shuffle's seed.
        progress: Show a progress bar over the shards (``datasets``' own bars are off meanwhile).

    Returns:
        ``out``.

    Raises:
        ValueError: an unknown ``format`` or ``dtype``; a collection that did
            not complete; windows that keep different numbers of rows
            (``positions="no_bos"``); a value of integers; a value
            TransformerLens has no hook for, without a name in ``names``.
        KeyError: a key the dataset does not hold.
        FileExistsError: ``out`` is a file or a folder that is not empty.
        ImportError: without the ``datasets`` package (``pip install vlenvoys-core[datasets]``).
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(EXPORT_DTYPES)} (Arrow has no bfloat16), got {dtype!r}")
    activations = folder if isinstance(folder, Activations) else Activations(folder)
    if not activations.complete:
        raise ValueError(
            f"{activations.folder}: the collection did not complete; run the same collect_dataset call again to finish it, then export"
        )
    chosen = _chosen(activations, keys)
    columns = _columns(chosen, dict(names or {}))
    context = _window_rows(activations)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty folder; export writes a new folder")
    datasets = _datasets()

    first = activations.shard(0)
    widths = {key: _width(key, first[key]) for key in chosen}
    features = datasets.Features(
        {
            **{columns[key]: datasets.Array2D(shape=(context, widths[key]), dtype=dtype) for key in chosen},
            TOKENS: datasets.Sequence(datasets.Value("int32"), length=context),
        }
    )
    description = json.dumps({"format": "vlenvoys-activations/sae_lens", "plan": activations.manifest["plan"], "columns": columns})
    staging = out.parent / f".{out.name}.shards"
    if staging.exists():
        shutil.rmtree(staging)  # an export stopped before it finished
    bars_were_on = not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    bar = _progress_bar(progress, len(activations.shards))
    try:
        parts = []
        for index in range(len(activations.shards)):
            shard = first if index == 0 else activations.shard(index)
            windows = shard[TOKENS].shape[0] // context
            table = {columns[key]: shard[key].reshape(windows, context, widths[key]).to(_TORCH[dtype]).numpy() for key in chosen}
            table[TOKENS] = shard[TOKENS].reshape(windows, context).numpy()
            part = staging / f"shard-{index:05d}"
            datasets.Dataset.from_dict(table, features=features).save_to_disk(str(part))
            parts.append(part)
            del shard, table
            if bar is not None:
                bar.update(1)
        del first
        loaded = [datasets.load_from_disk(str(part)) for part in parts]
        whole = datasets.concatenate_datasets(loaded, info=datasets.DatasetInfo(description=description, features=features))
        if shuffle:
            whole = whole.shuffle(seed=seed)
        whole.save_to_disk(str(out))
        del whole, loaded
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if bar is not None:
            bar.close()
        if bars_were_on:
            datasets.enable_progress_bars()
    return out


_TORCH = {"float32": torch.float32, "float16": torch.float16}


def _datasets() -> Any:
    try:
        import datasets
    except ImportError as error:
        raise ImportError("export writes a `datasets` dataset: pip install datasets (vlenvoys-core[datasets])") from error
    return datasets


def _progress_bar(shown: bool, shards: int) -> Any:
    if not shown:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=shards, unit="shard", desc="exporting")


def _chosen(activations: Activations, keys: str | Sequence[str] | None) -> list[str]:
    """The keys to export: ``keys`` (a name or several), each a value the dataset holds; every value without it."""
    if keys is None:
        return activations.keys
    chosen = [keys] if isinstance(keys, str) else list(keys)
    if not chosen or not all(isinstance(key, str) for key in chosen):
        raise TypeError(f"keys must be a name or a list of names, got {keys!r}")
    unknown = [key for key in chosen if key not in activations.keys]
    if unknown:
        raise KeyError(f"{unknown} not in this dataset; it holds {activations.keys}")
    return list(dict.fromkeys(chosen))


def _columns(keys: list[str], names: dict[str, str]) -> dict[str, str]:
    """Each key's column: ``names``' or its TransformerLens hook's; ValueError for a key with neither."""
    unknown = sorted(set(names) - set(keys))
    if unknown:
        raise KeyError(f"names gives columns for {unknown}, which are not exported; the keys are {keys}")
    columns, missing = {}, []
    for key in keys:
        value, layer = key.rsplit(".", 1)
        try:
            columns[key] = names.get(key) or transformer_lens_name(value, int(layer))
        except ValueError as error:
            missing.append(f"{key} ({error})")
    if missing:
        raise ValueError(f"{'; '.join(missing)}: pass a column name for each in names=, or leave it out of keys=")
    taken = [column for column in columns.values() if list(columns.values()).count(column) > 1]
    if taken or TOKENS in columns.values():
        raise ValueError(f"two exported keys share a column ({sorted(set(taken)) or TOKENS}); name one apart in names=")
    return columns


def _window_rows(activations: Activations) -> int:
    """The rows each window keeps, the same for every window (SAELens' ``context_size``)."""
    plan = activations.plan
    if plan.positions == "all":
        return plan.context_length
    if plan.positions == "last":
        return 1
    raise ValueError(
        f"{activations.folder} keeps positions={plan.positions!r}: its windows keep different numbers of rows, and SAELens "
        "reads windows of context_size rows each; collect with positions='all' (SAELens drops the tokens it is told to "
        "with exclude_special_tokens) or 'last'"
    )


def _width(key: str, tensor: torch.Tensor) -> int:
    """A row's width once flattened (heads: ``heads * head_dim``); ValueError for a value of integers."""
    if not tensor.dtype.is_floating_point:
        raise ValueError(f"{key} holds integers ({tensor.dtype}); SAELens trains on float activations: leave it out of keys=")
    width = 1
    for size in tensor.shape[1:]:
        width *= size
    return width
