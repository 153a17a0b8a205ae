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


def argument_names(main: ir.Operation) -> list[str]:
    """The names of @main's arguments: its `hexir.arg_names` (the traced function's
    parameters) when it has one name per argument, else arg0, arg1, ..."""
    count = len(ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value).inputs)
    if "hexir.arg_names" in main.attributes:
        names = [ir.StringAttr(name).value for name in ir.ArrayAttr(main.attributes["hexir.arg_names"])]
        if len(names) == count:
            return names
    return [f"arg{i}" for i in range(count)]


def kernels(module: ir.Module, device: str | None = None) -> list[ir.Operation]:
    """The kernel functions of a module (tagged hextir.kernel), optionally of one device:
    `func.func`s at the top level and, once outlined, `gpu.func`s inside `gpu.module`s."""
    candidates = []
    for op in module.body.operations:
        if op.operation.name == "func.func":
            candidates.append(op.operation)
        elif op.operation.name == "gpu.module":
            candidates.extend(inner.operation for inner in op.regions[0].blocks[0].operations)
    found = []
    for op in candidates:
        tag = hextir.kernel_of(op) if op.name in ("func.func", "gpu.func") else None
        if tag is not None and (device is None or tag[0] == device):
            found.append(op)
    return found


def generated_kernels(module: ir.Module, device: str | None = None) -> list[ir.Operation]:
    """The kernels hexir writes the body of (not the declarations of custom kernels)."""
    return [k for k in kernels(module, device) if len(k.regions[0].blocks) > 0]


def location_of(op: ir.Operation) -> str:
    """`file:line:col` of an op, as errors print it."""
    text = str(op.location)
    return text[len("loc("):-1].strip('"').replace('":', ":") if text.startswith("loc(") else text


def walk(root: ir.Operation, *names: str) -> list[ir.Operation]:
    """Every op named one of `names` inside `root` (pre-order), collected before any is changed."""
    found: list[ir.Operation] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name in names:
            found.append(op)
        return ir.WalkResult.ADVANCE

    root.walk(visit, ir.WalkOrder.PRE_ORDER)
    return found
