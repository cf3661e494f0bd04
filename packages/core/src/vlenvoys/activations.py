"""`vlenvoys.activations`, as the README names it: activation datasets, from `vlenvoys.collect.activations`."""

from .collect.activations import POSITIONS, Activations, Plan, collect_dataset, documents, windows

__all__ = ["POSITIONS", "Activations", "Plan", "collect_dataset", "documents", "windows"]
