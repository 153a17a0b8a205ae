"""cuda matmul (numpy's a @ b between tensors, schedules of the same shape: cpu_matmul.py).

A shared-memory tiled kernel: each block of 32 x 8 threads computes a TILE x TILE tile of one
batch index's out. blockIdx.x is (batch index, row tile), the batch index read in each operand
at its own, broadcast, index (cpu_matmul.Layout); blockIdx.y the column tile: x allows 2^31 - 1
blocks, y and z 65535, and batch x rows is what grows with the data (batch x heads x
sequence), where the columns are a model's width. It walks K in slices of TILE: each thread loads ROWS elements of a's
slice and ROWS of b's (consecutive threads at consecutive addresses; outside the operand, 0
and no load), a barrier, then TILE steps of ROWS multiply-adds from shared memory (a warp reads
one a element, broadcast, and 32 consecutive b elements), a barrier. Each thread keeps the
sums of ROWS rows of its column in registers and stores them through the epilogue, guarded:
any M, N, K (1 and odd sizes included).

    for bx in [0, ceil(N/TILE)) bind blockIdx.y      a_tile[TILE][TILE], b_tile[TILE][TILE]
      for item in [0, batches * ceil(M/TILE)) bind blockIdx.x
        batch, by = divmod(item, ceil(M/TILE))
          for ty in [0, 8), tx in [0, 32) bind threadIdx.y, threadIdx.x
            sums[ROWS] = 0
            for each K slice: a_tile[ty + 8r][tx] = a[.., row, k]; b_tile[ty + 8r][tx] = b[.., k, col];
                              barrier; sums[r] += a_tile[ty + 8r][kk] * b_tile[kk][tx]; barrier
            out[.., by * TILE + ty + 8r, bx * TILE + tx] = epilogue(sums[r]) where inside
"""

from __future__ import annotations

from collections.abc import Sequence

from hexir_runtime.format import exprs
from mlir import ir
from mlir.dialects import arith, scf

from hexir.dialects import hextir as ht
from hexir.schedules import Request
from hexir.schedules.cpu_matmul import Layout
from hexir.schedules.cuda import _contract, _zeros

TILE = 32
THREADS_Y = 8
ROWS = TILE // THREADS_Y  # rows of sums per thread


def _less(a: ir.Value, bound: ir.Value) -> ir.Value:
    return arith.CmpIOp(arith.CmpIPredicate.ult, a, bound).result


def _plus(a: ir.Value, b: int | ir.Value) -> ir.Value:
    return arith.AddIOp(a, ht.index(b)).result


def _times(a: ir.Value, b: int) -> ir.Value:
    return arith.MulIOp(a, ht.index(b)).result


def _guarded(buffer: ir.Value, at: list[ir.Value], inside: ir.Value) -> ir.Value:
    """buffer[at] where `inside`, else 0 (no load happens)."""
    element = ir.MemRefType(buffer.type).element_type
    choice = scf.IfOp(inside, [element], has_else=True)
    with ir.InsertionPoint(choice.then_block):
        scf.YieldOp([ht.load(buffer, at)])
    with ir.InsertionPoint(choice.else_block):
        scf.YieldOp([arith.ConstantOp(element, ir.FloatAttr.get(element, 0.0)).result])
    return choice.results[0]


def matmul(args: Sequence[ir.Value], symbols: dict[str, ir.Value], request: Request) -> ht.Launch:
    request = request.with_args(args)
    layout = Layout.of(args, request)
    element = ir.MemRefType(layout.out.type).element_type
    row_tiles = exprs.ceildiv(layout.m, TILE)
    grid = (exprs.mul(layout.batches(), row_tiles), exprs.ceildiv(layout.n, TILE), 1)
    with ht.loop(0, ht.size_value(grid[1], symbols), "parallel", "blockIdx.y") as block_column, \
            ht.loop(0, ht.size_value(grid[0], symbols), "parallel", "blockIdx.x") as item:
        a_tile = ht.alloc_local([TILE, TILE], element, "shared")
        b_tile = ht.alloc_local([TILE, TILE], element, "shared")
        with ht.loop(0, THREADS_Y, "parallel", "threadIdx.y") as ty, \
                ht.loop(0, TILE, "parallel", "threadIdx.x") as tx:
            m, k, n = (ht.size_value(e, symbols) for e in (layout.m, layout.k, layout.n))
            tiles = ht.size_value(row_tiles, symbols)
            batch = layout.coordinates(arith.DivUIOp(item, tiles).result, symbols)
            block_row = arith.RemUIOp(item, tiles).result
            row0, column0 = _times(block_row, TILE), _times(block_column, TILE)
            sums = _zeros([ROWS], element)
            rows = [_plus(ty, r * THREADS_Y) if r else ty for r in range(ROWS)]
            with ht.loop(0, ht.size_value(exprs.ceildiv(layout.k, TILE), symbols), "serial") as k_slice:
                k0 = _times(k_slice, TILE)
                for r in rows:
                    a_row, a_k = _plus(row0, r), _plus(k0, tx)
                    ht.store(_guarded(layout.a, layout.at_a(batch, a_row, a_k),
                                      arith.AndIOp(_less(a_row, m), _less(a_k, k)).result), a_tile, [r, tx])
                    b_k, b_column = _plus(k0, r), _plus(column0, tx)
                    ht.store(_guarded(layout.b, layout.at_b(batch, b_k, b_column),
                                      arith.AndIOp(_less(b_k, k), _less(b_column, n)).result), b_tile, [r, tx])
                ht.barrier()
                for kk in map(ht.index, range(TILE)):  # unrolled here: constant shared offsets
                    b = ht.load(b_tile, [kk, tx])
                    for r, row in enumerate(rows):
                        at = [ht.index(r)]
                        product = arith.MulFOp(ht.load(a_tile, [row, kk]), b, fastmath=_contract()).result
                        ht.store(arith.AddFOp(ht.load(sums, at), product, fastmath=_contract()).result, sums, at)
                ht.barrier()
            column = _plus(column0, tx)
            for r, row in enumerate(rows):
                out_row = _plus(row0, row)
                inside = scf.IfOp(arith.AndIOp(_less(out_row, m), _less(column, n)).result)
                with ir.InsertionPoint(inside.then_block):
                    at = layout.at_out(batch, out_row, column)
                    ht.store(request.epilogue(ht.load(sums, [ht.index(r)]), at), layout.out, at)
                    scf.YieldOp([])
    return ht.Launch(grid, (TILE, THREADS_Y, 1))
