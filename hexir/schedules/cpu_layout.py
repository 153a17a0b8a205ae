"""cpu kernels of the layout family (the same shape as `cuda_layout.py`): one copy kernel per
op, out[i] = in[source(i)], the source index given by the op's record
(hexir_runtime/format/layouts.py). The output's outer axis is `parallel` (chunks of at least
`CHUNK_ELEMENTS` elements), the others serial, innermost last, so every kernel writes out in
order and reads its inputs contiguously wherever the record keeps their last axis (a slice of
step 1 there, a concat along another axis, a take's rows); a reshape is one flat copy.

    transpose [2, 3] -> [3, 2], perm [1, 0]:
      for i in [0, 3) parallel
        for j in [0, 2): out[i, j] = x[j, i]

A take clamps each id into [0, V) before it reads the table: the runtime checks the ids before
the call (an id out of range is an error naming the input), and the clamp makes the kernel
safe by itself.
"""

from __future__ import annotations

from collections.abc import Sequence

from hexir_runtime.format import exprs
from mlir import ir
from mlir.dialects import arith, memref

from hexir.dialects import hextir as ht
from hexir.schedules import Request, extent
from hexir.schedules.cpu_families import CHUNK_ELEMENTS, _grain, _static_product


def total(buffer: ir.Value, request: Request) -> exprs.Expr:
    """The element count of `buffer` as a size expression."""
    return exprs.product(extent(buffer, axis, request) for axis in range(ir.MemRefType(buffer.type).rank))


def flat(buffer: ir.Value, count: exprs.Expr, symbols: dict[str, ir.Value]) -> ir.Value:
    """`buffer` viewed as one axis of `count` elements (buffers are contiguous, row-major)."""
    shaped = ir.MemRefType(buffer.type)
    if shaped.rank == 1:
        return buffer
    static = count if isinstance(count, int) else ir.ShapedType.get_dynamic_size()
    sizes = [] if isinstance(count, int) else [ht.size_value(count, symbols)]
    return memref.ReinterpretCastOp(ir.MemRefType.get([static], shaped.element_type), buffer, [], sizes, [],
                                    static_offsets=[0], static_sizes=[static], static_strides=[1]).result


def source(record: dict, inputs: Sequence[ir.Value], at: list[ir.Value], symbols: dict[str, ir.Value],
           request: Request) -> ir.Value:
    """The element the output holds at index `at` (not for a reshape: that is a flat copy)."""
    kind = record["kind"]
    if kind == "transpose":
        where = [None] * len(at)
        for k, axis in enumerate(record["perm"]):
            where[axis] = at[k]
        return ht.load(inputs[0], where)
    if kind == "slice":
        where = [index if (start, step) == (0, 1) else arith.AddIOp(
            ht.index(start), arith.MulIOp(ht.index(step), index).result).result
            for index, start, step in zip(at, record["start"], record["step"], strict=True)]
        return ht.load(inputs[0], where)
    if kind == "concat":
        return _concat(record["axis"], list(inputs), at, 0)
    table, ids = inputs
    r = ir.MemRefType(ids.type).rank
    rows = ht.size_value(extent(table, 0, request), symbols)
    row = arith.IndexCastOp(ir.IndexType.get(), ht.load(ids, at[:r])).result
    row = arith.MinSIOp(arith.MaxSIOp(row, ht.index(0)).result, arith.SubIOp(rows, ht.index(1)).result).result
    return ht.load(table, [row, *at[r:]])


def _concat(axis: int, inputs: list[ir.Value], at: list[ir.Value], offset: int) -> ir.Value:
    """The element at `at` of the concatenation of `inputs` (the first starting at `offset` along `axis`)."""
    first = inputs[0]
    shifted = list(at)
    if offset:
        shifted[axis] = arith.SubIOp(at[axis], ht.index(offset)).result
    if len(inputs) == 1:
        return ht.load(first, shifted)
    end = offset + ir.MemRefType(first.type).shape[axis]
    element = ir.MemRefType(first.type).element_type
    return ht.choose(arith.CmpIOp(arith.CmpIPredicate.ult, at[axis], ht.index(end)).result,
                     lambda: [ht.load(first, shifted)], lambda: [_concat(axis, inputs[1:], at, end)], [element])[0]


def layout(args: Sequence[ir.Value], symbols: dict[str, ir.Value], request: Request) -> ht.Work:
    *inputs, out = args
    record = request.expr
    if record["kind"] == "reshape":
        count = total(out, request)
        source_flat, out_flat = flat(inputs[0], count, symbols), flat(out, count, symbols)
        with ht.loop(0, ht.size_value(count, symbols), "parallel") as i:
            ht.store(ht.load(source_flat, [i]), out_flat, [i])
        return ht.Work(count, CHUNK_ELEMENTS)
    rank = ir.MemRefType(out.type).rank

    def nest(axis: int, indices: list[ir.Value]) -> None:
        if axis == rank:
            ht.store(source(record, inputs, indices, symbols, request), out, indices)
            return
        with ht.loop(0, ht.size_value(extent(out, axis, request), symbols),
                     "parallel" if axis == 0 else "serial") as index:
            nest(axis + 1, [*indices, index])

    nest(0, [])
    return ht.Work(extent(out, 0, request), _grain(_static_product(out, range(1, rank))))
