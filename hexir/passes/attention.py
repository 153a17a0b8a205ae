"""attention: `softmax(q @ kᵀ ⊙ mask) @ v` becomes one `hexir.attention` op (ops/attention.py).

Input: a fused hexir module (run by fuse.fuse last: the scale and the mask are already the
scores' matmul's epilogue). Output: for each softmax over the last axis whose operand is a
matmul of q and a transpose swapping k's last two axes, whose result is operand a of a matmul
with v (no epilogue of its own), all on one device, the scores and the weights used by nothing
else, with static head sizes of at most MAX_HEAD and at most one epilogue input (the mask):
one attention op of q, k (the transpose's operand: its rows are read, the transpose is not
made unless something else uses it), v and the mask, the scores' epilogue its own. Anything
else is left as it is. Then the transposes, last-axis splits and slices (step >= 1) that made q,
k and v, and the transposes and last-axis merges that its result alone goes through, become
strided views of the buffers they moved (`hexir.views`: {operand: {shape, axes, start}}, the
runtime's format/attention.StridedView, the destination's position after the operands): the
heads of a qkv[b, s, 3 h d] are read in place, the result written as [b, s, h d], no copy.

    %kt = "hexir.transpose"(%k) {expr = {kind: transpose, perm: [0, 1, 3, 2]}}
    %s = "hexir.matmul"(%q, %kt, %mask) {hexir.epilogue = "a0 * 0.125 + a1"}
    %p = "hexir.softmax"(%s) {expr = <softmax over axis 3>}
    %o = "hexir.matmul"(%p, %v)
  =>
    %o = "hexir.attention"(%q, %k, %v, %mask) {hexir.epilogue = "a0 * 0.125 + a1"}

and, q, k, v heads of 4 of a qkv[2, 5, 24] (k at columns 8-15, v at 16-23 likewise):

    %q8 = "hexir.slice"(%qkv) {expr = {kind: slice, start: [0, 0, 0], step: [1, 1, 1]}}  : [2, 5, 8]
    %q4 = "hexir.reshape"(%q8)                                                           : [2, 5, 2, 4]
    %q = "hexir.transpose"(%q4) {expr = {kind: transpose, perm: [0, 2, 1, 3]}}            : [2, 2, 5, 4]
  =>
    %o = "hexir.attention"(%qkv, %qkv, %qkv, %mask) {hexir.views = {"0": {shape: [2, 2, 5, 4],
           axes: [[0, 1], [2, 4], [1, 1], [2, 1]], start: [0, 0, 0]}, "1": {.., start: [0, 0, 8]}, ..}}
"""

from __future__ import annotations

from hexir_runtime.errors import HxbFormatError
from hexir_runtime.format.attention import check_view
from hexir_runtime.format.types import DTYPES, TensorType
from mlir import ir

from hexir import ops
from hexir.dialects import hexir as hx
from hexir.ops import scalar

VIEWS = "hexir.views"
#: The largest head size (D, Dv) fused: the kernels hold a row of q and Dv sums per query row in
#: registers and unroll D; past this the three unfused kernels are the better choice.
MAX_HEAD = 256


def fuse_attention(module: ir.Module) -> None:
    block = hx.main_function(module).regions[0].blocks[0]
    for op in [o.operation for o in block.operations if ops.family_of(o.operation) == "reduce"]:
        _fuse(op)
    for op in reversed([o.operation for o in block.operations]):  # (layout ops read through: a chain's last first)
        if op.name in ("hexir.transpose", "hexir.reshape", "hexir.slice") and not list(op.result.uses):
            op.erase()


def _owner(value: ir.Value) -> ir.Operation | None:
    owner = value.owner
    return None if isinstance(owner, ir.Block) else (owner.operation if hasattr(owner, "operation") else owner)


def _only_user(value: ir.Value) -> ir.Operation | None:
    users = {id(use.owner): use.owner for use in value.uses}
    return next(iter(users.values())) if len(users) == 1 and len(list(value.uses)) == 1 else None


def _is_softmax(op: ir.Operation) -> bool:
    rank = len(hx.shape_of(op.operands[0].type))
    expected = scalar.reduce_program("softmax", ops.REGISTRY["softmax"].function, [scalar.Scalar.arg(0)], rank - 1)
    return len(list(op.operands)) == 1 and hx.expr_of(op) == expected.to_json()


def _fuse(softmax: ir.Operation) -> None:
    device = hx.device_of(softmax)
    scores, combine = _owner(softmax.operands[0]), _only_user(softmax.result)
    if scores is None or combine is None or not _is_softmax(softmax) or _only_user(scores.result) is None:
        return
    if scores.name != "hexir.matmul" or combine.name != "hexir.matmul" or hx.expr_of(combine) is not None:
        return
    q_group, kt_group, *extras = hx.operand_groups(scores)
    weights, v_group, *more = hx.operand_groups(combine)
    mask = [value for group in extras for value in group]
    transpose = _owner(kt_group[0])
    if any(more) or len(mask) > 1 or weights[0] != softmax.result or transpose is None \
            or transpose.name != "hexir.transpose" \
            or {hx.device_of(o) for o in (scores, combine, transpose)} != {device}:
        return
    q, k, v = q_group[0], transpose.operands[0], v_group[0]
    rank = len(hx.shape_of(k.type))
    if hx.expr_of(transpose)["perm"] != [*range(rank - 2), rank - 1, rank - 2] or min(
            len(hx.shape_of(x.type)) for x in (q, v)) < 2 or not all(
            isinstance(hx.shape_of(x.type)[-1], int) and hx.shape_of(x.type)[-1] <= MAX_HEAD for x in (q, v)):
        return
    operands, views, result = [q, k, v, *mask], {}, combine.result
    for position, value in [*enumerate(operands[:3]), (len(operands), result)]:
        record, buffer = _view(value, device, value == combine.result)
        if record is not None:  # (the destination's position: after the operands)
            views[position] = record
            operands[position:position + 1] = [buffer] if position < 3 else []
            result = buffer if position == len(operands) else result
    with ir.InsertionPoint(combine), combine.location:
        fused = _owner(hx.compute("attention", operands, result.type, device, groups=[1, 1, 1, len(mask)]))
    for tree, name in ((hx.expr_of(scores), hx.EPILOGUE), (views or None, VIEWS)):
        if tree is not None:
            hx.set_expr(fused, tree, name)
    result.replace_all_uses_with(fused.result)
    while result != combine.result:  # (the layout ops written through, last first)
        op, result = _owner(result), _owner(result).operands[0]
        op.erase()
    for op in (combine, softmax, scores):
        op.erase()


def _view(value: ir.Value, device: str, written: bool) -> tuple[dict | None, ir.Value]:
    """The view of `value` in the buffer the most layout ops away (those that made it, or,
    `written`, those it alone goes through) that the runtime takes (its check is the contract)
    and, on cuda, whose rows start on 16 bytes as the kernel's copies need: (record, buffer), or
    (None, value)."""
    shape, at, found = hx.shape_of(value.type), value, (None, value)
    view = ([[i, 1] for i in range(len(shape))], [0] * len(shape))
    while (op := _only_user(at) if written else _owner(at)) is not None \
            and (view := _through(op, *view, written)) is not None and hx.device_of(op) == device:
        at = op.result if written else op.operands[0]
        record, extents = {"shape": list(shape), "axes": view[0], "start": view[1]}, hx.shape_of(at.type)
        steps = [view[1][-1], extents[-1], *(c for a, c in view[0][:-1] if a == len(extents) - 1)]
        try:
            check_view(record, TensorType(tuple(extents), hx.dtype_of(at.type)), "view", written)
        except HxbFormatError:
            continue
        if device != "cuda" or all(isinstance(n, int) and n * DTYPES[hx.dtype_of(at.type)] % 16 == 0 for n in steps):
            found = record, at
    return found


def _through(op: ir.Operation, axes: list, start: list, written: bool) -> tuple[list, list] | None:
    """(axes, start) of a view on op's operand, given those on its result, or, `written`, on its
    result given those on its operand; None where op is no transpose, split of the last axis
    (written: merge of the last two) or slice (not written, steps >= 1)."""
    record = hx.expr_of(op) if op.name in ("hexir.transpose", "hexir.reshape", "hexir.slice") else None
    if record is None or op.name == "hexir.slice" and written:
        return None
    shapes = [hx.shape_of(op.operands[0].type), hx.shape_of(op.result.type)]
    if op.name == "hexir.transpose":
        perm = [record["perm"].index(a) for a in range(len(start))] if written else record["perm"]
        return [[perm[a], c] for a, c in axes], [start[perm.index(j)] for j in range(len(start))]
    if op.name == "hexir.slice" and all(isinstance(t, int) and t >= 1 for t in record["step"]):
        return [[a, c * record["step"][a]] for a, c in axes], [
            first + t * s for first, t, s in zip(record["start"], record["step"], start, strict=True)]
    narrow, wide = shapes[::-1] if written else shapes
    last = len(wide) - 1
    if op.name == "hexir.reshape" and len(wide) == len(narrow) + 1 and list(narrow[:-1]) == list(wide[:-2]) \
            and isinstance(wide[-1], int) and narrow[-1] == wide[-2] * wide[-1]:
        return [[min(a, last - 1), c * wide[-1] if a == last - 1 else c] for a, c in axes], \
            [*start[:-2], start[-2] * wide[-1] + start[-1]]
    return None
