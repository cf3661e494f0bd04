"""What a standard value is and where each family's modules hold it; the same code in the client and every worker.

- `names`: the standard block values by name (`VALUES`), the envoy that serves each, in forward order;
- `layouts`: the layouts and the declarations that read a value at one module's input or output
  (`Flat`, `Derived`, ...) and hand an edit back in the model's own form;
- `envoys`: the base envoys (`Layer`, `FusedLayer`, `Attention`, `Mlp`, ...) declaring every value once;
- `attention`, `routing`, `parallel`: the pattern recomputed, a mixture of experts' routing at a module
  boundary, the attention kernel's heads made whole across tensor-parallel ranks;
- `family`: the family packages' declarations, their discovery and a checkpoint's family;
- `support`: which values a model serves, and why not;
- `reads`: a read of a block value on a loaded tree, and whether one hook per module per step serves it.
"""

from .layouts import (
    Checked,
    Derived,
    Experts,
    Flat,
    Heads,
    KeyValueHeads,
    Located,
    Neurons,
    Pattern,
    Residual,
    Routes,
    argument,
    batched,
    check_masked,
    summed,
    summed_output,
    unbatched,
    with_argument,
)
from .names import VALUES

__all__ = [
    "VALUES",
    "Checked",
    "Derived",
    "Experts",
    "Flat",
    "Heads",
    "KeyValueHeads",
    "Located",
    "Neurons",
    "Pattern",
    "Residual",
    "Routes",
    "argument",
    "batched",
    "check_masked",
    "summed",
    "summed_output",
    "unbatched",
    "with_argument",
]
