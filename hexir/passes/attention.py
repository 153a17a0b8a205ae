"""attention: `softmax(q @ kᵀ ⊙ mask) @ v` becomes one `hexir.attention` op (ops/attention.py).

Input: a fused hexir module (run by fuse.fuse last: the scale and the mask are already the
scores' matmul's epilogue). Output: for each softmax over the last axis whose operand is a
matmul of q and a transpose swapping k's last two axes, whose result is operand a of a matmul
with v (no epilogue of its own), all on one device, the scores and the weights used by nothing
else, with static head sizes of at most MAX_HEAD and at most one epilogue input (the mask):
one attention op of q, k (the transpose's operand: its rows are read, the transpose is not
made unless something else uses it), v and the mask, the scores' epilogue its own. Anything
else is left as it is.

    %kt = "hexir.transpose"(%k) {expr = {kind: transpose, perm: [0, 1, 3, 2]}}
    %s = "hexir.matmul"(%q, %kt, %mask) {hexir.epilogue = "a0 * 0.125 + a1"}
    %p = "hexir.softmax"(%s) {expr = <softmax over axis 3>}
    %o = "hexir.matmul"(%p, %v)
  =>
    %o = "hexir.attention"(%q, %k, %v, %mask) {hexir.epilogue = "a0 * 0.125 + a1"}
"""

from __future__ import annotations

from mlir import ir

from hexir import ops
from hexir.dialects import hexir as hx
from hexir.ops import scalar

#: The largest head size (D, Dv) fused: the kernels hold a row of q and Dv sums per query row in
#: registers and unroll D; past this the three unfused kernels are the better choice.
MAX_HEAD = 256


def fuse_attention(module: ir.Module) -> None:
    for op in list(hx.main_function(module).regions[0].blocks[0].operations):
        if ops.family_of(op.operation) == "reduce":
            _fuse(op.operation)


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
    with ir.InsertionPoint(combine), combine.location:
        result = hx.compute("attention", [q, k, v, *mask], combine.result.type, device,
                            groups=[1, 1, 1, len(mask)])
    fused = _owner(result)
    tree = hx.expr_of(scores)
    if tree is not None:
        hx.set_expr(fused, tree, hx.EPILOGUE)
    combine.result.replace_all_uses_with(result)
    for op in (combine, softmax, scores):
        op.erase()
    if not list(transpose.result.uses):
        transpose.erase()
