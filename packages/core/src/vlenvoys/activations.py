"""`vlenvoys.activations`, as the README names it: activation datasets, from `vlenvoys.collect.activations`,
and their export to other tools' layouts (SAELens'), from `vlenvoys.collect.exports`."""

from .collect.activations import POSITIONS, Activations, Plan, collect_dataset, documents, windows
from .collect.exports import FORMATS, export

__all__ = ["FORMATS", "POSITIONS", "Activations", "Plan", "collect_dataset", "documents", "export", "windows"]
