"""cpu kernels of the pointwise and reduce families (the same shape as `cuda_families.py`).

pointwise: out[i...] = tree(in0[i...], in1[i...], ...), each input read at the output's index
with numpy's broadcasting (an axis of extent 1, or one it lacks, read at 0). Every axis but
the last is one flat `parallel` loop (split across host threads, a chunk at least
`CHUNK_ELEMENTS` elements: a [1, seq, D] tensor uses every core), the last serial inside.

reduce: for each row (every index of the input but the reduced axis, one flat `parallel`
loop), each reduction of the program is one pass along the row, its tree computed per
element and accumulated (sum, max, argmax); then the output: one element per row (sum, argmax:
keepdims or not alike, the same memory) or one per element (softmax, layer_norm), the tree
given the row's reductions. float32 sums accumulate in float64 (one pass, no pairwise tree).
Along the last axis a sum or max runs LANES elements at a time first (a vector accumulator:
the tree's math vectorised, which LLVM cannot do across a scalar loop-carried sum without
reassociating it), its lanes added up at the end, then the elements left one by one.
Both compute in `emit.compute_type` of their buffers: 16-bit inputs are widened to float32
after each load and the output narrowed before each store.

    for i in [0, rows) parallel
      r0 = max_j x[i, j]; r1 = sum_j exp(x[i, j] - r0)      (softmax)
      for j: out[i, j] = exp(x[i, j] - r0) / r1
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from hexir_runtime.format import exprs, scalars
from mlir import ir
from mlir.dialects import arith, vector

from hexir.dialects import hextir as ht
from hexir.schedules import Request, broadcast_indices, extent
from hexir.schedules.cpu_attention import batch_coordinates, product
from hexir.schedules.emit import compute_type, constant, convert, emit

CHUNK_ELEMENTS = 16384  # the least a thread's chunk holds: smaller chunks cost more to hand out than to compute
#: The lanes of a vectorised reduction (sum, max) along the last axis: 4 independent AVX2 sums in
#: float64 for float32 (at 4 ns per element, a softmax's scalar sum of exps was 0.5x numpy's).
LANES = 16


def _grain(inner: int) -> int:
    return max(1, -(-CHUNK_ELEMENTS // max(inner, 1)))


def _static_product(buffer: ir.Value, axes: Sequence[int]) -> int:
    shape = ir.MemRefType(buffer.type).shape
    return math.prod(shape[axis] if shape[axis] >= 0 else 1 for axis in axes)


def _rows(extents: Sequence[exprs.Expr], symbols: dict[str, ir.Value]) -> tuple[exprs.Expr, Callable]:
    """One parallel loop over every index of `extents` (row-major): its trip count, and a function
    from its induction variable to the index."""
    return product(extents), lambda position: batch_coordinates(position, [ht.size_value(e, symbols) for e in extents])


def pointwise(args: Sequence[ir.Value], symbols: dict[str, ir.Value], request: Request) -> ht.Work:
    *inputs, out = args
    rank, kind = ir.MemRefType(out.type).rank, compute_type(*(a.type for a in args))
    stored = ir.MemRefType(out.type).element_type
    outer, unflatten = _rows([extent(out, a, request) for a in range(rank - 1)], symbols)
    with ht.loop(0, ht.size_value(outer, symbols) if rank > 1 else ht.size_value(extent(out, 0, request), symbols),
                 "parallel") as row:
        def store(indices: list[ir.Value]) -> None:
            values = [ht.load(x, broadcast_indices(x, indices)) for x in inputs]
            ht.store(convert(emit(request.expr, values, type_=kind), stored), out, indices)

        if rank == 1:
            store([row])
        else:
            lead = unflatten(row)
            with ht.loop(0, ht.size_value(extent(out, rank - 1, request), symbols), "serial") as j:
                store([*lead, j])
    if rank == 1:
        return ht.Work(extent(out, 0, request), _grain(1))
    return ht.Work(outer, _grain(_static_product(out, [rank - 1])))


def _initial(kind: str, type_: ir.Type) -> list[ir.Value]:
    if kind == "sum":
        return [constant(0.0, type_)]
    start = [constant(float("-inf"), type_)]
    return start if kind == "max" else [*start, arith.ConstantOp(ir.IntegerType.get_signless(64), 0).result]


def combine(kind: str, acc: list[ir.Value], value: ir.Value, position: ir.Value | None) -> list[ir.Value]:
    """One element into a running reduction: + (in the accumulator's type), numpy's max (NaN
    wins), argmax (the first largest, the first NaN: numpy's)."""
    if kind == "sum":
        if value.type != acc[0].type:
            value = arith.ExtFOp(acc[0].type, value).result
        return [arith.AddFOp(acc[0], value).result]
    if kind == "max":
        return [arith.MaximumFOp(acc[0], value).result]
    best, where = acc
    better = arith.OrIOp(arith.CmpFOp(arith.CmpFPredicate.OGT, value, best).result,
                         arith.AndIOp(arith.CmpFOp(arith.CmpFPredicate.UNO, value, value).result,
                                      arith.CmpFOp(arith.CmpFPredicate.ORD, best, best).result).result).result
    index = arith.IndexCastOp(ir.IntegerType.get_signless(64), position).result
    return [arith.SelectOp(better, value, best).result, arith.SelectOp(better, index, where).result]


def result(kind: str, acc: list[ir.Value], type_: ir.Type) -> ir.Value:
    """A finished reduction as the program's trees see it: the sum in the dtype, the argmax's index."""
    if kind == "sum" and acc[0].type != type_:
        return arith.TruncFOp(type_, acc[0]).result
    return acc[-1] if kind == "argmax" else acc[0]


def accumulate(kind: str, tree: scalars.Tree, at: Callable, reds: list[ir.Value], length_value: ir.Value,
               element: ir.Type) -> Callable[[ir.Value, list[ir.Value]], list[ir.Value]]:
    """A reduction's step along a row (ht.fold's body): the tree at position j (`at(j)`: the
    inputs there) combined into the accumulator."""
    return lambda j, acc: combine(kind, acc, emit(tree, at(j), reds, length_value, element), j)


def accumulator(kind: str, type_: ir.Type) -> ir.Type:
    return ir.F64Type.get() if kind == "sum" and isinstance(type_, ir.F32Type) else type_


def reduce(args: Sequence[ir.Value], symbols: dict[str, ir.Value], request: Request) -> ht.Work:
    *inputs, out = args
    program: scalars.Program = request.expr
    x, axis = inputs[0], program.axis
    rank = ir.MemRefType(x.type).rank
    element = compute_type(*(a.type for a in args))
    stored = ir.MemRefType(out.type).element_type
    others = [a for a in range(rank) if a != axis]
    length = ht.size_value(extent(x, axis, request), symbols)
    length_value = arith.UIToFPOp(element, arith.IndexCastOp(ir.IntegerType.get_signless(64), length).result).result
    in_lanes = axis == rank - 1 and all(kind != "argmax" for kind, _ in program.reductions)  # (floats only)

    def row(indices: dict[int, ir.Value]) -> None:
        def at(position: ir.Value) -> list[ir.Value]:
            full = [indices[a] if a != axis else position for a in range(rank)]
            return [ht.load(v, broadcast_indices(v, full)) for v in inputs]

        reds: list[ir.Value] = []
        for kind, tree in program.reductions:
            start, begin = _initial(kind, accumulator(kind, element)), ht.index(0)
            if in_lanes:
                start, begin = _lanes(kind, tree, inputs, [indices[a] for a in others], reds, length_value,
                                      element, length)
            reds.append(result(kind, ht.fold(begin, length, 1, start,
                                             accumulate(kind, tree, at, reds, length_value, element)), element))
        if program.rows:
            kept = [indices[a] for a in others]
            if ir.MemRefType(out.type).rank == rank:  # keepdims
                kept.insert(axis, ht.index(0))
            ht.store(convert(emit(program.out, [], reds, length_value, element), stored), out, kept)
            return
        with ht.loop(0, length, "serial") as j:
            full = [indices[a] if a != axis else j for a in range(rank)]
            ht.store(convert(emit(program.out, at(j), reds, length_value, element), stored), out, full)

    if not others:  # one row: a parallel loop of one iteration
        with ht.loop(0, 1, "parallel"):
            row({})
        return ht.Work(1)
    rows, unflatten = _rows([extent(x, a, request) for a in others], symbols)
    with ht.loop(0, ht.size_value(rows, symbols), "parallel") as position:
        row(dict(zip(others, unflatten(position), strict=True)))
    return ht.Work(rows, _grain(_static_product(x, [axis]) * len(program.reductions)))


def _lanes(kind: str, tree, inputs: Sequence[ir.Value], lead: list[ir.Value], reds: list[ir.Value],
           length_value: ir.Value, element: ir.Type, length: ir.Value) -> tuple[list[ir.Value], ir.Value]:
    """A sum or max along a row's last axis over its first LANES-multiple elements, a vector of
    LANES at a time (an input with one element on the axis read once and broadcast): the
    reduction so far and where the scalar loop takes over."""
    acc_type = ir.VectorType.get([LANES], accumulator(kind, element))
    end = arith.SubIOp(length, arith.RemUIOp(length, ht.index(LANES)).result).result

    def step(j: ir.Value, acc: list[ir.Value]) -> list[ir.Value]:
        values = []
        for v in inputs:
            at = broadcast_indices(v, [*lead, j])
            memory = ir.MemRefType(v.type)
            if memory.rank and memory.shape[-1] != 1:
                values.append(vector.LoadOp(ir.VectorType.get([LANES], memory.element_type), v, at).result)
            else:
                values.append(vector.BroadcastOp(ir.VectorType.get([LANES], memory.element_type),
                                                 ht.load(v, at)).result)
        spread = ir.VectorType.get([LANES], element)
        value = emit(tree, values, [vector.BroadcastOp(spread, r).result for r in reds],
                     vector.BroadcastOp(spread, length_value).result, element)
        return combine(kind, acc, value, None)
    walk = ht.fold(ht.index(0), end, ht.index(LANES), [constant(0.0 if kind == "sum" else float("-inf"), acc_type)],
                   step)
    combined = vector.CombiningKind.ADD if kind == "sum" else vector.CombiningKind.MAXIMUMF
    return [vector.ReductionOp(acc_type.element_type, combined, walk[0]).result], end
