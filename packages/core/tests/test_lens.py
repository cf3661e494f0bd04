"""The logit lens's picture (`vlenvoys.cli.lens.Lens`) leaves matplotlib's backend alone (#49); no engine."""

from __future__ import annotations

import sys

import matplotlib
import pytest
import torch
from matplotlib.figure import Figure

from vlenvoys.cli.lens import Lens


def tiny_lens() -> Lens:
    probabilities = torch.randn(3, 4, 11, generator=torch.Generator().manual_seed(0)).softmax(-1)
    top = probabilities[:, -1].topk(2, dim=-1)
    return Lens(
        tokens=["a", " b", "\n", "c"], probabilities=probabilities, top_ids=top.indices, top_probabilities=top.values,
        top_tokens=[[str(token) for token in row] for row in top.indices.tolist()],
    )


@pytest.fixture
def template_backend():
    """A backend a notebook might have chosen (here the non-interactive template), restored after the test."""
    before = matplotlib.get_backend()
    matplotlib.use("template")
    try:
        yield
    finally:
        matplotlib.use(before)


def test_heatmap_saves_without_switching_matplotlibs_backend(template_backend, tmp_path):
    pyplot_before = "matplotlib.pyplot" in sys.modules
    figure = tiny_lens().heatmap(tmp_path / "lens.png", title="tiny")
    assert isinstance(figure, Figure) and figure.axes[0].get_title() == "tiny"
    assert (tmp_path / "lens.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert isinstance(tiny_lens().heatmap(), Figure), "without a path: the figure alone, nothing saved"
    assert matplotlib.get_backend() == "template", "a notebook's backend stays its own"
    assert ("matplotlib.pyplot" in sys.modules) == pyplot_before, "no pyplot, whose figures a notebook would show twice"


def test_figure_is_a_matplotlib_figure_to_show_or_save(template_backend):
    figure = tiny_lens().figure(title="tiny")
    assert isinstance(figure, Figure)
    (axes, colorbar) = figure.axes
    assert axes.get_title() == "tiny" and len(axes.texts) == 3 * 4
    assert matplotlib.get_backend() == "template"
