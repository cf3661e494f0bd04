"""The logit lens: what each layer's residual stream would predict next."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["Lens", "logit_lens"]


@dataclass
class Lens:
    """A logit lens of one prompt.

    Attributes:
        tokens: The prompt's tokens as text, one per position.
        probabilities: ``[layers, positions, vocab]`` softmax of each block's
            output stream through the final norm and unembedding.
        top_ids: ``[layers, k]`` the top next-token ids at the last position.
        top_probabilities: ``[layers, k]`` their probabilities.
        top_tokens: The same ids as text.
    """

    tokens: list[str]
    probabilities: torch.Tensor
    top_ids: torch.Tensor
    top_probabilities: torch.Tensor
    top_tokens: list[list[str]]

    def table(self, title: str | None = None):
        """A rich Table: one row per layer, the top predictions with their probabilities."""
        from rich.table import Table

        table = Table(title=title)
        table.add_column("layer", justify="right")
        for rank in range(self.top_ids.shape[1]):
            table.add_column(f"#{rank + 1}")
        for layer, (tokens, probabilities) in enumerate(zip(self.top_tokens, self.top_probabilities)):
            table.add_row(str(layer), *(f"{token!r} {p:.2f}" for token, p in zip(tokens, probabilities.tolist())))
        return table

    def figure(self, title: str | None = None) -> Figure:
        """The classic logit-lens picture as a matplotlib ``Figure``: layers x positions, coloured by the top
        prediction's probability and labelled with its token.

        Made with matplotlib's object API (``matplotlib.figure.Figure``), not
        pyplot: the backend a notebook or script chose is left alone and no
        figure is left open in pyplot. Show it in a notebook by leaving it as a
        cell's value (``lens.figure()``), or save it with ``figure.savefig(path)``
        (`heatmap` does).
        """
        from matplotlib.figure import Figure

        best, ids = self.probabilities.max(-1)
        layers, positions = best.shape
        width = max(6.0, 0.9 * positions + 2)
        height = max(4.0, 0.28 * layers + 1.5)
        figure = Figure(figsize=(width, height))
        axes = figure.subplots()
        image = axes.imshow(best.numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=1, origin="lower")
        for layer in range(layers):
            for position in range(positions):
                # repr's escapes keep whitespace tokens ("\n", " ") visible.
                text = repr(self._decode(int(ids[layer, position])))[1:-1]
                colour = "black" if best[layer, position] > 0.6 else "white"
                axes.text(position, layer, text, ha="center", va="center", fontsize=7, color=colour)
        axes.set_xticks(range(positions), [repr(token)[1:-1] for token in self.tokens], rotation=45, ha="right")
        axes.set_ylabel("layer")
        axes.set_xlabel("input token (prediction is for the next one)")
        axes.set_title(title or "logit lens: top next-token prediction per layer")
        figure.colorbar(image, ax=axes, label="probability")
        figure.tight_layout()
        return figure

    def heatmap(self, path: str | Path | None = None, title: str | None = None) -> Figure:
        """The heatmap as a matplotlib ``Figure`` (`figure`), saved to ``path`` too where given (its suffix picks
        the format: ``.png``, ``.svg``, ``.pdf``).

        matplotlib's backend is not switched (see `figure`), so this is safe to
        call in a notebook or beside an interactive backend.

        Raises:
            FileNotFoundError: ``path``'s folder does not exist.
        """
        made = self.figure(title)
        if path is not None:
            made.savefig(Path(path), dpi=120)
        return made

    _decoder = None

    def _decode(self, token: int) -> str:
        return self._decoder(token) if self._decoder else str(token)


def logit_lens(model, prompt: str, k: int = 5) -> Lens:
    """Run a logit lens of ``prompt`` on a model from `vlenvoys.load`.

    Each block's output stream (``layer_output``, every position) is put
    through the final norm and the unembedding (`project_on_vocab`), in one
    trace on the engine; only the per-layer probabilities come back.
    """
    tokenizer = model.tokenizer
    ids = tokenizer(prompt)["input_ids"]
    with model.trace(ids, temperature=0.0, max_tokens=1):
        layers = list()
        for layer in model.layers:
            layers.append(model.project_on_vocab(layer.layer_output[0]).softmax(-1))
        probabilities = torch.stack(layers).save()
    probabilities = probabilities.float().cpu()
    top = probabilities[:, -1].topk(k, dim=-1)
    lens = Lens(
        tokens=[tokenizer.decode([token]) for token in ids],
        probabilities=probabilities,
        top_ids=top.indices,
        top_probabilities=top.values,
        top_tokens=[[tokenizer.decode([token]) for token in row] for row in top.indices.tolist()],
    )
    lens._decoder = lambda token: tokenizer.decode([token])
    return lens
