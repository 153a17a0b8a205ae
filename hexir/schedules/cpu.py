"""cpu schedules: the outermost loop is `parallel` (the runtime splits its range across host
threads: the kernel's work record says how many iterations it has), the rest `serial`.

linear (x[M,K] @ w[K,N], epilogues bias and fused element-wise ops):

    for each block of ROWS rows, parallel (extent ceildiv(M, ROWS)) {
      out[rows,:] = bias or 0
      for k serial { for i in rows serial { a = x[i,k]
        for j serial { out[i,j] += a * w[k,j] } } }
      out[rows,:] = epilogue(out[rows,:])     (while the rows are still in the cache)
    }
    (the innermost loop walks w and out contiguously, so LLVM vectorizes it; a row of w,
    loaded once, serves the block's rows from the L1 cache)

elementwise (relu, ...): the outermost axis parallel, the others serial.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlir import ir
from mlir.dialects import arith

from hexir import sizes
from hexir.dialects import hextir as ht
from hexir.schedules import Request, extent

#: Rows of `out` a cpu linear computes together: each row of w it loads from memory serves
#: them all from the L1 cache.
ROWS = 4


def _zero(element: ir.Type) -> ir.Value:
    return arith.ConstantOp(element, ir.FloatAttr.get(element, 0.0)).result


def linear(args: Sequence[ir.Value], symbols: dict[str, ir.Value], request: Request) -> ht.Work:
    x, w, out = args[0], args[1], args[-1]
    bias = args[2] if "bias" in request.epilogues else None
    m, k_extent, n = extent(x, 0, request), extent(x, 1, request), extent(w, 1, request)
    element = ir.MemRefType(out.type).element_type
    blocks = sizes.ceildiv(m, ROWS)
    with ht.loop(0, ht.size_value(blocks, symbols), "parallel") as block:
        first = arith.MulIOp(block, ht.index(ROWS)).result
        rows = arith.MinUIOp(ht.index(ROWS), arith.SubIOp(ht.size_value(m, symbols), first).result).result
        with ht.loop(0, rows, "serial") as r, ht.loop(0, n, "serial") as j:
            i = arith.AddIOp(first, r).result
            ht.store(ht.load(bias, [j]) if bias is not None else _zero(element), out, [i, j])
        with ht.loop(0, k_extent, "serial") as k, ht.loop(0, rows, "serial") as r:
            i = arith.AddIOp(first, r).result
            a = ht.load(x, [i, k])
            with ht.loop(0, n, "serial") as j:
                product = arith.MulFOp(a, ht.load(w, [k, j])).result
                ht.store(arith.AddFOp(ht.load(out, [i, j]), product).result, out, [i, j])
        if request.fused():  # the epilogue, while the block's rows are still in the cache
            with ht.loop(0, rows, "serial") as r, ht.loop(0, n, "serial") as j:
                i = arith.AddIOp(first, r).result
                value = ht.load(out, [i, j])
                for apply in request.fused():
                    value = apply(value)
                ht.store(value, out, [i, j])
    return ht.Work(blocks)


def elementwise(args: Sequence[ir.Value], symbols: dict[str, ir.Value], request: Request) -> ht.Work:
    x, out = args
    rank = ir.MemRefType(x.type).rank
    apply = request.scalars[request.op]

    def nest(axis: int, indices: list[ir.Value]) -> None:
        if axis == rank:
            ht.store(apply(ht.load(x, indices)), out, indices)
            return
        bound = ht.size_value(extent(x, axis, request), symbols)
        with ht.loop(0, bound, "parallel" if axis == 0 else "serial") as index:
            nest(axis + 1, [*indices, index])

    nest(0, [])
    return ht.Work(extent(x, 0, request))
