"""cuda schedules: every loop bound to a GPU index, every shape guarded.

linear (x[M,K] @ w[K,N], epilogues bias and fused element-wise ops): each 16x16-thread block
computes a tile x tile tile of out. It walks K in slices of `step`: the block stages x[tile
rows, step] and w[step, tile columns] in shared memory (consecutive threads read consecutive
addresses, so the loads coalesce; out-of-range elements are staged as 0), waits at a barrier,
and each thread accumulates a per x per block of sums (rows ty+16i, columns tx+16j, so a
warp's stores are consecutive too) in a private buffer that NVVM keeps in registers.

    for by in [0, ceil(M/tile)) bind blockIdx.y       x_tile, w_tile: shared buffers
      for bx in [0, ceil(N/tile)) bind blockIdx.x
        for ty in [0, 16) bind threadIdx.y            sums[per][per] = 0
          for tx in [0, 16) bind threadIdx.x          for each k slice: stage; barrier; FMAs; barrier
                                                      out[row, col] = epilogues(sums) where row < M, col < N

linear in float64 on sm_80 and newer runs on the FP64 tensor cores instead (`dmma`): blocks of
warps (2 x 2 for a 64 x 64 tile, `DMMA_TILINGS`), each warp computing its part of the tile as
`mma.sync.m8n8k4.f64` tiles (two f64 sums of each per thread, in registers), its x and w
fragments read from the same shared-memory slices the SIMT kernel stages.

linear with at most 16 rows (static) streams w instead (`rows`): see `linear_rows`.

elementwise (relu, ...): the tensor as one flat axis of 256-thread blocks, guarded by the
element count. The guards make any shape work: 1, primes, sizes no block size divides, and a
row count known only at run time (the grid is then an expression of it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mlir import ir
from mlir.dialects import arith, llvm, memref, nvvm, scf

from hexir import sizes
from hexir.dialects import hextir as ht
from hexir.schedules import Request, extent

#: The SIMT linear's tilings, (out tile per block, k slice per step, sums per thread axis), with
#: the fewest blocks each must give the GPU (132 SMs on an H100/H200) to be chosen: the first
#: that fills the GPU wins. Bigger tiles do more work per shared-memory load (128x128: 0.70 of
#: cuBLAS at 4096^3 f32 on the H200, 64x64: 0.57) but leave SMs idle on small outputs
#: (bench/results/2026-11-30-h200-tilings.md, 2026-11-30-h200-tilings-2.md).
TILINGS = (((128, 16, 8), 256), ((64, 16, 4), 256), ((32, 16, 2), 0))  # 512^3: 32x32 0.84, 64x64 0.64
SMALL_TILING, LARGE_TILING = TILINGS[1][0], TILINGS[0][0]
#: With a row count known only at run time, large tiles from this many columns on.
LARGE_TILES_FROM_COLUMNS = 2048
#: At most this many rows (static): the row-streaming kernel, `rows` (a GEMV for 1 row). At
#: 4096 x 4096 on the H200 it beats the tiled kernel 4.5x at 1 row, 2.5x at 4, 1.7x at 8, and
#: loses at 16 (bench/results/2026-11-30-h200-tilings-2.md).
ROWS_MAX = 8
ROWS_SHARED_BYTES = 32768
ELEMENTWISE_BLOCK = 256


def linear_tiling(m: sizes.Expr, n: int) -> tuple[int, int, int]:
    """The tiling of an [m, n] output: the first of TILINGS that gives enough blocks (a symbolic
    m: the largest; `linear_variants` adds the smaller ones, for the batches they fill the GPU at)."""
    if isinstance(m, str):
        return LARGE_TILING
    for tiling, fewest in TILINGS:
        if -(-m // tiling[0]) * -(-n // tiling[0]) >= fewest:
            return tiling
    return TILINGS[-1][0]


def linear_variants(types: list[ir.Type], request: Request) -> list[tuple[str, dict[str, int]]]:
    """With a symbolic batch, a SIMT kernel per tile of TILINGS: the smaller tiles run the
    batches too small for the larger ones to give the GPU enough blocks (what the static choice
    does at compile time, done per call)."""
    m, n = extent(types[0], 0, request), extent(types[-1], 1, request)
    if not isinstance(m, str) or _uses_dmma(request):
        return []
    # the batch from which each tiling but the last gives enough blocks: it runs below the next one's
    starts = [tile * -(-fewest // -(-n // tile)) for (tile, _, _), fewest in TILINGS[:-1]]
    return [(f"t{TILINGS[i][0][0]}", {m: starts[i - 1]}) for i in range(len(TILINGS) - 1, 0, -1)]


def _uses_dmma(request: Request) -> bool:
    return request.dtype == "float64" and all(int(a[3:]) >= DMMA_FROM for a in request.target.cuda_archs)


def _contract() -> ir.Attribute:
    """Let the multiply and add fuse into one FMA (one rounding instead of two)."""
    return ir.Attribute.parse("#arith.fastmath<contract>")


def _less(a: ir.Value, bound: ir.Value) -> ir.Value:
    return arith.CmpIOp(arith.CmpIPredicate.ult, a, bound).result


def _times(a: ir.Value, b: int) -> ir.Value:
    return arith.MulIOp(a, ht.index(b)).result


def _plus(a: ir.Value, b: ir.Value) -> ir.Value:
    return arith.AddIOp(a, b).result


def _guarded_load(buffer: ir.Value, row: ir.Value, column: ir.Value, rows: ir.Value, columns: ir.Value) -> ir.Value:
    """buffer[row, column] where that is inside [rows, columns), else 0 (no load happens)."""
    element = ir.MemRefType(buffer.type).element_type
    inside = scf.IfOp(arith.AndIOp(_less(row, rows), _less(column, columns)).result, [element], has_else=True)
    with ir.InsertionPoint(inside.then_block):
        scf.YieldOp([ht.load(buffer, [row, column])])
    with ir.InsertionPoint(inside.else_block):
        scf.YieldOp([arith.ConstantOp(element, ir.FloatAttr.get(element, 0.0)).result])
    return inside.results[0]


def _store(value: Callable[[], ir.Value], out: ir.Value, at: tuple[ir.Value, ir.Value],
           bounds: tuple[ir.Value, ir.Value], bias: ir.Value | None, request: Request) -> None:
    """out[row, column] = epilogues(value()) where row < M and column < N (the store guard): the
    bias of the column, then the fused ops, each an instruction here and no pass over memory."""
    (row, column), (rows, columns) = at, bounds
    inside = scf.IfOp(arith.AndIOp(_less(row, rows), _less(column, columns)).result)
    with ir.InsertionPoint(inside.then_block):
        result = value()
        if bias is not None:
            result = arith.AddFOp(result, ht.load(bias, [column])).result
        for apply in request.fused():
            result = apply(result)
        ht.store(result, out, [row, column])
        scf.YieldOp([])


def _stage(source: ir.Value, tile: ir.Value, thread: ir.Value, threads: int, loads: int, width: int,
           origin: tuple[ir.Value, ir.Value], bounds: tuple[ir.Value, ir.Value]) -> None:
    """Copy a [loads * threads / width, width] block of `source` at `origin` into `tile`, each
    thread `loads` elements, consecutive threads at consecutive addresses."""
    with ht.loop(0, loads, "unrolled") as e:
        position = _plus(thread, _times(e, threads))
        r = arith.DivUIOp(position, ht.index(width)).result
        c = arith.RemUIOp(position, ht.index(width)).result
        value = _guarded_load(source, _plus(origin[0], r), _plus(origin[1], c), *bounds)
        ht.store(value, tile, [r, c])


#: The FP64 tensor-core kernel's tilings, (block rows, block columns, k slice, warps along
#: rows, warps along columns), with the fewest blocks each must give the GPU to be chosen.
DMMA_TILINGS = (((64, 64, 16, 2, 2), 0),)


def dmma_tiling(m: sizes.Expr, n: int) -> tuple[int, int, int, int, int]:
    """The DMMA tiling of an [m, n] output: the first of DMMA_TILINGS that gives enough blocks."""
    for tiling, fewest in DMMA_TILINGS:
        if isinstance(m, str) or -(-m // tiling[0]) * -(-n // tiling[1]) >= fewest:
            return tiling
    return DMMA_TILINGS[-1][0]
#: Padding of the x and w tiles' rows (f64 elements) against shared-memory bank conflicts.
DMMA_PAD = (4, 8)
#: DMMA (mma.sync m8n8k4 f64) exists from sm_80 on.
DMMA_FROM = 80


def linear(args: Sequence[ir.Value], symbols: dict[str, ir.Value], request: Request) -> ht.Launch:
    """The kernel for the shape: few (static) rows stream w (`rows`); else float64 runs on the
    tensor cores where every target has DMMA (`dmma`), and the rest on the CUDA cores (`simt`)."""
    m = extent(args[0], 0, request)
    if isinstance(m, int) and 0 < m <= ROWS_MAX:
        return linear_rows(args, symbols, request)
    if _uses_dmma(request):
        return linear_dmma(args, symbols, request)
    return linear_simt(args, symbols, request)


def linear_rows(args: Sequence[ir.Value], symbols: dict[str, ir.Value], request: Request) -> ht.Launch:
    """M <= 16 rows: w is read once, coalesced. A block's 32 lanes take 32 columns, its warps
    split K (warp y takes k = y, y + warps, ...), each thread keeping the M sums of its column
    in registers; the warps' partial sums are added through shared memory at the end."""
    x, w, out = args[0], args[1], args[-1]
    bias = args[2] if "bias" in request.epilogues else None
    m, k_extent, n = extent(x, 0, request), extent(x, 1, request), extent(w, 1, request)
    element = ir.MemRefType(out.type).element_type
    # as many warps as the partial sums allow (warps x M x 32 elements <= 32 KiB), up to 32: more
    # loads in flight for the few blocks (one per 32 columns) a product of few rows has
    warps = max(1, min(32, ROWS_SHARED_BYTES // (m * 32 * (4 if request.dtype == "float32" else 8))))
    ht.set_variant("rows")
    columns, depth = ht.index(n), ht.index(k_extent)
    with ht.loop(0, -(-n // 32), "parallel", "blockIdx.x") as block:
        partial = ht.alloc_local([warps, m, 32], element, "shared")
        with ht.loop(0, warps, "parallel", "threadIdx.y") as warp, ht.loop(0, 32, "parallel", "threadIdx.x") as lane:
            column = _plus(_times(block, 32), lane)
            sums = ht.alloc_local([m], element)
            zero = arith.ConstantOp(element, ir.FloatAttr.get(element, 0.0)).result
            with ht.loop(0, m, "unrolled") as r:
                ht.store(zero, sums, [r])
            with ht.loop(0, -(-k_extent // warps), "serial") as step:
                k = _plus(_times(step, warps), warp)
                inside = scf.IfOp(arith.AndIOp(_less(k, depth), _less(column, columns)).result)
                with ir.InsertionPoint(inside.then_block):
                    b = ht.load(w, [k, column])
                    with ht.loop(0, m, "unrolled") as r:
                        product = arith.MulFOp(ht.load(x, [r, k]), b, fastmath=_contract()).result
                        ht.store(arith.AddFOp(ht.load(sums, [r]), product, fastmath=_contract()).result, sums, [r])
                    scf.YieldOp([])
            with ht.loop(0, m, "unrolled") as r:
                ht.store(ht.load(sums, [r]), partial, [warp, r, lane])
            ht.barrier()
            with ht.loop(0, -(-m // warps), "unrolled") as part:  # thread (warp, lane) adds up row warp (+ warps)
                row = _plus(_times(part, warps), warp)

                def total(row=row, lane=lane) -> ir.Value:
                    value = ht.load(partial, [ht.index(0), row, lane])
                    for other in range(1, warps):
                        value = arith.AddFOp(value, ht.load(partial, [ht.index(other), row, lane])).result
                    return value
                _store(total, out, (row, column), (ht.index(m), columns), bias, request)
    return ht.Launch((sizes.ceildiv(n, 32), 1, 1), (32, warps, 1))


def linear_simt(args: Sequence[ir.Value], symbols: dict[str, ir.Value], request: Request) -> ht.Launch:
    x, w, out = args[0], args[1], args[-1]
    bias = args[2] if "bias" in request.epilogues else None
    m, k_extent, n = extent(x, 0, request), extent(x, 1, request), extent(w, 1, request)
    element = ir.MemRefType(out.type).element_type
    tile, step, per = linear_tiling(m, n) if request.variant is None else \
        next(t for t, _ in TILINGS if f"t{t[0]}" == request.variant)
    if request.variant is not None:
        ht.set_variant(request.variant)
    threads = tile // per                                    # 16 threads per axis
    loads = tile * step // (threads * threads)               # elements each thread stages per slice
    grid = (sizes.ceildiv(n, tile), sizes.ceildiv(m, tile), 1)
    rows, columns, depth = ht.size_value(m, symbols), ht.index(n), ht.index(k_extent)
    with ht.loop(0, ht.size_value(grid[1], symbols), "parallel", "blockIdx.y") as block_row, \
            ht.loop(0, grid[0], "parallel", "blockIdx.x") as block_column:
        x_tile = ht.alloc_local([tile, step], element, "shared")
        w_tile = ht.alloc_local([step, tile], element, "shared")
        with ht.loop(0, threads, "parallel", "threadIdx.y") as ty, \
                ht.loop(0, threads, "parallel", "threadIdx.x") as tx:
            sums = ht.alloc_local([per, per], element)
            zero = arith.ConstantOp(element, ir.FloatAttr.get(element, 0.0)).result
            with ht.loop(0, per, "unrolled") as r, ht.loop(0, per, "unrolled") as c:
                ht.store(zero, sums, [r, c])
            thread = _plus(_times(ty, threads), tx)
            row0, column0 = _times(block_row, tile), _times(block_column, tile)
            with ht.loop(0, -(-k_extent // step), "serial") as k_slice:
                k0 = _times(k_slice, step)
                _stage(x, x_tile, thread, threads * threads, loads, step, (row0, k0), (rows, depth))
                _stage(w, w_tile, thread, threads * threads, loads, tile, (k0, column0), (depth, columns))
                ht.barrier()
                with ht.loop(0, step, "unrolled") as kk, ht.loop(0, per, "unrolled") as i:
                    a = ht.load(x_tile, [_plus(ty, _times(i, threads)), kk])
                    with ht.loop(0, per, "unrolled") as j:
                        b = ht.load(w_tile, [kk, _plus(tx, _times(j, threads))])
                        product = arith.MulFOp(a, b, fastmath=_contract()).result
                        total = arith.AddFOp(ht.load(sums, [i, j]), product, fastmath=_contract()).result
                        ht.store(total, sums, [i, j])
                ht.barrier()
            with ht.loop(0, per, "unrolled") as i, ht.loop(0, per, "unrolled") as j:
                row = _plus(row0, _plus(ty, _times(i, threads)))
                column = _plus(column0, _plus(tx, _times(j, threads)))
                _store(lambda i=i, j=j: ht.load(sums, [i, j]), out, (row, column), (rows, columns), bias, request)
    return ht.Launch(grid, (threads, threads, 1))


def linear_dmma(args: Sequence[ir.Value], symbols: dict[str, ir.Value], request: Request) -> ht.Launch:
    x, w, out = args[0], args[1], args[-1]
    bias = args[2] if "bias" in request.epilogues else None
    m, k_extent, n = extent(x, 0, request), extent(x, 1, request), extent(w, 1, request)
    element = ir.MemRefType(out.type).element_type
    tile_m, tile_n, step, warps_m, warps_n = dmma_tiling(m, n)
    threads = 32 * warps_m * warps_n
    frags_m, frags_n = tile_m // warps_m // 8, tile_n // warps_n // 8   # mma tiles per warp
    grid = (sizes.ceildiv(n, tile_n), sizes.ceildiv(m, tile_m), 1)
    rows, columns, depth = ht.size_value(m, symbols), ht.index(n), ht.index(k_extent)
    pair = ir.Type.parse("!llvm.struct<(f64, f64)>")
    f64_type = ir.Attribute.parse("#nvvm.mma_type<f64>")
    ht.set_variant("dmma")
    with ht.loop(0, ht.size_value(grid[1], symbols), "parallel", "blockIdx.y") as block_row, \
            ht.loop(0, grid[0], "parallel", "blockIdx.x") as block_column:
        # padded rows: a warp's fragment loads (8 rows x 4 columns of x, 4 rows x 8 columns of
        # w) then fall on distinct banks but for the pairs an 8-byte load needs anyway
        x_tile = ht.alloc_local([tile_m, step + DMMA_PAD[0]], element, "shared")
        w_tile = ht.alloc_local([step, tile_n + DMMA_PAD[1]], element, "shared")
        with ht.loop(0, threads, "parallel", "threadIdx.x") as thread:
            sums = ht.alloc_local([frags_m, frags_n, 2], element)
            zero = arith.ConstantOp(element, ir.FloatAttr.get(element, 0.0)).result
            with ht.loop(0, frags_m, "unrolled") as i, ht.loop(0, frags_n, "unrolled") as j, \
                    ht.loop(0, 2, "unrolled") as c:
                ht.store(zero, sums, [i, j, c])
            warp = arith.DivUIOp(thread, ht.index(32)).result
            lane = arith.RemUIOp(thread, ht.index(32)).result
            group, in_group = arith.DivUIOp(lane, ht.index(4)).result, arith.RemUIOp(lane, ht.index(4)).result
            warp_row = _times(arith.DivUIOp(warp, ht.index(warps_n)).result, tile_m // warps_m)
            warp_column = _times(arith.RemUIOp(warp, ht.index(warps_n)).result, tile_n // warps_n)
            row0, column0 = _times(block_row, tile_m), _times(block_column, tile_n)
            with ht.loop(0, -(-k_extent // step), "serial") as k_slice:
                k0 = _times(k_slice, step)
                _stage(x, x_tile, thread, threads, tile_m * step // threads, step, (row0, k0), (rows, depth))
                _stage(w, w_tile, thread, threads, tile_n * step // threads, tile_n, (k0, column0), (depth, columns))
                ht.barrier()
                with ht.loop(0, step // 4, "unrolled") as kq:
                    # fragments: A (row group, column in_group), B (row in_group, column group)
                    kk = _plus(_times(kq, 4), in_group)
                    a = [ht.load(x_tile, [_plus(warp_row, _plus(ht.index(8 * f), group)), kk])
                         for f in range(frags_m)]
                    b = [ht.load(w_tile, [kk, _plus(warp_column, _plus(ht.index(8 * f), group))])
                         for f in range(frags_n)]
                    for fi in range(frags_m):
                        for fj in range(frags_n):
                            at = [ht.index(fi), ht.index(fj)]
                            c = [ht.load(sums, [*at, ht.index(h)]) for h in range(2)]
                            d = nvvm.MmaOp(pair, ir.Attribute.parse("#nvvm.shape<m = 8, n = 8, k = 4>"),
                                           ir.Attribute.parse("#nvvm.mma_layout<row>"),
                                           ir.Attribute.parse("#nvvm.mma_layout<col>"), [a[fi]], [b[fj]], c,
                                           multiplicandAPtxType=f64_type, multiplicandBPtxType=f64_type).result
                            for h in range(2):
                                ht.store(llvm.ExtractValueOp(element, d, [h]).result, sums, [*at, ht.index(h)])
                ht.barrier()
            with ht.loop(0, frags_m, "unrolled") as i, ht.loop(0, frags_n, "unrolled") as j, \
                    ht.loop(0, 2, "unrolled") as h:
                row = _plus(row0, _plus(warp_row, _plus(_times(i, 8), group)))
                column = _plus(column0, _plus(warp_column, _plus(_times(j, 8), _plus(_times(in_group, 2), h))))
                _store(lambda i=i, j=j, h=h: ht.load(sums, [i, j, h]), out, (row, column), (rows, columns), bias,
                       request)
    return ht.Launch(grid, (threads, 1, 1))


def elementwise(args: Sequence[ir.Value], symbols: dict[str, ir.Value], request: Request) -> ht.Launch:
    x, out = args
    shaped = ir.MemRefType(x.type)
    total: sizes.Expr = 1
    for axis in range(shaped.rank):
        total = sizes.mul(total, extent(x, axis, request))
    flat_type = ir.MemRefType.get([ir.ShapedType.get_dynamic_size() if isinstance(total, tuple | str) else total],
                                  shaped.element_type)
    reassociation = ir.ArrayAttr.get([ir.ArrayAttr.get(
        [ir.IntegerAttr.get(ir.IntegerType.get_signless(64), d) for d in range(shaped.rank)])])
    flat_x = memref.CollapseShapeOp(flat_type, x, reassociation).result if shaped.rank > 1 else x
    flat_out = memref.CollapseShapeOp(flat_type, out, reassociation).result if shaped.rank > 1 else out
    blocks = sizes.ceildiv(total, ELEMENTWISE_BLOCK)
    count = ht.size_value(total, symbols)
    apply = request.scalars[request.op]
    with ht.loop(0, ht.size_value(blocks, symbols), "parallel", "blockIdx.x") as block, \
            ht.loop(0, ELEMENTWISE_BLOCK, "parallel", "threadIdx.x") as thread:
        position = _plus(_times(block, ELEMENTWISE_BLOCK), thread)
        guard = scf.IfOp(_less(position, count))
        with ir.InsertionPoint(guard.then_block):
            ht.store(apply(ht.load(flat_x, [position])), flat_out, [position])
            scf.YieldOp([])
    return ht.Launch((blocks, 1, 1), (ELEMENTWISE_BLOCK, 1, 1))
