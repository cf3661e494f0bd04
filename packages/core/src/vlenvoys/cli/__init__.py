"""The ``vlenvoys`` command."""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..collect import activations
from ..collect.prompts import collect as collect_values
from ..engine import load, shutdown
from ..engine.logs import vllm_logging
from ..errors import InvalidWrite, ReadOnly, SkipRefused, Unavailable, UnknownArchitecture, UnsupportedVLLM
from ..serve import server
from ..values.envoys import block_index
from ..values.family import families as installed_families
from ..values.names import KINDS, OWNERS, choices
from ..values.support import support as support_of
from ..weights import smollm2_path
from .lens import logit_lens

app = typer.Typer(
    help="Read and edit the insides of models served by vLLM, with nnterp's standard names.",
    no_args_is_help=True,
    add_completion=False,
)

@contextlib.contextmanager
def friendly_errors() -> Iterator[None]:
    """Print the errors a user can act on as one line, not a traceback."""
    try:
        yield
    # OSError: a missing file or folder, a hub name that cannot be fetched (offline), a full disk.
    # ImportError: a source read with an optional package (datasets) that is not installed.
    except (UnknownArchitecture, UnsupportedVLLM, Unavailable, InvalidWrite, ReadOnly, SkipRefused, OSError, ValueError, ImportError) as error:
        typer.secho(f"error: {error}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None


def checkpoint(model: str | None) -> str:
    """The checkpoint folder to use, checked before any engine starts (the built-in model when None)."""
    if model is None:
        model = str(smollm2_path())
    support_of(model)  # an unknown architecture or a missing folder is refused here
    return model


def check_layers(model: str, layers: list[int]) -> list[int]:
    """The blocks as non-negative indices (negative ones count from the end), checked before any engine starts."""
    from transformers import AutoConfig

    count = AutoConfig.from_pretrained(model).num_hidden_layers
    return [block_index(layer, count, noun="layer") for layer in layers]


def check_output(path: Path) -> None:
    """Refuse an output file whose folder does not exist, before any engine starts."""
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot save {path}: there is no folder {path.parent}")


class ShardDtype(str, enum.Enum):
    """How shards store values (`vlenvoys.activations.collect_dataset`'s ``dtype``)."""

    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class ShardPositions(str, enum.Enum):
    """Which positions shards keep (``collect_dataset``'s ``positions``)."""

    all = "all"
    no_bos = "no_bos"
    last = "last"


def block_list(text: str | int) -> list[int]:
    """``--layers``' parser: one block index or several, comma-separated (``5``, ``5,15``, ``-1``)."""
    if isinstance(text, int):  # the default, already an int
        return [text]
    try:
        return [int(each) for each in text.split(",") if each.strip()]
    except ValueError:
        raise typer.BadParameter(
            f"expected block indices such as 5 or 5,15 (negative count from the end), got {text!r}"
        ) from None


def value_list(text: str) -> list[str]:
    """``--value``'s parser: standard block value names, comma-separated; an unknown one says the nearest."""
    names = [each.strip() for each in text.split(",") if each.strip()]
    for name in names:
        if name not in OWNERS:
            raise typer.BadParameter(f"{name!r} is not a block value; {choices(name)}")
    return names


def flat(lists: list[list]) -> list:
    """A repeatable list option's occurrences, each parsed into a list, as one list in order."""
    return [each for listed in lists for each in listed]


Model = Annotated[
    Optional[str],
    typer.Argument(help="A checkpoint folder or a Hugging Face model id; omit it for the built-in SmolLM2-135M-Instruct."),
]


@app.command()
def lens(
    model: Model = None,
    prompt: Annotated[str, typer.Option(help="The prompt to read.")] = "The Eiffel Tower is located in the city of",
    top: Annotated[int, typer.Option(min=1, help="How many predictions to show per layer.")] = 5,
    out: Annotated[Path, typer.Option(help="Where to save the heatmap (PNG).")] = Path("logit_lens.png"),
) -> None:
    """The logit lens of a prompt: each layer's top next-token predictions at the last position.

    Prints a table and saves a heatmap of every position's top prediction per layer.
    """
    from rich.console import Console

    console = Console()
    with friendly_errors():
        model = checkpoint(model)
        check_output(out)
        with console.status("starting vLLM (about 30 s on a CPU)"):
            loaded = load(model)
        try:
            result = logit_lens(loaded, prompt, k=top)
        finally:
            shutdown(loaded)
    console.print(result.table(title=f"logit lens: {prompt!r}"))
    result.heatmap(out, title=prompt)
    console.print(f"final prediction: {result.top_tokens[-1][0]!r}; heatmap saved to {out}")


@app.command()
def patterns(
    model: Model = None,
    layer: Annotated[int, typer.Option(help="The block whose attention to draw (negative counts from the end).")] = 0,
    prompt: Annotated[str, typer.Option(help="The prompt to read.")] = "The Eiffel Tower is located in the city of",
    out: Annotated[Path, typer.Option(help="Where to save the heatmaps (PNG).")] = Path("attention_patterns.png"),
) -> None:
    """Draw every head's attention pattern of one block for a prompt (query token x key token)."""
    import math

    from matplotlib.figure import Figure
    from rich.console import Console

    console = Console()
    with friendly_errors():
        model = checkpoint(model)
        (layer,) = check_layers(model, [layer])
        check_output(out)
        with console.status("starting vLLM (about 30 s on a CPU)"):
            loaded = load(model)
        try:
            ids = loaded.tokenizer(prompt)["input_ids"]
            with loaded.trace(ids, temperature=0.0):
                pattern = loaded.layers[layer].self_attn.attention_probabilities.save()
        finally:
            shutdown(loaded)
    pattern = pattern.cpu()  # saved on the engine's device
    tokens = [repr(loaded.tokenizer.decode([token]))[1:-1] for token in ids]
    heads = pattern.shape[1]
    columns = min(heads, 4)
    rows = math.ceil(heads / columns)
    size = max(3.0, 0.35 * len(tokens))
    # matplotlib's object API: no backend switched, no pyplot state (as `Lens.figure`).
    figure = Figure(figsize=(size * columns, size * rows))
    axes = figure.subplots(rows, columns, squeeze=False)
    for head, axis in enumerate(axes.flat):
        if head >= heads:
            axis.axis("off")
            continue
        axis.imshow(pattern[0, head].numpy(), cmap="viridis", vmin=0, vmax=1)
        axis.set_title(f"head {head}")
        axis.set_xticks(range(len(tokens)), tokens, rotation=90, fontsize=7)
        axis.set_yticks(range(len(tokens)), tokens, fontsize=7)
    figure.suptitle(f"layer {layer} attention: query (rows) attends to key (columns)")
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    console.print(f"{heads} heads of layer {layer} saved to {out}")


@app.command()
def collect(
    source: Annotated[
        Path,
        typer.Argument(
            help="One prompt per line; with --context-length a corpus: text (a document per line), .jsonl, "
            ".parquet, .csv, a folder from datasets' save_to_disk, or hf:NAME (a Hugging Face dataset, streamed)."
        ),
    ],
    model: Model = None,
    value: Annotated[
        list[str],
        typer.Option(
            parser=value_list, metavar="VALUE[,VALUE...]",
            help=f"A block value ({', '.join(OWNERS)}); several (comma-separated or repeated) with --context-length.",
        ),
    ] = ["layer_output"],  # noqa: B006 (typer's default of a list option; never mutated)
    layers: Annotated[
        list[int],
        typer.Option(
            parser=block_list, metavar="INT[,INT...]",
            help="Block indices, comma-separated or repeated (negative count from the end).",
        ),
    ] = [0],  # noqa: B006
    out: Annotated[
        Optional[Path], typer.Option(help="The safetensors file to write (default values.safetensors); with --context-length, the folder of shards (default activations).")
    ] = None,
    batch: Annotated[
        int | None, typer.Option(min=1, help="Prompts in flight on the engine at once (default: the engine's max_num_seqs).")
    ] = None,
    context_length: Annotated[
        Optional[int], typer.Option(min=2, help="Cut the source into windows of this many tokens (BOS included) and stream their values to a folder of shards.")
    ] = None,
    field: Annotated[str, typer.Option(help="The text's field in a .jsonl or datasets source.")] = "text",
    split: Annotated[
        Optional[str], typer.Option(help="The split to read of a source with several (an hf: dataset, a saved DatasetDict).")
    ] = None,
    subset: Annotated[Optional[str], typer.Option(help="An hf: dataset's subset (its configuration).")] = None,
    dtype: Annotated[ShardDtype, typer.Option(help="How shards store values.")] = ShardDtype.bfloat16,
    positions: Annotated[
        ShardPositions, typer.Option(help="Which positions shards keep (no_bos: drop BOS tokens).")
    ] = ShardPositions.all,
    shard_tokens: Annotated[int, typer.Option(min=1, help="Tokens of windows per shard.")] = 2**16,
    max_tokens: Annotated[Optional[int], typer.Option(min=1, help="Stop after this many tokens of windows.")] = None,
    bos: Annotated[bool, typer.Option(help="Start each window with the BOS token (documents are separated by it).")] = True,
) -> None:
    """Save block values of every prompt of a file, or of a corpus cut into windows.

    The source comes first, the model (optional) second:
    vlenvoys collect prompts.txt --layers 5,15 (the built-in model), or
    vlenvoys collect prompts.txt path/to/checkpoint --value mlp_neurons.

    Prompts: one safetensors file of tensors named VALUE.LAYER.INDEX, INDEX
    counting the file's non-empty lines from 0; each is that prompt's
    (tokens, ...) tensor, with no batch axis. Its metadata says what it holds:
    "prompts" (a JSON list, by INDEX), "value", "layers" (a JSON list) and
    "model" (as given, or the built-in's name).

    Windows (--context-length): a folder of shards, written as the values
    leave the engine, and a manifest (vlenvoys.activations.Activations reads
    it). Interrupted, the same command continues after the last complete shard.
    """
    values, chosen = flat(value), flat(layers)
    if not values or not chosen:
        raise typer.BadParameter("--value and --layers need at least one name and one block")
    if context_length is None and len(values) != 1:
        raise typer.BadParameter("one value per prompts file; several need --context-length (a folder of shards)")
    with friendly_errors():
        # The name the user gave (a hub name, a folder), not the cache folder it resolves to.
        named = str(model) if model is not None else "SmolLM2-135M-Instruct (built-in, float32)"
        model = checkpoint(model)
        chosen = check_layers(model, chosen)
        check_served(model, values)
        if context_length is None:
            _collect_prompts(source, model, named, values[0], chosen, out or Path("values.safetensors"), batch)
        else:
            _collect_windows(
                source, model, values, chosen, out or Path("activations"), batch, context_length,
                field=field, split=split, subset=subset, dtype=dtype.value, positions=positions.value, shard_tokens=shard_tokens, max_tokens=max_tokens, bos=bos,
            )


def check_served(model: str, values: list[str]) -> None:
    """Refuse a value the model cannot serve, before any engine starts."""
    served = support_of(model)
    for value in values:
        row = served[KINDS[OWNERS[value]], value]
        if not row.available:
            raise Unavailable(value, "this model", row.note)


def _collect_prompts(prompts: Path, model: str, named: str, value: str, chosen: list[int], out: Path, batch: int | None) -> None:
    from rich.console import Console

    texts = [line.strip() for line in prompts.read_text().splitlines() if line.strip()]
    if not texts:
        raise ValueError(f"{prompts} has no prompts (one per line)")
    check_output(out)
    console = Console()
    with console.status("starting vLLM (about 30 s on a CPU)"):
        loaded = load(model)
    try:
        collected = collect_values(loaded, texts, value, chosen, batch_size=batch, progress=True)
    finally:
        shutdown(loaded)
    # Keys are VALUE.LAYER; each prompt's tensor is saved without its batch axis.
    tensors = {
        f"{key}.{index}": tensor[0].contiguous()
        for key, values in collected.items()
        for index, tensor in enumerate(values)
    }
    # safetensors metadata is string -> string: the lists go in as JSON.
    metadata = {"prompts": json.dumps(texts), "value": value, "layers": json.dumps(sorted(set(chosen))), "model": named}
    activations.save_readable(tensors, out, metadata)
    console.print(f"{len(tensors)} tensors from {len(texts)} prompts saved to {out}")


def _collect_windows(
    source: Path, model: str, values: list[str], chosen: list[int], out: Path, batch: int | None, context_length: int, **options
) -> None:
    """Windows mode: every check that needs no engine (the plan, the folder, the source's windows) first."""
    from rich.console import Console
    from transformers import AutoConfig, AutoTokenizer

    longest = AutoConfig.from_pretrained(model).max_position_embeddings
    if context_length >= longest:  # each window's request generates one token, which needs a position too
        raise ValueError(f"--context-length {context_length} is longer than the model serves: at most {longest - 1} ({longest} positions)")
    max_tokens, bos, field = options.pop("max_tokens"), options["bos"], options["field"]
    split, subset = options["split"], options["subset"]
    activations.check_rows_per_token(model, values)
    plan = activations.make_plan(model, values, chosen, context_length=context_length, source=source, **options)
    shards = activations.open_shards(out, plan, max_tokens)
    console = Console()
    if shards.complete:
        console.print(f"{out} already holds this collection, complete: {activations.Activations(out)}")
        return
    tokenizer = AutoTokenizer.from_pretrained(model)
    cut = activations.windows(activations.documents(source, field, split=split, subset=subset), tokenizer, context_length, bos=bos)
    shards.check_unchanged(cut)
    if next(cut, None) is None and not shards.done:
        raise ValueError(f"{source} holds fewer tokens than one window of {context_length}")
    if shards.done:
        console.print(f"continuing after the {len(shards.done)} complete shards in {out}")
    with console.status("starting vLLM (about 30 s on a CPU)"):
        loaded = load(model)
    try:
        written = activations.collect_dataset(
            loaded, source, out, values, chosen, context_length=context_length, max_tokens=max_tokens, batch_size=batch, **options
        )
    except KeyboardInterrupt:
        done = activations.Activations(out).manifest["shards"] if (out / activations.MANIFEST).exists() else []
        console.print(f"interrupted: {len(done)} complete shards in {out}; run the same command to continue after them")
        raise typer.Exit(130) from None
    finally:
        shutdown(loaded)
    console.print(f"{written}")


@app.command()
def support(model: Model = None) -> None:
    """Which standard values a model serves, and why not where it cannot (no engine is started)."""
    from rich.console import Console

    with friendly_errors():
        Console(width=max(120, Console().width)).print(support_of(checkpoint(model)).table())


def served(family: Any) -> list[str]:
    """A family's architectures, those it declares on vLLM's transformers backend alone marked so."""
    alone = [name for name in family.transformers_backend if name not in family.architectures]
    return [*family.architectures, *(f"{name} (transformers backend)" for name in alone)]


@app.command()
def families() -> None:
    """List the installed family packages, their versions and the architectures they serve."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="installed vlenvoys families")
    for column in ("family", "distribution", "version", "architectures"):
        table.add_column(column)
    for installed in installed_families():
        table.add_row(
            installed.name,
            installed.distribution,
            installed.version,
            ", ".join(served(installed.family)) or "(none yet)",
        )
    Console().print(table)


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
)
def serve(ctx: typer.Context) -> None:
    """vLLM's OpenAI-compatible server on vlenvoys' worker, with per-request steering.

    vlenvoys serve [MODEL] [any vllm serve argument] [--vectors FILE.safetensors]
    (without MODEL, the built-in SmolLM2-135M-Instruct): /v1/completions and /v1/chat/completions take a "steering" field
    (vlenvoys.serve.steering). vlenvoys serve --help lists every argument.
    """
    with friendly_errors():
        server.main(ctx.args)


@app.callback()
def main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show vLLM's own log.")] = False) -> None:
    """Quiet vLLM's start-up log unless asked for."""
    # vLLM logs to stdout by default; keep stdout for the results (vlenvoys lens > lens.txt).
    # The variable reaches vLLM's processes; this one configured its handler on import.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if os.environ["VLLM_LOGGING_STREAM"] == "ext://sys.stderr":
        for handler in logging.getLogger("vllm").handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
                handler.setStream(sys.stderr)
    # vLLM's INFO lines only with --verbose, set where `load` sets them (its default keeps this choice).
    vllm_logging(verbose)
