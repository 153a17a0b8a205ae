"""What several passes need to find in a module."""

from __future__ import annotations

from mlir import ir

from hexir.dialects import hextir
from hexir.errors import CompileError


def main_function(module: ir.Module) -> ir.Operation:
    """The host program: the module's `func.func @main`."""
    for op in module.body.operations:
        if op.operation.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == "main":
            return op.operation
    raise CompileError("the module has no func.func @main (the host program)")


def kernels(module: ir.Module, device: str | None = None) -> list[ir.Operation]:
    """The kernel functions of a module (those tagged hextir.kernel), optionally of one device."""
    found = []
    for op in module.body.operations:
        tag = hextir.kernel_of(op.operation) if op.operation.name == "func.func" else None
        if tag is not None and (device is None or tag[0] == device):
            found.append(op.operation)
    return found
