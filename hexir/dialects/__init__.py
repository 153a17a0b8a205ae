"""hexir's two dialects, defined with IRDL and loaded into every context hexir makes.

- `hexir`  (graph level): tensors and value semantics — what to compute.
- `hextir` (kernel level): buffers, loops and their schedules — how one device computes it.
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import irdl

from hexir.dialects import hexir, hextir


def make_context() -> ir.Context:
    """A fresh MLIR context with the hexir dialect (every defined op) and hextir registered."""
    context = ir.Context()
    with context, ir.Location.unknown():
        irdl.load_dialects(ir.Module.parse(hexir.irdl() + hextir.IRDL))
    return context
