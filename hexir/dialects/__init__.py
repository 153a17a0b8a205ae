"""hexir's two dialects, defined with IRDL and loaded into every context hexir makes.

- `hexir`  (graph level): tensors and value semantics — what to compute.
- `hextir` (kernel level): buffers, loops and their schedules — how one device computes it.
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import irdl

from hexir.dialects import hexir, hextir


def make_context() -> ir.Context:
    """A fresh MLIR context with the hexir dialect (every defined op) and hextir registered.
    Single-threaded: a context's LLVM thread pool, freed in a forked child (which has none of
    its threads), aborts the child (`pthread_join failed`); hexir's passes are driven from
    Python, one module at a time, so the pool bought nothing."""
    context = ir.Context()
    context.enable_multithreading(False)
    with context, ir.Location.unknown():
        irdl.load_dialects(ir.Module.parse(hexir.irdl() + hextir.IRDL))
    return context
