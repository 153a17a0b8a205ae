"""What several passes need: where an op is, and the ops of a kind inside another."""

from __future__ import annotations

from mlir import ir


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
