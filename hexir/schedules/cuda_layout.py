"""cuda kernels of the layout family (the same shape as `cpu_layout.py`): one flat axis over the
output, blocks of LAYOUT_BLOCK threads, a thread per element: its position's coordinates give
the source index the record says (`cpu_layout.source`: transpose, slice, concat, take, its ids
clamped as on the cpu); a reshape copies position to position.

    out[p] = x[source(coordinates(p))]      p = blockIdx.x * 256 + threadIdx.x < count
"""

from __future__ import annotations

from collections.abc import Sequence

from hexir_runtime.format import exprs
from mlir import ir
from mlir.dialects import arith

from hexir.dialects import hextir as ht
from hexir.schedules import Request, extent
from hexir.schedules.cpu_attention import batch_coordinates
from hexir.schedules.cpu_layout import source, total
from hexir.schedules.cuda_families import _flat

LAYOUT_BLOCK = 256


def layout(args: Sequence[ir.Value], symbols: dict[str, ir.Value], request: Request) -> ht.Launch:
    *inputs, out = args
    record = request.expr
    rank = ir.MemRefType(out.type).rank
    count_expr = total(out, request)
    blocks = exprs.ceildiv(count_expr, LAYOUT_BLOCK)
    count = ht.size_value(count_expr, symbols)
    out_flat = _flat(out, count_expr)
    source_flat = _flat(inputs[0], count_expr) if record["kind"] == "reshape" else None
    with ht.loop(0, ht.size_value(blocks, symbols), "parallel", "blockIdx.x") as block, \
            ht.loop(0, LAYOUT_BLOCK, "parallel", "threadIdx.x") as thread:
        position = arith.AddIOp(arith.MulIOp(block, ht.index(LAYOUT_BLOCK)).result, thread).result
        with ht.when(arith.CmpIOp(arith.CmpIPredicate.ult, position, count).result):
            if source_flat is not None:
                value = ht.load(source_flat, [position])
            else:
                at = batch_coordinates(position, [ht.size_value(extent(out, a, request), symbols) for a in range(rank)])
                value = source(record, inputs, at, symbols, request)
            ht.store(value, out_flat, [position])
    return ht.Launch((blocks, 1, 1), (LAYOUT_BLOCK, 1, 1))
