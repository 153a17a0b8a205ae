"""cpu attention (ops/attention.py; the same algorithm as cuda_attention.py): out = softmax(
tree(q @ kᵀ, mask)) @ v in one pass over the keys, a running max and sum per query row.

The args are q[..., Sq, D], k[..., Sk, D], v[..., Sk, Dv], the mask?, out[..., Sq, Dv] (each
operand read at its own, broadcast, batch index: an axis of extent 1 at 0). The parallel work
items are (batch index, ROWS query rows). A row walks the keys KEYS at a time: the block's scores
(a vector dot product each, the tree applied) go to a small buffer on the stack, their max
raises the row's running max m, the row's sum l and its Dv sums (a vector in registers) are
rescaled by exp(m_old - m), the block's exp(s - m) are taken as one vector (mathlib's exp: a
scalar exp per key cost as much as the dot products) and added to l, and each, times v's row,
to the sums; out = sums / l. A row whose scores are all -inf keeps m = -inf (its exps taken against 0:
all 0), so it ends 0 / 0 = NaN, as the unfused softmax gives.

    for item in [0, batches * ceil(Sq / ROWS)) parallel
      for i in the item's rows: m = -inf, l = 0, acc[Dv] = 0
        for each KEYS keys: s[j] = tree(q[i] . k[j], mask[i, j]); m' = max(m, max s); c = exp(m - m')
                            l = l c + sum exp(s - m'); acc = acc c + sum exp(s[j] - m') v[j]
        out[i] = acc / l
"""

from __future__ import annotations

from collections.abc import Sequence

from hexir_runtime.format import exprs
from mlir import ir
from mlir.dialects import arith, math, scf, vector

from hexir.dialects import hextir as ht
from hexir.schedules import Request, broadcast_indices, extent
from hexir.schedules.emit import constant, emit

ROWS = 8    # query rows a work item (k and v stay in the cache between them)
KEYS = 64   # scores a row keeps on the stack


def batch_coordinates(flat: ir.Value, extents: Sequence[ir.Value]) -> list[ir.Value]:
    """The index over `extents` (row-major) of the flat index `flat`."""
    coordinates = []
    for size in reversed(list(extents)[1:]):
        coordinates.append(arith.RemUIOp(flat, size).result)
        flat = arith.DivUIOp(flat, size).result
    return [flat, *reversed(coordinates)] if extents else []


def batch_extents(out: ir.Value, request: Request) -> list[exprs.Expr]:
    return [extent(out, d, request) for d in range(ir.MemRefType(out.type).rank - 2)]


def product(extents: Sequence[exprs.Expr]) -> exprs.Expr:
    total: exprs.Expr = 1
    for e in extents:
        total = exprs.mul(total, e)
    return total


def safe_max(m: ir.Value) -> ir.Value:
    """The running max a row's exps are taken against: 0 while every score so far is -inf."""
    ninf = constant(float("-inf"), m.type)
    return arith.SelectOp(arith.CmpFOp(arith.CmpFPredicate.OEQ, m, ninf).result, constant(0.0, m.type), m).result


def _serial(lower: ir.Value, upper: ir.Value, carried: list[ir.Value]) -> scf.ForOp:
    walk = scf.ForOp(ht.index(lower), ht.index(upper), ht.index(1), carried)
    walk.operation.attributes[ht.SCHEDULE] = ht.schedule("serial")
    return walk


def attention(args: Sequence[ir.Value], symbols: dict[str, ir.Value], request: Request) -> ht.Work:
    q, k, v, out, mask = args[0], args[1], args[2], args[-1], (args[3] if len(args) == 5 else None)
    element = ir.MemRefType(out.type).element_type
    d, dv = ir.MemRefType(q.type).shape[-1], ir.MemRefType(v.type).shape[-1]
    batch = batch_extents(out, request)
    sq, sk = extent(out, len(batch), request), extent(k, ir.MemRefType(k.type).rank - 2, request)
    row_blocks = exprs.ceildiv(sq, ROWS)
    items = exprs.mul(product(batch), row_blocks)
    row_type, out_type = ir.VectorType.get([d], element), ir.VectorType.get([dv], element)
    block_type = ir.VectorType.get([KEYS], element)
    with ht.loop(0, ht.size_value(items, symbols), "parallel") as item:
        blocks, rows, keys = (ht.size_value(e, symbols) for e in (row_blocks, sq, sk))
        at = batch_coordinates(arith.DivUIOp(item, blocks).result, [ht.size_value(e, symbols) for e in batch])
        r0 = arith.MulIOp(arith.RemUIOp(item, blocks).result, ht.index(ROWS)).result
        scores = ht.alloc_local([KEYS], element)
        zero = ht.index(0)
        with ht.loop(r0, arith.MinUIOp(arith.AddIOp(r0, ht.index(ROWS)).result, rows).result, "serial") as i:
            query = vector.LoadOp(row_type, q, broadcast_indices(q, [*at, i, zero])).result
            ninf, nothing = constant(float("-inf"), element), constant(0.0, element)
            walk = _serial(zero, arith.CeilDivUIOp(keys, ht.index(KEYS)).result, [ninf, nothing,
                                                                                  constant(0.0, out_type)])
            with ir.InsertionPoint(walk.body):
                m, total, sums = walk.inner_iter_args
                j0 = arith.MulIOp(walk.induction_variable, ht.index(KEYS)).result
                j1 = arith.MinUIOp(arith.AddIOp(j0, ht.index(KEYS)).result, keys).result
                vector.StoreOp(constant(float("-inf"), block_type), scores, [zero])  # (past j1: exp gives 0)
                first = _serial(j0, j1, [m])
                with ir.InsertionPoint(first.body):
                    j = first.induction_variable
                    key = vector.LoadOp(row_type, k, broadcast_indices(k, [*at, j, zero])).result
                    dot = vector.ReductionOp(element, vector.CombiningKind.ADD,
                                             arith.MulFOp(query, key).result).result
                    extra = [ht.load(mask, broadcast_indices(mask, [*at, i, j]))] if mask is not None else []
                    score = emit(request.expr, [dot, *extra]) if request.expr is not None else dot
                    ht.store(score, scores, [arith.SubIOp(j, j0).result])
                    scf.YieldOp([arith.MaximumFOp(first.inner_iter_args[0], score).result])
                top = first.results[0]
                base = safe_max(top)
                scale = math.ExpOp(arith.SubFOp(m, base).result).result
                weights = math.ExpOp(arith.SubFOp(vector.LoadOp(block_type, scores, [zero]).result,
                                                  vector.BroadcastOp(block_type, base).result).result).result
                vector.StoreOp(weights, scores, [zero])  # the block's exps as vectors (mathlib's exp)
                total = arith.AddFOp(arith.MulFOp(total, scale).result,
                                     vector.ReductionOp(element, vector.CombiningKind.ADD, weights).result).result
                second = _serial(j0, j1, [arith.MulFOp(sums, vector.BroadcastOp(out_type, scale).result).result])
                with ir.InsertionPoint(second.body):
                    j = second.induction_variable
                    p = ht.load(scores, [arith.SubIOp(j, j0).result])
                    value = vector.LoadOp(out_type, v, broadcast_indices(v, [*at, j, zero])).result
                    scf.YieldOp([vector.FMAOp(vector.BroadcastOp(out_type, p).result, value,
                                              second.inner_iter_args[0]).result])
                scf.YieldOp([top, total, second.results[0]])
            _, total, sums = walk.results
            result = arith.DivFOp(sums, vector.BroadcastOp(out_type, total).result).result
            vector.StoreOp(result, out, [*at, i, zero])
    per_item = ROWS * (d + dv) * (sk if isinstance(sk, int) else 64)
    return ht.Work(items, max(1, -(-65536 // per_item)))
