"""cpu matmul (numpy's a @ b between tensors, schedules of the same shape: cuda_matmul.py).

The kernel's args are a, b, the epilogue's inputs, out (ops/matmul.py gives the shapes: a
1-D a is a row, a 1-D b a column, the leading dimensions broadcast). The parallel work items
are (batch index, MR * GROUPS rows): each reads a and b at its own batch index (an operand's
axis of extent 1 read at 0: no operand is copied), and walks its rows MR at a time over
panels of NR columns of out, the micro-kernel of the linear (schedules/cpu.py's MICRO): MR x
NR sums in vector registers through all of K, a vector of b's row k and a broadcast of a[i, k]
a `vector.fma` (float32 sums in float32, as numpy's matmul), then the epilogue, stored once.

    for item in [0, batches * ceil(M / (MR * GROUPS))) parallel
      batch = item / row_tiles; its index in each operand (broadcast)
      for each NR panel of N (then the N % NR columns left: one narrower vector, or, N symbolic,
                              columns one by one)
        for each MR rows of the item's rows (then the rows left, one by one)
          acc[MR] = 0; for k in [0, K): acc[r] = fma(broadcast a[.., i + r, k], b[.., k, panel], acc[r])
          out[.., i + r, panel] = epilogue(acc[r])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hexir_runtime.format import exprs
from mlir import ir
from mlir.dialects import arith, vector

from hexir.dialects import hextir as ht
from hexir.schedules import Request, cpu, extent
from hexir.schedules.cpu import MICRO
from hexir.schedules.cpu_attention import batch_coordinates
from hexir.schedules.emit import compute_type, convert

#: A work item's rows: GROUPS micro-kernels of MR rows (a batch index of a few rows is one item).
GROUPS = 4
#: The least multiply-adds a thread's chunk of items holds (fewer cost more to hand out than to do).
CHUNK_FMAS = 65536


@dataclass(frozen=True)
class Layout:
    """Where each operand is read for out's batch index: a's [batch.., i, k] (a 1-D a: [k]),
    b's [batch.., k, j] (a 1-D b: [k]) and out's [batch.., i, j] (without the axes a 1-D
    operand lacks); batch axes aligned right, an axis of static extent 1 read at 0."""

    a: ir.Value
    b: ir.Value
    out: ir.Value
    batch: tuple  # out's batch extents (size expressions)
    m: exprs.Expr
    k: exprs.Expr
    n: exprs.Expr

    @classmethod
    def of(cls, args: Sequence[ir.Value], request: Request) -> Layout:
        a, b, out = args[0], args[1], args[-1]
        ra, rb, ro = (ir.MemRefType(v.type).rank for v in (a, b, out))
        batch = tuple(extent(out, d, request) for d in range(ro - (ra > 1) - (rb > 1)))
        return cls(a, b, out, batch, extent(a, ra - 2, request) if ra > 1 else 1, extent(a, ra - 1, request),
                   extent(b, rb - 1, request) if rb > 1 else 1)

    def batches(self) -> exprs.Expr:
        return exprs.product(self.batch)

    def coordinates(self, flat: ir.Value, symbols: dict[str, ir.Value]) -> list[ir.Value]:
        """The batch index (out's) of the row-major `flat` one."""
        return batch_coordinates(flat, [ht.size_value(e, symbols) for e in self.batch])

    def _batch_of(self, buffer: ir.Value, batch: list[ir.Value]) -> list[ir.Value]:
        shape = ir.MemRefType(buffer.type).shape
        own = shape[:max(len(shape) - 2, 0)]
        tail = batch[len(batch) - len(own):] if own else []
        return [ht.index(0) if e == 1 else index for e, index in zip(own, tail, strict=True)]

    def at_a(self, batch: list[ir.Value], i: ir.Value, k: ir.Value) -> list[ir.Value]:
        rank = ir.MemRefType(self.a.type).rank
        return [*self._batch_of(self.a, batch), *([i] if rank > 1 else []), k]

    def at_b(self, batch: list[ir.Value], k: ir.Value, j: ir.Value) -> list[ir.Value]:
        rank = ir.MemRefType(self.b.type).rank
        return [*self._batch_of(self.b, batch), k, *([j] if rank > 1 else [])]

    def at_out(self, batch: list[ir.Value], i: ir.Value, j: ir.Value) -> list[ir.Value]:
        rows, columns = (ir.MemRefType(v.type).rank > 1 for v in (self.a, self.b))
        return [*batch, *([i] if rows else []), *([j] if columns else [])]


def _static(e: exprs.Expr) -> int:
    return e if isinstance(e, int) else 1


def linear(args: Sequence[ir.Value], symbols: dict[str, ir.Value], request: Request) -> ht.Work:
    """A linear: cpu.py's; on 16-bit operands (only the cpu twin of a cuda linear that takes them:
    schedules/cuda.py native_16bit; widen gives the others float32) this file's micro-kernel
    over x[rows, K] @ w[K, N], in float32, the bias added before the epilogue."""
    if request.dtype in ("bfloat16", "float16"):
        return matmul(args, symbols, request)
    return cpu.linear(args, symbols, request)


def matmul(args: Sequence[ir.Value], symbols: dict[str, ir.Value], request: Request) -> ht.Work:
    request = request.with_args(args)
    layout = Layout.of(args, request)
    mr, nr = MICRO[request.target.cpu, "float64" if request.dtype == "float64" else "float32"]
    rows = mr * GROUPS
    row_tiles = exprs.ceildiv(layout.m, rows)
    items = exprs.mul(layout.batches(), row_tiles)
    m, k = ht.size_value(layout.m, symbols), ht.size_value(layout.k, symbols)
    with ht.loop(0, ht.size_value(items, symbols), "parallel") as item:
        tiles = ht.size_value(row_tiles, symbols)
        batch = layout.coordinates(arith.DivUIOp(item, tiles).result, symbols)
        r0 = arith.MulIOp(arith.RemUIOp(item, tiles).result, ht.index(rows)).result
        r1 = arith.MinUIOp(arith.AddIOp(r0, ht.index(rows)).result, m).result
        groups = arith.DivUIOp(arith.SubIOp(r1, r0).result, ht.index(mr)).result
        rest = arith.AddIOp(r0, arith.MulIOp(groups, ht.index(mr)).result).result

        def panel(j0: ir.Value, width: int) -> None:
            with ht.loop(0, groups, "serial") as group:
                _micro(layout, request, batch, arith.AddIOp(r0, arith.MulIOp(group, ht.index(mr)).result).result,
                       mr, j0, width, k)
            with ht.loop(rest, r1, "serial") as i:
                _micro(layout, request, batch, i, 1, j0, width, k)

        n = layout.n
        full = n // nr if isinstance(n, int) else arith.DivUIOp(ht.size_value(n, symbols), ht.index(nr)).result
        with ht.loop(0, full, "serial") as p:
            panel(arith.MulIOp(p, ht.index(nr)).result, nr)
        if isinstance(n, int) and n % nr:
            panel(ht.index(n - n % nr), n % nr)
        elif not isinstance(n, int):  # the columns left, one at a time
            with ht.loop(arith.MulIOp(full, ht.index(nr)).result, ht.size_value(n, symbols), "serial") as j:
                panel(j, 1)
    fmas = rows * _static(layout.n) * _static(layout.k)
    return ht.Work(items, max(1, -(-CHUNK_FMAS // max(fmas, 1))))


def _micro(layout: Layout, request: Request, batch: list[ir.Value], i0: ir.Value, rows: int, j0: ir.Value,
           width: int, k_extent: ir.Value) -> None:
    """out[.., i0:i0+rows, j0:j0+width] = epilogue(a[.., i0:i0+rows, :] @ b[.., :, j0:j0+width])."""
    stored, element = ir.MemRefType(layout.out.type).element_type, compute_type(layout.out.type)  # (16-bit: f32)
    type_ = ir.VectorType.get([width], element)
    zero = arith.ConstantOp(type_, ir.DenseElementsAttr.get_splat(type_, ir.FloatAttr.get(element, 0.0))).result
    row_index = [arith.AddIOp(i0, ht.index(r)).result if r else i0 for r in range(rows)]

    def step(k: ir.Value, sums: list[ir.Value]) -> list[ir.Value]:
        b = convert(vector.LoadOp(ir.VectorType.get([width], stored), layout.b, layout.at_b(batch, k, j0)).result,
                    element)
        return [vector.FMAOp(vector.BroadcastOp(type_, convert(ht.load(layout.a, layout.at_a(batch, i, k)),
                                                                element)).result, b,
                             acc).result for i, acc in zip(row_index, sums, strict=True)]
    sums = ht.fold(ht.index(0), k_extent, ht.index(1), [zero] * rows, step)  # loop-carried: registers
    for i, value in zip(row_index, sums, strict=True):
        at = layout.at_out(batch, i, j0)
        if request.bias:  # (a linear's, args[2]: the 16-bit twin's)
            value = arith.AddFOp(value, convert(vector.LoadOp(ir.VectorType.get([width], stored), request.args[2],
                                                              [j0]).result, element)).result
        vector.StoreOp(convert(request.epilogue(value, at), stored), layout.out, at)
