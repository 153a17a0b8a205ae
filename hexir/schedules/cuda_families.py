"""cuda kernels of the pointwise and reduce families (the same shape as `cpu_families.py`).

pointwise: one flat axis over the output, blocks of POINTWISE_BLOCK threads, a thread per
element; an input of the output's shape is read at the flat position, a broadcast one at the
index the position's coordinates give it (numpy's rules).

reduce: a block of up to REDUCE_BLOCK threads per row. For each reduction of the program the
threads walk the row in strides (thread t: elements t, t + T, ...), then combine their partial
results through shared memory in a tree (argmax keeps the first index of the largest, as
numpy); the output is written by thread 0 (per row) or by all of them in strides (per element).
"""

from __future__ import annotations

from collections.abc import Sequence

from hexir_runtime.format import exprs, scalars
from mlir import ir
from mlir.dialects import arith, memref, scf

from hexir.dialects import hextir as ht
from hexir.schedules import Request, broadcast_indices, extent
from hexir.schedules.cpu_families import _initial, accumulator, combine, result
from hexir.schedules.emit import emit

POINTWISE_BLOCK = 256
REDUCE_BLOCK = 256


def _coordinates(position: ir.Value, extents: Sequence[ir.Value]) -> list[ir.Value]:
    """The index of the flat (row-major) `position` in a tensor of `extents`."""
    coordinates = []
    for extent_here in reversed(extents[1:]):
        coordinates.append(arith.RemUIOp(position, extent_here).result)
        position = arith.DivUIOp(position, extent_here).result
    return [position, *reversed(coordinates)]


def _flat(buffer: ir.Value, total: exprs.Expr) -> ir.Value:
    shaped = ir.MemRefType(buffer.type)
    if shaped.rank == 1:
        return buffer
    flat_type = ir.MemRefType.get([ir.ShapedType.get_dynamic_size() if not isinstance(total, int) else total],
                                  shaped.element_type)
    reassociation = ir.ArrayAttr.get([ir.ArrayAttr.get(
        [ir.IntegerAttr.get(ir.IntegerType.get_signless(64), d) for d in range(shaped.rank)])])
    return memref.CollapseShapeOp(flat_type, buffer, reassociation).result


def pointwise(args: Sequence[ir.Value], symbols: dict[str, ir.Value], request: Request) -> ht.Launch:
    *inputs, out = args
    rank = ir.MemRefType(out.type).rank
    extents = [extent(out, axis, request) for axis in range(rank)]
    total: exprs.Expr = 1
    for e in extents:
        total = exprs.mul(total, e)
    blocks = exprs.ceildiv(total, POINTWISE_BLOCK)
    count = ht.size_value(total, symbols)
    flat_out = _flat(out, total)
    same = [ir.MemRefType(x.type).shape == ir.MemRefType(out.type).shape for x in inputs]
    flat_inputs = [_flat(x, total) if s else None for x, s in zip(inputs, same, strict=True)]
    with ht.loop(0, ht.size_value(blocks, symbols), "parallel", "blockIdx.x") as block, \
            ht.loop(0, POINTWISE_BLOCK, "parallel", "threadIdx.x") as thread:
        position = arith.AddIOp(arith.MulIOp(block, ht.index(POINTWISE_BLOCK)).result, thread).result
        guard = scf.IfOp(arith.CmpIOp(arith.CmpIPredicate.ult, position, count).result)
        with ir.InsertionPoint(guard.then_block):
            coordinates = None if all(same) else _coordinates(position, [ht.size_value(e, symbols) for e in extents])
            values = [ht.load(flat, [position]) if flat is not None else ht.load(x, broadcast_indices(x, coordinates))
                      for x, flat in zip(inputs, flat_inputs, strict=True)]
            ht.store(emit(request.expr, values), flat_out, [position])
            scf.YieldOp([])
    return ht.Launch((blocks, 1, 1), (POINTWISE_BLOCK, 1, 1))


def _threads(length: exprs.Expr) -> int:
    threads = 32
    while threads < REDUCE_BLOCK and (not isinstance(length, int) or threads < length):
        threads *= 2
    return threads


def _strided(start: ir.Value, end: ir.Value, step: int, initial: list[ir.Value]) -> scf.ForOp:
    walk = scf.ForOp(start, end, ht.index(step), initial)
    walk.operation.attributes[ht.SCHEDULE] = ht.schedule("serial")
    return walk


def _combine_partials(kind: str, mine: list[ir.Value], other: list[ir.Value]) -> list[ir.Value]:
    """Two threads' partial results: a later thread's argmax may hold an earlier index."""
    if kind != "argmax":
        return combine(kind, mine, other[0], None) if kind == "max" else [arith.AddFOp(mine[0], other[0]).result]
    (v1, i1), (v2, i2) = mine, other
    nan1 = arith.CmpFOp(arith.CmpFPredicate.UNO, v1, v1).result
    nan2 = arith.CmpFOp(arith.CmpFPredicate.UNO, v2, v2).result
    tie = arith.OrIOp(arith.CmpFOp(arith.CmpFPredicate.OEQ, v1, v2).result, arith.AndIOp(nan1, nan2).result).result
    better = arith.OrIOp(
        arith.OrIOp(arith.CmpFOp(arith.CmpFPredicate.OGT, v2, v1).result,
                    arith.AndIOp(nan2, arith.XOrIOp(nan1, arith.ConstantOp(nan1.type, 1).result).result).result).result,
        arith.AndIOp(tie, arith.CmpIOp(arith.CmpIPredicate.slt, i2, i1).result).result).result
    return [arith.SelectOp(better, v2, v1).result, arith.SelectOp(better, i2, i1).result]


def _block_reduce(kind: str, partial: list[ir.Value], thread: ir.Value, threads: int) -> list[ir.Value]:
    """Every thread's `partial` combined, the result read by all threads."""
    shared = [ht.alloc_local([threads], value.type, "shared") for value in partial]
    for buffer, value in zip(shared, partial, strict=True):
        ht.store(value, buffer, [thread])
    step = threads // 2
    while step:
        ht.barrier()
        inside = scf.IfOp(arith.CmpIOp(arith.CmpIPredicate.ult, thread, ht.index(step)).result)
        with ir.InsertionPoint(inside.then_block):
            partner = arith.AddIOp(thread, ht.index(step)).result
            mine = [ht.load(b, [thread]) for b in shared]
            other = [ht.load(b, [partner]) for b in shared]
            for buffer, value in zip(shared, _combine_partials(kind, mine, other), strict=True):
                ht.store(value, buffer, [thread])
            scf.YieldOp([])
        step //= 2
    ht.barrier()
    return [ht.load(b, [ht.index(0)]) for b in shared]


def reduce(args: Sequence[ir.Value], symbols: dict[str, ir.Value], request: Request) -> ht.Launch:
    *inputs, out = args
    program: scalars.Program = request.expr
    x, axis = inputs[0], program.axis
    rank = ir.MemRefType(x.type).rank
    element = ir.MemRefType(x.type).element_type
    others = [a for a in range(rank) if a != axis]
    rows: exprs.Expr = 1
    for a in others:
        rows = exprs.mul(rows, extent(x, a, request))
    length_expr = extent(x, axis, request)
    threads = _threads(length_expr)
    with ht.loop(0, ht.size_value(rows, symbols), "parallel", "blockIdx.x") as block, \
            ht.loop(0, threads, "parallel", "threadIdx.x") as thread:
        length = ht.size_value(length_expr, symbols)
        length_value = arith.UIToFPOp(element, arith.IndexCastOp(ir.IntegerType.get_signless(64), length).result).result
        kept = _coordinates(block, [ht.size_value(extent(x, a, request), symbols) for a in others]) if others else []
        where = dict(zip(others, kept, strict=True))

        def at(j: ir.Value) -> list[ir.Value]:
            full = [where[a] if a != axis else j for a in range(rank)]
            return [ht.load(v, broadcast_indices(v, full)) for v in inputs]

        reds: list[ir.Value] = []
        for kind, tree in program.reductions:
            walk = _strided(thread, length, threads, _initial(kind, accumulator(kind, element)))
            with ir.InsertionPoint(walk.body):
                j = walk.induction_variable
                value = emit(tree, at(j), reds, length_value, element)
                scf.YieldOp(combine(kind, list(walk.inner_iter_args), value, j))
            reds.append(result(kind, _block_reduce(kind, list(walk.results), thread, threads), element))
        if program.rows:
            first = scf.IfOp(arith.CmpIOp(arith.CmpIPredicate.eq, thread, ht.index(0)).result)
            with ir.InsertionPoint(first.then_block):
                index = list(kept)
                if ir.MemRefType(out.type).rank == rank:  # keepdims
                    index.insert(axis, ht.index(0))
                ht.store(emit(program.out, [], reds, length_value, element), out, index)
                scf.YieldOp([])
        else:
            walk = _strided(thread, length, threads, [])
            with ir.InsertionPoint(walk.body):
                j = walk.induction_variable
                ht.store(emit(program.out, at(j), reds, length_value, element), out,
                         [where[a] if a != axis else j for a in range(rank)])
                scf.YieldOp([])
    return ht.Launch((rows, 1, 1), (threads, 1, 1))
