"""fuse: chains of element-wise ops become one kernel, by family (no op is known by name).

Input: a partitioned hexir module. Output, walking the program in order, for ops on one
device whose producer has no other user:
- a pointwise op of one tensor operand after a contract (linear, matmul) becomes the linear's
  epilogue (`hexir.epilogue`: its tree over the linear's sums, bias added), applied as each
  result is stored: no intermediate buffer, one pass over memory fewer;
- a pointwise op absorbs the pointwise ops producing its operands (of its own shape): their
  trees are substituted into its own, their operands become its operands (up to
  MAX_CALL_ARGS), so any chain of element-wise ops is one kernel;
- a reduce op absorbs the pointwise op producing its first operand (softmax(x * 0.5 + m)):
  the prologue's tree is substituted into each of the program's trees;
- then softmax(q @ kᵀ ...) @ v becomes one attention op (passes/attention.py).
A value used by anything else (a print, a second op, the return) or on another device (the
transfer needs it) is left alone; so is a fusion that would change the dtype an op computes
in (float64 vs float32: 16-bit ones compute in float32), and an epilogue whose dtypes are not
the contract's.

    %y = "hexir.linear"(%x, %w) {device = "cuda"}        %y = "hexir.linear"(%x, %w) {device = "cuda",
    %g = "hexir.gelu"(%y) {expr = <gelu of a0>}    =>         hexir.epilogue = <gelu of a0>}
    %s = "hexir.add"(%g, %r) {expr = "a0 + a1"}          %s = "hexir.add"(%y, %r) {expr = "a0 + a1"}
"""

from __future__ import annotations

import json

from hexir_runtime.format import scalars
from hexir_runtime.format.families import compute_dtype
from mlir import ir

from hexir import ops
from hexir.dialects import hexir as hx
from hexir.passes.attention import fuse_attention


def fuse(module: ir.Module) -> None:
    for op in list(hx.main_function(module).regions[0].blocks[0].operations):
        family = ops.family_of(op.operation)
        if family == "pointwise" and not _into_contract(op.operation):
            _absorb_producers(op.operation)
        elif family == "reduce":
            _absorb_prologue(op.operation)
    fuse_attention(module)  # last: the scores' scale and mask are their matmul's epilogue by then


def _producer(value: ir.Value, user: ir.Operation, family: str) -> ir.Operation | None:
    """The op of `family` making `value` on `user`'s device, if `user` is its only user."""
    owner = value.owner
    if isinstance(owner, ir.Block):
        return None
    owner = owner.operation if hasattr(owner, "operation") else owner
    if ops.family_of(owner) != family or hx.device_of(owner) != hx.device_of(user):
        return None
    return owner if all(use.owner == user for use in value.uses) else None


def _into_contract(op: ir.Operation) -> bool:
    """A pointwise op reading a linear's result (its only user) becomes the linear's epilogue;
    its other operands (a residual, a scale of the same shape) become the epilogue's inputs."""
    operands = list(op.operands)
    found = [v for v in operands if _producer(v, op, "contract") is not None]
    if len({hash(v) for v in found}) != 1 or hx.shape_of(found[0].type) != hx.shape_of(op.result.type):
        return False
    linear = _producer(found[0], op, "contract")
    if any(hx.dtype_of(v.type) != hx.dtype_of(linear.result.type) for v in (*operands, op.result)):
        return False  # a contract's args have one dtype (a cast after it is a kernel of its own)
    definition = ops.lookup(linear.name)
    groups, named = hx.operand_groups(linear), len(definition.operands)
    inputs = [v for g in groups[named:] for v in g]
    others = [v for v in dict.fromkeys(operands) if v != found[0] and v not in inputs]
    if len(inputs) + len(others) > definition.epilogue_inputs or (definition.rows and not all(
            rows_alike(hx.shape_of(v.type), hx.shape_of(op.result.type)) for v in others)):
        return False
    inputs += others
    before = hx.expr_of(linear) or ["arg", 0]
    tree = scalars.substitute(hx.expr_of(op), [before if v == found[0] else ["arg", 1 + inputs.index(v)]
                                               for v in operands])
    with ir.InsertionPoint(op), op.location:  # at the pointwise op: its other operands exist there
        sizes = [len(g) for g in groups[:named]] + [1] * len(inputs) + [0] * (definition.epilogue_inputs - len(inputs))
        result = hx.compute(linear.name.removeprefix("hexir."), [v for g in groups[:named] for v in g] + inputs,
                            op.result.type, hx.device_of(linear), groups=sizes)
    fused = result.owner.operation if hasattr(result.owner, "operation") else result.owner
    hx.set_expr(fused, tree, hx.EPILOGUE)
    op.result.replace_all_uses_with(result)
    op.erase()
    linear.erase()
    return True


def rows_alike(shape: hx.Shape, out: hx.Shape) -> bool:
    """Whether a linear's epilogue can read `shape` (broadcast to its `out`) as the kernel sees
    its output, rows of the last axis (lower-to-tir views x[..., K] as [rows, K]): its leading
    axes are all of out's, or all 1."""
    lead, out_lead = shape[:-1], out[:-1]
    return len(out) <= 2 or all(d == 1 for d in lead) or tuple(lead) == tuple(out_lead)


def _renumber(tree: scalars.Tree, operands: list[ir.Value], merged: list[ir.Value]) -> scalars.Tree:
    return scalars.substitute(tree, [["arg", merged.index(v)] for v in operands])


def _absorb_producers(op: ir.Operation) -> None:
    changed = True
    while changed:
        changed = False
        operands, tree = list(op.operands), hx.expr_of(op)
        for position, value in enumerate(operands):
            producer = _producer(value, op, "pointwise")
            if producer is None or hx.shape_of(value.type) != hx.shape_of(op.result.type):
                continue
            inner = list(producer.operands)
            merged = list(dict.fromkeys([*(v for v in operands[:position] if v != value), *inner,
                                         *(v for v in operands[position + 1:] if v != value)]))
            if len(merged) > hx.MAX_CALL_ARGS or not _same_compute(op, producer, merged):
                continue
            made = _renumber(hx.expr_of(producer), inner, merged)
            args = [made if v == value else ["arg", merged.index(v)] for v in operands]
            op = _rebuilt(op, merged, scalars.substitute(tree, args))
            producer.erase()
            changed = True
            break


def _absorb_prologue(op: ir.Operation) -> None:
    operands = list(op.operands)
    producer = _producer(operands[0], op, "pointwise")
    if producer is None:
        return
    full = hx.shape_of(operands[0].type)
    inner = sorted(producer.operands, key=lambda v: hx.shape_of(v.type) != full)  # the reduced one first
    if hx.shape_of(inner[0].type) != full:
        return  # no operand of the prologue has the reduced shape: the kernel's first input must
    merged = list(dict.fromkeys([*inner, *operands[1:]]))
    if len(merged) > hx.MAX_CALL_ARGS or not _same_compute(op, producer, merged):
        return
    args = [_renumber(hx.expr_of(producer), list(producer.operands), merged),
            *(["arg", merged.index(v)] for v in operands[1:])]
    program = hx.expr_of(op)
    reductions = [[kind, scalars.substitute(tree, args)] for kind, tree in program["reductions"]]
    program = {**program, "reductions": reductions, "out": scalars.substitute(program["out"], args)}
    _rebuilt(op, merged, program)
    producer.erase()


def _same_compute(op: ir.Operation, producer: ir.Operation, merged: list[ir.Value]) -> bool:
    """Whether `op` with `producer` folded in (its operands `merged`) computes in the dtype each
    computed in alone (families.compute_dtype: a cast from float32 to float64 stays apart from
    the float64 ops after it, which would otherwise see float32 inputs)."""
    def dtype(values: list[ir.Value], result: ir.Value) -> str:
        return compute_dtype([hx.dtype_of(v.type) for v in (*values, result)])
    alone = dtype(list(op.operands), op.result)
    return alone == dtype(list(producer.operands), producer.result) == dtype(merged, op.result)


def _rebuilt(op: ir.Operation, operands: list[ir.Value], expr: object) -> ir.Operation:
    """`op` with new operands and expr (its operand count may change: a new op in its place)."""
    with ir.InsertionPoint(op), op.location:
        result = hx.compute(op.name.removeprefix("hexir."), operands, op.result.type, hx.device_of(op),
                            json.dumps(expr, separators=(",", ":")))
    op.result.replace_all_uses_with(result)
    op.erase()
    return result.owner.operation if hasattr(result.owner, "operation") else result.owner
