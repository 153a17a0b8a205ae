"""cuda schedules for lower-to-tir: every loop bound to a GPU index, every shape guarded.

linear (x[M,K] @ w[K,N] (+ bias)): each 16x16-thread block computes a 64x64 tile of out.
It walks K in slices of 16: the block stages x[64 rows, 16] and w[16, 64 columns] in
shared memory (each thread copies 4 elements of each; consecutive threads read consecutive
addresses, so the loads coalesce; out-of-range elements are staged as 0), waits at a
barrier, and each thread accumulates a 4x4 block of sums (rows ty+16i, columns tx+16j, so
a warp's stores are consecutive too) in a private buffer that NVVM keeps in registers.
A large output gets 128x128 tiles with 8x8 sums per thread instead (`linear_tiling`).

    for by in [0, ceil(M/64)) bind blockIdx.y       x_tile, w_tile: shared buffers
      for bx in [0, ceil(N/64)) bind blockIdx.x
        for ty in [0, 16) bind threadIdx.y          sums[4][4] = 0
          for tx in [0, 16) bind threadIdx.x        for each k slice: stage; barrier; 16 x 4x4 FMAs; barrier
                                                    out[row, col] = sums (+ bias[col]) where row < M, col < N
relu: the tensor as one flat axis of 256-thread blocks, guarded by the element count.
The guards make any shape work: 1, primes, sizes that no block size divides.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlir import ir
from mlir.dialects import arith, memref, scf

from hexir.dialects import hextir as ht

#: linear: (out tile per block, k slice per step, sums per thread axis) — small and large.
SMALL_TILING, LARGE_TILING = (64, 16, 4), (128, 16, 8)
#: Large tiles only when they still give every SM of a big GPU (132 on an H100/H200) two blocks.
LARGE_TILES_FROM = 256


def linear_tiling(m: int, n: int) -> tuple[int, int, int]:
    """The tiling of an [m, n] output: 128x128 tiles with 8x8 sums per thread do more work per
    shared-memory load (0.70 of cuBLAS at 4096^3 f32 on the H200, against 0.57 for 64x64),
    but a small output would leave SMs idle (0.47 against 0.71 at 1024^3): see
    bench/results/2026-11-30-h200-tilings.md."""
    large = LARGE_TILING[0]
    return LARGE_TILING if -(-m // large) * -(-n // large) >= LARGE_TILES_FROM else SMALL_TILING
ELEMENTWISE_BLOCK = 256


def _contract() -> ir.Attribute:
    """Let the multiply and add fuse into one FMA (one rounding instead of two)."""
    return ir.Attribute.parse("#arith.fastmath<contract>")


def _ceil_div(a: int, b: int) -> int:
    return max(1, -(-a // b))


def _global_index(block: ir.Value, thread: ir.Value, size: int) -> ir.Value:
    return arith.AddIOp(arith.MulIOp(block, ht.index(size)).result, thread).result


def _less(a: ir.Value, bound: int) -> ir.Value:
    return arith.CmpIOp(arith.CmpIPredicate.ult, a, ht.index(bound)).result


def _index_op(op: type, a: ir.Value, b: int) -> ir.Value:
    return op(a, ht.index(b)).result


def _guarded_load(buffer: ir.Value, row: ir.Value, column: ir.Value, rows: int, columns: int) -> ir.Value:
    """buffer[row, column] where that is inside [rows, columns), else 0 (no load happens)."""
    element = ir.MemRefType(buffer.type).element_type
    inside = scf.IfOp(arith.AndIOp(_less(row, rows), _less(column, columns)).result, [element], has_else=True)
    with ir.InsertionPoint(inside.then_block):
        scf.YieldOp([ht.load(buffer, [row, column])])
    with ir.InsertionPoint(inside.else_block):
        scf.YieldOp([arith.ConstantOp(element, ir.FloatAttr.get(element, 0.0)).result])
    return inside.results[0]


def linear(args: Sequence[ir.Value], relu: bool = False) -> None:
    """A tiled matrix product: each block computes a tile x tile tile of out, staging
    step-wide slices of x and w through shared memory; each thread keeps per x per sums."""
    x, w, out = args[0], args[1], args[-1]
    bias = args[2] if len(args) == 4 else None
    (m, k_extent), n = ir.MemRefType(x.type).shape, ir.MemRefType(w.type).shape[1]
    element = ir.MemRefType(out.type).element_type
    tile, step, per = linear_tiling(m, n)
    threads = tile // per                                    # 16 threads per axis
    loads = tile * step // (threads * threads)               # elements each thread stages per slice
    with ht.loop(0, _ceil_div(m, tile), "parallel", "blockIdx.y") as block_row, \
            ht.loop(0, _ceil_div(n, tile), "parallel", "blockIdx.x") as block_column:
        x_tile = ht.alloc_local([tile, step], element, "shared")
        w_tile = ht.alloc_local([step, tile], element, "shared")
        with ht.loop(0, threads, "parallel", "threadIdx.y") as ty, \
                ht.loop(0, threads, "parallel", "threadIdx.x") as tx:
            sums = ht.alloc_local([per, per], element)
            zero = arith.ConstantOp(element, ir.FloatAttr.get(element, 0.0)).result
            with ht.loop(0, per, "unrolled") as r, ht.loop(0, per, "unrolled") as c:
                ht.store(zero, sums, [r, c])
            thread = arith.AddIOp(_index_op(arith.MulIOp, ty, threads), tx).result
            row0 = _index_op(arith.MulIOp, block_row, tile)
            column0 = _index_op(arith.MulIOp, block_column, tile)
            with ht.loop(0, _ceil_div(k_extent, step), "serial") as k_slice:
                k0 = _index_op(arith.MulIOp, k_slice, step)
                with ht.loop(0, loads, "unrolled") as e:     # x[row0:+tile, k0:+step] -> x_tile
                    position = arith.AddIOp(thread, _index_op(arith.MulIOp, e, threads * threads)).result
                    r, c = _index_op(arith.DivUIOp, position, step), _index_op(arith.RemUIOp, position, step)
                    value = _guarded_load(x, arith.AddIOp(row0, r).result, arith.AddIOp(k0, c).result, m, k_extent)
                    ht.store(value, x_tile, [r, c])
                with ht.loop(0, loads, "unrolled") as e:     # w[k0:+step, column0:+tile] -> w_tile
                    position = arith.AddIOp(thread, _index_op(arith.MulIOp, e, threads * threads)).result
                    r, c = _index_op(arith.DivUIOp, position, tile), _index_op(arith.RemUIOp, position, tile)
                    value = _guarded_load(w, arith.AddIOp(k0, r).result, arith.AddIOp(column0, c).result, k_extent, n)
                    ht.store(value, w_tile, [r, c])
                ht.barrier()
                with ht.loop(0, step, "unrolled") as kk, ht.loop(0, per, "unrolled") as i:
                    a = ht.load(x_tile, [arith.AddIOp(ty, _index_op(arith.MulIOp, i, threads)).result, kk])
                    with ht.loop(0, per, "unrolled") as j:
                        b = ht.load(w_tile, [kk, arith.AddIOp(tx, _index_op(arith.MulIOp, j, threads)).result])
                        product = arith.MulFOp(a, b, fastmath=_contract()).result
                        total = arith.AddFOp(ht.load(sums, [i, j]), product, fastmath=_contract()).result
                        ht.store(total, sums, [i, j])
                ht.barrier()
            with ht.loop(0, per, "unrolled") as i, ht.loop(0, per, "unrolled") as j:
                row = arith.AddIOp(row0, arith.AddIOp(ty, _index_op(arith.MulIOp, i, threads)).result).result
                column = arith.AddIOp(column0, arith.AddIOp(tx, _index_op(arith.MulIOp, j, threads)).result).result
                inside = scf.IfOp(arith.AndIOp(_less(row, m), _less(column, n)).result)
                with ir.InsertionPoint(inside.then_block):
                    value = ht.load(sums, [i, j])
                    if bias is not None:
                        value = arith.AddFOp(value, ht.load(bias, [column])).result
                    if relu:  # a fused relu costs one instruction here, and no pass over memory
                        zero = arith.ConstantOp(element, ir.FloatAttr.get(element, 0.0)).result
                        value = arith.MaximumFOp(value, zero).result
                    ht.store(value, out, [row, column])
                    scf.YieldOp([])


def relu(args: Sequence[ir.Value]) -> None:
    x, out = args
    shape = ir.MemRefType(x.type).shape
    element = ir.MemRefType(x.type).element_type
    total = 1
    for extent in shape:
        total *= extent
    flat_type = ir.MemRefType.get([total], element)
    reassociation = ir.ArrayAttr.get([ir.ArrayAttr.get(
        [ir.IntegerAttr.get(ir.IntegerType.get_signless(64), d) for d in range(len(shape))])])
    flat_x = memref.CollapseShapeOp(flat_type, x, reassociation).result if len(shape) > 1 else x
    flat_out = memref.CollapseShapeOp(flat_type, out, reassociation).result if len(shape) > 1 else out
    size = ELEMENTWISE_BLOCK
    with ht.loop(0, _ceil_div(total, size), "parallel", "blockIdx.x") as block, \
            ht.loop(0, size, "parallel", "threadIdx.x") as thread:
        position = _global_index(block, thread, size)
        guard = scf.IfOp(_less(position, total))
        with ir.InsertionPoint(guard.then_block):
            zero = arith.ConstantOp(element, ir.FloatAttr.get(element, 0.0)).result
            ht.store(arith.MaximumFOp(ht.load(flat_x, [position]), zero).result, flat_out, [position])
            scf.YieldOp([])
