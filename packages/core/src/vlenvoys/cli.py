"""The ``vlenvoys`` command."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(
    help="Read and edit the insides of models served by vLLM, with nnterp's standard names.",
    no_args_is_help=True,
    add_completion=False,
)

Model = Annotated[
    Optional[str],
    typer.Argument(help="A local checkpoint folder; omit it for the built-in SmolLM2-135M-Instruct."),
]


@app.command()
def lens(
    model: Model = None,
    prompt: Annotated[str, typer.Option(help="The prompt to read.")] = "The Eiffel Tower is located in the city of",
    top: Annotated[int, typer.Option(help="How many predictions to show per layer.")] = 5,
    out: Annotated[Path, typer.Option(help="Where to save the heatmap (PNG).")] = Path("logit_lens.png"),
) -> None:
    """The logit lens of a prompt: each layer's top next-token predictions at the last position.

    Prints a table and saves a heatmap of every position's top prediction per layer.
    """
    from rich.console import Console

    import vlenvoys
    from vlenvoys.lens import logit_lens

    console = Console()
    with console.status("starting vLLM (about 30 s on a CPU)"):
        loaded = vlenvoys.load(model, max_model_len=2048)
    try:
        result = logit_lens(loaded, prompt, k=top)
    finally:
        vlenvoys.shutdown(loaded)
    console.print(result.table(title=f"logit lens: {prompt!r}"))
    console.print(f"final prediction: {result.top_tokens[-1][0]!r}; heatmap saved to {result.heatmap(out, title=prompt)}")


@app.command()
def support(model: Model = None) -> None:
    """Which standard values a model serves, and why not where it cannot (no engine is started)."""
    from rich.console import Console

    import vlenvoys

    if model is None:
        from vlenvoys.weights import smollm2_path

        model = str(smollm2_path())
    Console().print(vlenvoys.support(model).table())


@app.command()
def families() -> None:
    """List the installed family packages, their versions and the architectures they serve."""
    from rich.console import Console
    from rich.table import Table

    import vlenvoys

    table = Table(title="installed vlenvoys families")
    for column in ("family", "distribution", "version", "architectures"):
        table.add_column(column)
    for installed in vlenvoys.families():
        table.add_row(
            installed.name,
            installed.distribution,
            installed.version,
            ", ".join(installed.family.architectures) or "(none yet)",
        )
    Console().print(table)


@app.callback()
def main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show vLLM's own log.")] = False) -> None:
    """Quiet vLLM's start-up log unless asked for."""
    if not verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        logging.getLogger("vllm").setLevel(logging.WARNING)
