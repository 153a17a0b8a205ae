"""cuda matmul (numpy's a @ b between tensors, schedules of the same shape: cpu_matmul.py).

A shared-memory tiled kernel: each block of 16 x 16 threads computes a TILE x TILE tile of one
batch index's out. blockIdx.x is (batch index, row tile), the batch index read in each operand
at its own, broadcast, index (cpu_matmul.Layout); blockIdx.y the column tile: x allows 2^31 - 1
blocks, y and z 65535, and batch x rows is what grows with the data (batch x heads x
sequence), where the columns are a model's width. The block walks K in slices of STEP: each
thread loads its share of a's TILE x STEP slice and b's STEP x TILE (consecutive threads at
consecutive addresses; outside the operand, 0 and no load), a barrier, then STEP steps of PER x
PER multiply-adds from shared memory (thread (ty, tx) holds rows ty + 16i and columns tx + 16j:
a half-warp reads one a element, broadcast, and 16 consecutive b elements: no bank conflict), a
barrier. The sums stay in registers and are stored through the epilogue, guarded: any M, N, K
(1 and odd sizes included).

    for by in [0, ceil(N/TILE)) bind blockIdx.y      a_tile[TILE][STEP], b_tile[STEP][TILE]
      for item in [0, batches * ceil(M/TILE)) bind blockIdx.x
        batch, bx = divmod(item, ceil(M/TILE))
          for ty in [0, 16), tx in [0, 16) bind threadIdx.y, threadIdx.x
            sums[PER][PER] = 0
            for each K slice: a_tile[.][.], b_tile[.][.] = this thread's elements of the slices
                              barrier; sums[i][j] += a_tile[ty + 16i][kk] * b_tile[kk][tx + 16j]; barrier
            out[.., row0 + ty + 16i, col0 + tx + 16j] = epilogue(sums[i][j]) where inside
"""

from __future__ import annotations

from collections.abc import Sequence

from hexir_runtime.format import exprs
from mlir import ir
from mlir.dialects import arith

from hexir.dialects import hextir as ht
from hexir.schedules import Request
from hexir.schedules.cpu_matmul import Layout
from hexir.schedules.cuda import _contract, _less, _plus, _times, _zero, _zeros
from hexir.schedules.emit import compute_type, convert

TILE = 64   # out's rows and columns per block
STEP = 16   # k's per shared slice
SIDE = 16   # threads per block along x and y
PER = TILE // SIDE  # rows (and columns) of sums per thread
THREADS = SIDE * SIDE


def _guarded(buffer: ir.Value, at: list[ir.Value], inside: ir.Value, element: ir.Type) -> ir.Value:
    """buffer[at] as `element` where `inside`, else 0 (no load happens)."""
    return ht.choose(inside, lambda: [convert(ht.load(buffer, at), element)], lambda: [_zero(element)], [element])[0]


def _slice(source: ir.Value, tile: ir.Value, thread: ir.Value, width: int, at, inside) -> None:
    """tile[r, c] = source at `at(r, c)` where `inside(r, c)`, else 0: this thread's elements of
    the slice (element thread + THREADS * e; `width` per row of the tile)."""
    rows, columns = ir.MemRefType(tile.type).shape
    for e in range(rows * columns // THREADS):
        position = _plus(thread, e * THREADS) if e else thread
        r, c = arith.DivUIOp(position, ht.index(width)).result, arith.RemUIOp(position, ht.index(width)).result
        ht.store(_guarded(source, at(r, c), inside(r, c), ir.MemRefType(tile.type).element_type), tile, [r, c])


def matmul(args: Sequence[ir.Value], symbols: dict[str, ir.Value], request: Request) -> ht.Launch:
    request = request.with_args(args)
    layout = Layout.of(args, request)
    element = compute_type(layout.out.type)  # (16-bit operands: tiles and sums in float32)
    row_tiles = exprs.ceildiv(layout.m, TILE)
    grid = (exprs.mul(layout.batches(), row_tiles), exprs.ceildiv(layout.n, TILE), 1)
    with ht.loop(0, ht.size_value(grid[1], symbols), "parallel", "blockIdx.y") as block_column, \
            ht.loop(0, ht.size_value(grid[0], symbols), "parallel", "blockIdx.x") as item:
        a_tile = ht.alloc_local([TILE, STEP], element, "shared")
        b_tile = ht.alloc_local([STEP, TILE], element, "shared")
        with ht.loop(0, SIDE, "parallel", "threadIdx.y") as ty, ht.loop(0, SIDE, "parallel", "threadIdx.x") as tx:
            m, k, n = (ht.size_value(e, symbols) for e in (layout.m, layout.k, layout.n))
            tiles = ht.size_value(row_tiles, symbols)
            batch = layout.coordinates(arith.DivUIOp(item, tiles).result, symbols)
            row0 = _times(arith.RemUIOp(item, tiles).result, TILE)
            column0 = _times(block_column, TILE)
            thread = _plus(_times(ty, SIDE), tx)
            sums = _zeros([PER, PER], element)
            rows = [_plus(ty, i * SIDE) if i else ty for i in range(PER)]        # in the tile
            columns = [_plus(tx, j * SIDE) if j else tx for j in range(PER)]
            with ht.loop(0, ht.size_value(exprs.ceildiv(layout.k, STEP), symbols), "serial") as k_slice:
                k0 = _times(k_slice, STEP)
                _slice(layout.a, a_tile, thread, STEP,
                       lambda r, c: layout.at_a(batch, _plus(row0, r), _plus(k0, c)),
                       lambda r, c: arith.AndIOp(_less(_plus(row0, r), m), _less(_plus(k0, c), k)).result)
                _slice(layout.b, b_tile, thread, TILE,
                       lambda r, c: layout.at_b(batch, _plus(k0, r), _plus(column0, c)),
                       lambda r, c: arith.AndIOp(_less(_plus(k0, r), k), _less(_plus(column0, c), n)).result)
                ht.barrier()
                for kk in map(ht.index, range(STEP)):  # unrolled here: constant shared offsets
                    a = [ht.load(a_tile, [row, kk]) for row in rows]
                    b = [ht.load(b_tile, [kk, column]) for column in columns]
                    for i in range(PER):
                        for j in range(PER):
                            at = [ht.index(i), ht.index(j)]
                            product = arith.MulFOp(a[i], b[j], fastmath=_contract()).result
                            ht.store(arith.AddFOp(ht.load(sums, at), product, fastmath=_contract()).result, sums, at)
                ht.barrier()
            for i, row in enumerate(rows):
                for j, column in enumerate(columns):
                    out_row, out_column = _plus(row0, row), _plus(column0, column)
                    with ht.when(arith.AndIOp(_less(out_row, m), _less(out_column, n)).result):
                        at = layout.at_out(batch, out_row, out_column)
                        value = request.epilogue(ht.load(sums, [ht.index(i), ht.index(j)]), at)
                        ht.store(convert(value, ir.MemRefType(layout.out.type).element_type), layout.out, at)
    return ht.Launch(grid, (SIDE, SIDE, 1))
