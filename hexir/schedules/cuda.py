"""cuda schedules: every loop bound to a GPU index, every shape guarded.

linear (x[M,K] @ w[K,N], epilogues bias and fused element-wise ops): each 16x16-thread block
computes a tile x tile tile of out (`simt`, the tile from TILINGS by the grid it gives). It
walks K in slices of `step` through two shared buffers (`_pipeline`): while it computes on
one slice, each thread's loads of the next are in flight into registers (consecutive threads
at consecutive addresses, so they coalesce; out-of-range elements are 0), stored to the other
buffer after the arithmetic, one barrier per slice. x's slice is stored transposed (k-major),
so a thread's `per` rows, like its `per` columns of w's, are runs of 4 (f32) consecutive
elements read with 128-bit shared loads; each thread accumulates per x per sums in registers.

    for by in [0, ceil(M/tile)) bind blockIdx.y       x_tile[2][step][tile+4], w_tile[2][step][tile]
      for bx in [0, ceil(N/tile)) bind blockIdx.x
        for ty in [0, 16) bind threadIdx.y            sums[per][per] = 0; fetch slice 0; put
          for tx in [0, 16) bind threadIdx.x          for each k slice s: fetch s+1; FMAs on s; put s+1; barrier
                                                      out[row, col] = epilogues(sums) where row < M, col < N

linear in float64 on sm_80 and newer runs on the FP64 tensor cores instead (`dmma`): blocks of
2 x 2 or 4 x 2 warps (`DMMA_TILINGS`), each warp computing its part of the tile as `mma.sync`
m16n8k4 tiles on sm_90 (m8n8k4 where an older target is asked for), its fragments read from
shared slices in three buffers filled by asynchronous copies (cp.async, 16 bytes a copy where K
and N are even: `_pipeline_async`), two slices in flight; 128x64 tiles of odd K or N pipeline
their slices through registers as the SIMT kernel does. On the biggest tiles a thread's x
fragments for two k's come in one 16-byte shared load (which k's of an mma a thread holds is the
kernel's choice, the same in A and B: of each 8, 2 in_group and 2 in_group + 1).

A static product whose tiles are too few to fill the GPU splits K (`split_k`): grid z is the
part of K a block walks; each block writes its partial sums to a buffer in device memory
(`alloc_local` "global": a module global, zeroed at load) and counts itself in the tile's
arrivals (an atomic add); the tile's last block adds the parts in split order — the same sum
whichever block is last, so results are deterministic —, applies the epilogues and stores:

    for split in [0, S) bind blockIdx.z             k's [split * per, min((split + 1) * per, K))
      ... sums as above ...
      partial[split][tile][c][thread] = sums[c]; fence; barrier; thread 0: arrived = atomic_add(arrivals[tile], 1)
      if arrived == S - 1: fence; out[row, col] = epilogues(partial[0][tile][c][thread] + ... + partial[S-1]...)
                           thread 0: arrivals[tile] = 0

linear with at most ROWS_MAX rows (static) streams w instead (`rows`): see `linear_rows`.

The pointwise and reduce families' kernels: cuda_families.py.

The linear's tile tables (TILINGS, DMMA_TILINGS, split-K's) and the choices made from them are
in cuda_tiles.py.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Sequence

from hexir_runtime.format import exprs
from mlir import ir
from mlir.dialects import arith, llvm, memref, nvgpu, vector

from hexir.dialects import hextir as ht
from hexir.schedules import Request, cuda_mma, cuda_wgmma, extent
from hexir.schedules.cuda_mma import MMA_FROM, SIXTEEN
from hexir.schedules.cuda_tiles import (
    DMMA_REGISTER_TILE,
    DMMA_SPLIT,
    DMMA_STAGES,
    DMMA_TILINGS,
    DMMA_WHOLE,
    SIMT_WHOLE_TILES,
    TILINGS,
    copy_run,
    dmma_name,
    dmma_tiles,
    dmma_tiling,
    linear_tiling,
    split_k,
    split_length,
    uses_dmma,
)
from hexir.target import arch_number

#: At most this many rows (static): the row-streaming kernel, `rows` (a GEMV for 1 row); it beats
#: the tiled kernel up to 16 rows and loses at 32 (docs/tuning.md, "CUDA rows kernel").
ROWS_MAX = 16
#: Bytes of x per shared buffer (two) in the rows kernel, and its k's per block per step (their
#: loads of w in flight together, split among the warps): 128 (4 each of 32 warps), or 256 for
#: 16 warps where x's two buffers still fit ROWS_X_LIMIT: the faster of the two at each row count
#: (docs/tuning.md, "CUDA rows kernel").
ROWS_X_BYTES, ROWS_X_LIMIT = 4096, 32768
#: x's rows in shared memory (of more than one 128-bit vector) are padded by this many vectors:
#: its transposing stores (consecutive threads at consecutive k's, a row apart) then spread over
#: the banks; one row (one vector) lost with the padding, so it is not padded (docs/tuning.md,
#: "CUDA rows kernel").
ROWS_X_PAD = 1
ROWS_IN_FLIGHT, ROWS_WIDE_IN_FLIGHT = 128, 256


def _contract() -> ir.Attribute:
    """Let the multiply and add fuse into one FMA (one rounding instead of two)."""
    return ir.Attribute.parse("#arith.fastmath<contract>")


def _less(a: ir.Value, bound: ir.Value) -> ir.Value:
    return arith.CmpIOp(arith.CmpIPredicate.ult, a, bound).result


def _times(a: ir.Value, b: int) -> ir.Value:
    return arith.MulIOp(a, ht.index(b)).result


def _plus(a: ir.Value, b: int | ir.Value) -> ir.Value:
    return arith.AddIOp(a, ht.index(b)).result


def _guarded_load(buffer: ir.Value, row: ir.Value, column: ir.Value, rows: ir.Value, columns: ir.Value) -> ir.Value:
    """buffer[row, column] where that is inside [rows, columns), else 0 (no load happens)."""
    element = ir.MemRefType(buffer.type).element_type
    return ht.choose(arith.AndIOp(_less(row, rows), _less(column, columns)).result,
                     lambda: [ht.load(buffer, [row, column])], lambda: [_zero(element)], [element])[0]


def _store(value: Callable[[], ir.Value], out: ir.Value, at: tuple[ir.Value, ir.Value],
           bounds: tuple[ir.Value, ir.Value], bias: ir.Value | None, request: Request) -> None:
    """out[row, column] = epilogues(value()) where row < M and column < N (the store guard): the
    bias of the column, then the fused ops, each an instruction here and no pass over memory
    (`_finished`: float32 sums of 16-bit data stored in out's 16 bits)."""
    (row, column), (rows, columns) = at, bounds
    with ht.when(arith.AndIOp(_less(row, rows), _less(column, columns)).result):
        ht.store(_finished(value(), out, (row, column), bias, request), out, [row, column])


def _finished(value: ir.Value, out: ir.Value, at: tuple[ir.Value, ir.Value], bias: ir.Value | None,
              request: Request) -> ir.Value:
    """epilogues(value + bias[column]) in the sums' type (a 16-bit bias widened), as out's element type."""
    row, column = at
    sums = value.type
    if bias is not None:
        value = arith.AddFOp(value, _widen(ht.load(bias, [column]), sums)).result
    value = request.epilogue(value, [row, column])
    element = ir.MemRefType(out.type).element_type
    return value if element == sums else arith.TruncFOp(element, value).result


def _widen(value: ir.Value, to: ir.Type) -> ir.Value:
    return value if value.type == to else arith.ExtFOp(to, value).result


def _fetch(source: ir.Value, staged: ir.Value, thread: ir.Value, threads: int, width: int,
           origin: tuple[ir.Value, ir.Value], bounds: tuple[ir.Value, ir.Value], whole: bool = False) -> None:
    """Load this thread's part of a [rows, width] block of `source` at `origin` into registers
    (`staged`, one element per `threads` of the block, consecutive threads at consecutive
    addresses so the loads coalesce; outside `bounds` an element is 0 and no load happens).
    `whole`: a block that lies inside `bounds` (the same test for the whole thread block) loads
    without a test per element."""
    count = ir.MemRefType(staged.type).shape[0]

    def load(guarded: bool) -> None:
        with ht.loop(0, count, "unrolled") as e:
            r, c = _split(_plus(thread, _times(e, threads)), width)
            at = _plus(origin[0], r), _plus(origin[1], c)
            ht.store(_guarded_load(source, *at, *bounds) if guarded else ht.load(source, list(at)), staged, [e])
    if not whole:
        load(True)
        return
    assert count * threads % width == 0, "a whole block's rows must be whole rows of the slice"
    last = _plus(origin[0], ht.index(count * threads // width)), _plus(origin[1], ht.index(width))
    ht.choose(arith.AndIOp(arith.CmpIOp(arith.CmpIPredicate.ule, last[0], bounds[0]).result,
                           arith.CmpIOp(arith.CmpIPredicate.ule, last[1], bounds[1]).result).result,
              lambda: load(False), lambda: load(True))


def _put(staged: ir.Value, tile: ir.Value, buffer: ir.Value, thread: ir.Value, threads: int, width: int,
         transpose: bool = False) -> None:
    """Store what `_fetch` loaded into `tile[buffer]`, at [r, c] (or at [c, r]: transposed)."""
    with ht.loop(0, ir.MemRefType(staged.type).shape[0], "unrolled") as e:
        r, c = _split(_plus(thread, _times(e, threads)), width)
        ht.store(ht.load(staged, [e]), tile, [buffer, c, r] if transpose else [buffer, r, c])


def _split(position: ir.Value, width: int) -> tuple[ir.Value, ir.Value]:
    return arith.DivUIOp(position, ht.index(width)).result, arith.RemUIOp(position, ht.index(width)).result


def _pipeline(depth: int, step: int, fetch: Callable[[ir.Value], None], put: Callable[[ir.Value], None],
              compute: Callable[[ir.Value, ir.Value], None]) -> None:
    """Walk K in slices of `step` through two shared buffers: while the block computes on slice s
    (buffer s % 2), its loads of slice s + 1 are in flight into registers, stored into the other
    buffer after the arithmetic; one barrier per slice. (Slice s + 1 past the end loads nothing:
    the guards give zeros.)"""
    fetch(ht.index(0))
    put(ht.index(0))
    ht.barrier()
    with ht.loop(0, -(-depth // step), "serial") as k_slice:
        fetch(_times(_plus(k_slice, ht.index(1)), step))
        buffer = arith.RemUIOp(k_slice, ht.index(2)).result
        compute(buffer, _times(k_slice, step))
        put(arith.SubIOp(ht.index(1), buffer).result)
        ht.barrier()


def _copy_async(source: ir.Value, tile: ir.Value, buffer: ir.Value, thread: ir.Value, threads: int, width: int,
                count: int, origin: tuple[ir.Value, ir.Value], bounds: tuple[ir.Value, ir.Value],
                run: int = 1, bypass: bool = False) -> list[ir.Value]:
    """Copy this thread's `count` elements of a [rows, width] block of `source` at `origin` into
    `tile[buffer]` asynchronously (cp.async: global to shared memory, through no register), `run`
    consecutive elements a copy (`run` > 1 only where every run lies wholly inside or outside
    `bounds` and is aligned to its bytes), consecutive threads at consecutive addresses; what lies
    outside `bounds` is written 0 (a copy of no source bytes, from a clamped address); `bypass`: past
    L1 (cp.async.cg, 16-byte copies only). Returns the copies' tokens."""
    tokens = []
    size = ir.IntegerAttr.get(ir.IndexType.get(), run)
    for e in range(count // run):
        r, c = _split(_times(_plus(thread, ht.index(e * threads)), run), width)
        at = _plus(origin[0], r), _plus(origin[1], c)
        inside = arith.AndIOp(_less(at[0], bounds[0]), _less(at[1], bounds[1])).result
        clamped = [arith.SelectOp(inside, a, ht.index(0)).result for a in at]
        elements = arith.SelectOp(inside, ht.index(run), ht.index(0)).result
        tokens.append(nvgpu.DeviceAsyncCopyOp(tile, [buffer, r, c], source, clamped, size, srcElements=elements,
                                              bypassL1=bypass or None).result)
    return tokens


def _pipeline_async(depth: int, step: int, stages: int, copy: Callable[[ir.Value, ir.Value], list[ir.Value]],
                    compute: Callable[[ir.Value, ir.Value], None]) -> None:
    """Walk K in slices of `step` through `stages` shared buffers filled by asynchronous copies:
    `stages - 1` slices are in flight while the block computes on one. Each step waits for its
    slice's copies (all but the newest stages - 2 groups), a barrier makes every thread's copies
    visible (and every thread done with the buffer refilled next), then computes and issues the
    copies of the slice stages - 1 ahead into the buffer freed last step."""
    group = None
    for first in range(stages - 1):
        group = nvgpu.DeviceAsyncCreateGroupOp(copy(ht.index(first * step), ht.index(first))).result
    with ht.loop(0, -(-depth // step), "serial") as k_slice:
        nvgpu.DeviceAsyncWaitOp(group, numGroups=stages - 2)
        ht.barrier()
        compute(arith.RemUIOp(k_slice, ht.index(stages)).result, _times(k_slice, step))
        ahead = _plus(k_slice, ht.index(stages - 1))
        nvgpu.DeviceAsyncCreateGroupOp(copy(_times(ahead, step), arith.RemUIOp(ahead, ht.index(stages)).result))


def native_16bit(request: Request) -> bool:
    """Whether the cuda contract kernels (linear, matmul) take bfloat16/float16 operands as they
    are (accumulating in float32, the epilogue in float32, the result stored in 16 bits). False:
    lower-to-tir converts the operands to float32 and runs the float32 kernel, which stores the
    16-bit result. The linear does, on the tensor cores (`cuda_mma`, `cuda_wgmma`), where every
    target has mma.sync for 16 bits (sm_80 on)."""
    return request.op == "linear" and all(arch_number(a) >= MMA_FROM for a in request.target.cuda_archs)


def uses_tf32(request: Request) -> bool:
    """float32 products on the tensor cores in TF32 (`cuda_mma`): asked for, and on every target."""
    return request.dtype == "float32" and request.precision == "tf32" and \
        all(arch_number(a) >= MMA_FROM for a in request.target.cuda_archs)


def linear(args: Sequence[ir.Value], symbols: dict[str, ir.Value], request: Request) -> ht.Launch:
    """The kernel for the shape: bfloat16/float16 on the tensor cores (`wgmma` where every target
    is sm_90a and TMA can read x and w, else `mma`), float32 in TF32 when asked (`mma`, but few rows
    stream as below); few (static) rows stream w (`rows`); else float64 runs on the tensor cores
    where every target has DMMA (`dmma`), and the rest on the CUDA cores (`simt`)."""
    request = request.with_args(args)
    if request.dtype in SIXTEEN:  # (lower-to-tir asked native_16bit)
        k, n = extent(args[0], 1, request), extent(args[1], 1, request)
        return (cuda_wgmma.linear_wgmma if cuda_wgmma.uses_wgmma(request, k, n) else cuda_mma.linear_mma)(
            args, symbols, request)
    m = extent(args[0], 0, request)
    if uses_tf32(request) and request.w_kmajor:
        k = extent(args[0], 1, request)
        return (cuda_wgmma.linear_wgmma if cuda_wgmma.uses_wgmma(request, k, 0) else cuda_mma.linear_mma)(
            args, symbols, request)
    if uses_tf32(request) and not (isinstance(m, int) and m <= ROWS_MAX):
        return cuda_mma.linear_mma(args, symbols, request)
    if isinstance(m, int) and 0 < m <= ROWS_MAX:
        return linear_rows(args, symbols, request)
    if uses_dmma(request):
        return linear_dmma(args, symbols, request)
    return linear_simt(args, symbols, request)


def _operands(args: Sequence[ir.Value], request: Request, kmajor: bool = False) -> tuple:
    """A linear's x, w, out, bias (or None), M, K and N (w is [N, K] where `kmajor`)."""
    x, w = args[0], args[1]
    return (x, w, args[-1], args[2] if request.bias else None, extent(x, 0, request), extent(x, 1, request),
            extent(w, 0 if kmajor else 1, request))


def linear_rows(args: Sequence[ir.Value], symbols: dict[str, ir.Value], request: Request) -> ht.Launch:
    """M <= ROWS_MAX rows: w is read once, coalesced. A block's 32 lanes take 32 columns, its warps
    split K (warp y takes k = y, y + warps, ...), each thread keeping the M sums of its column
    in registers; x comes through shared memory, a chunk of its columns at a time (pipelined as
    the tiled kernels' slices are), each k's M values read as 128-bit vectors; the warps'
    partial sums are added through shared memory at the end, a row at a time."""
    x, w, out, bias, m, k_extent, n = _operands(args, request)
    element = ir.MemRefType(out.type).element_type
    size = _width_bytes(element)
    width = 16 // size                                  # elements per 128-bit shared load
    padded = max(width, 1 << (m - 1).bit_length())      # x's rows in shared memory: a power of 2
    # 32 warps (16 from 33 bytes of sums per thread on, 9 rows of f32, 5 of f64: the registers
    # of 1024 threads would not hold them): many loads in flight for the few blocks (one per 32
    # columns) a product of few rows has
    warps = 32 if m * size <= 32 else 16
    in_flight = ROWS_WIDE_IN_FLIGHT if warps == 16 and 2 * ROWS_WIDE_IN_FLIGHT * padded * size <= ROWS_X_LIMIT \
        else ROWS_IN_FLIGHT
    threads, unroll = 32 * warps, in_flight // warps
    chunk = max(ROWS_X_BYTES // (padded * size), threads // padded, in_flight)  # k's per buffer
    assert chunk % in_flight == 0 and chunk * padded % threads == 0
    ht.set_variant("rows")
    columns, depth, rows = ht.index(n), ht.index(k_extent), ht.index(m)
    with ht.loop(0, -(-n // 32), "parallel", "blockIdx.x") as block:
        # x[:, k0 + c] at [c, :], rows of more than one vector padded against bank conflicts
        x_tile = ht.alloc_local([2, chunk, padded + (ROWS_X_PAD * width if padded > width else 0)], element, "shared")
        partial = ht.alloc_local([warps, 32], element, "shared")  # one row's partial sums at a time
        with ht.loop(0, warps, "parallel", "threadIdx.y") as warp, ht.loop(0, 32, "parallel", "threadIdx.x") as lane:
            column = _plus(_times(block, 32), lane)
            thread = _plus(_times(warp, 32), lane)
            sums = _zeros([m], element)
            staged = ht.alloc_local([chunk * padded // threads], element)

            def compute(buffer: ir.Value, k0: ir.Value) -> None:
                # `unroll` k's per warp per step, their loads of w issued before any arithmetic
                with ht.loop(0, chunk // in_flight, "serial") as step:
                    cs = [_plus(_times(_plus(_times(step, unroll), ht.index(u)), warps), warp)
                          for u in range(unroll)]
                    b = [_guarded_load(w, _plus(k0, c), column, depth, columns) for c in cs]
                    for u, c in enumerate(cs):
                        a = _vector_run(x_tile, buffer, c, ht.index(0), 1, width, padded)
                        for r in range(m):
                            product = arith.MulFOp(a[r], b[u], fastmath=_contract()).result
                            at = [ht.index(r)]
                            ht.store(arith.AddFOp(ht.load(sums, at), product, fastmath=_contract()).result, sums, at)
            _pipeline(k_extent, chunk,
                      lambda k0: _fetch(x, staged, thread, threads, chunk, (ht.index(0), k0), (rows, depth)),
                      lambda buffer: _put(staged, x_tile, buffer, thread, threads, chunk, transpose=True),
                      compute)
            for r in range(m):  # row by row, the warps' partial sums added by warp r % warps
                ht.store(ht.load(sums, [ht.index(r)]), partial, [warp, lane])
                ht.barrier()
                with ht.when(arith.CmpIOp(arith.CmpIPredicate.eq, warp, ht.index(r % warps)).result):
                    _store(lambda: _sum(lambda other: ht.load(partial, [ht.index(other), lane]), warps), out,
                           (ht.index(r), column), (rows, columns), bias, request)
                ht.barrier()
    return ht.Launch((exprs.ceildiv(n, 32), 1, 1), (32, warps, 1))


def linear_simt(args: Sequence[ir.Value], symbols: dict[str, ir.Value], request: Request) -> ht.Launch:
    x, w, out, bias, m, k_extent, n = _operands(args, request)
    element = ir.MemRefType(out.type).element_type
    tile, step, per = linear_tiling(m, n, k_extent, _width_bytes(element)) if request.variant is None else \
        next(t for t, _ in TILINGS if f"t{t[0]}" == request.variant)
    if request.variant is not None:
        ht.set_variant(request.variant)
    threads = tile // per                                    # 16 threads per axis
    width = min(per, 16 // _width_bytes(element))                  # elements per 128-bit shared load
    tiles = (exprs.ceildiv(n, tile), exprs.ceildiv(m, tile))
    splits = 1 if not isinstance(m, int) else split_k(tiles[0] * tiles[1], k_extent, step,
                                                  tile * tile * _width_bytes(element))
    grid = (*tiles, splits)
    rows, columns = ht.size_value(m, symbols), ht.index(n)
    with _splits_loop(splits) as split, \
            ht.loop(0, ht.size_value(grid[1], symbols), "parallel", "blockIdx.y") as block_row, \
            ht.loop(0, grid[0], "parallel", "blockIdx.x") as block_column:
        # x's slice transposed (k-major, rows padded by one vector against bank conflicts on
        # the transposing stores), w's as it is: a thread's rows and columns are then runs of
        # `width` consecutive elements, each read with one 128-bit load
        x_tile = ht.alloc_local([2, step, tile + width], element, "shared")
        w_tile = ht.alloc_local([2, step, tile], element, "shared")
        k_length, k_first, depth = _k_range(k_extent, step, splits, split)
        with ht.loop(0, threads, "parallel", "threadIdx.y") as ty, \
                ht.loop(0, threads, "parallel", "threadIdx.x") as tx:
            sums = _zeros([per, per], element)
            thread = _plus(_times(ty, threads), tx)
            row0, column0 = _times(block_row, tile), _times(block_column, tile)

            def compute(buffer: ir.Value, k0: ir.Value) -> None:
                # the sums read once and written once a slice, SSA values between (the same code
                # after LLVM's mem2reg, a third of the ops for MLIR to convert: compile time)
                at = [[ht.index(i), ht.index(j)] for i in range(per) for j in range(per)]
                running = [ht.load(sums, index) for index in at]
                for kk in map(ht.index, range(step)):  # unrolled here: constant shared offsets
                    a = _vector_run(x_tile, buffer, kk, ty, threads, width, per)
                    b = _vector_run(w_tile, buffer, kk, tx, threads, width, per)
                    running = [arith.AddFOp(total, arith.MulFOp(a[c // per], b[c % per], fastmath=_contract()).result,
                                            fastmath=_contract()).result for c, total in enumerate(running)]
                for total, index in zip(running, at, strict=True):
                    ht.store(total, sums, index)
            _slices((x, w), (x_tile, w_tile), thread, threads * threads, (tile, tile, step), (row0, column0),
                    (rows, depth, columns), (k_length, k_first, split), compute, 0, 0, tile in SIMT_WHOLE_TILES,
                    x_transposed=True)

            def finish(c: int, value: Callable[[], ir.Value]) -> None:
                i, j = divmod(c, per)
                row = _plus(row0, _plus(_times(ty, width), ht.index(_spread(i, threads, width))))
                column = _plus(column0, _plus(_times(tx, width), ht.index(_spread(j, threads, width))))
                _store(value, out, (row, column), (rows, columns), bias, request)
            values = [lambda c=c: ht.load(sums, [ht.index(c // per), ht.index(c % per)]) for c in range(per * per)]
            _reduce_splits(values, element, finish, split, (block_row, block_column), grid, thread, threads * threads)
    return ht.Launch(grid, (threads, threads, 1))


def _splits_loop(splits: int):
    """The loop over split-K's parts of K (blockIdx.z), or none (the split is then None)."""
    return ht.loop(0, splits, "parallel", "blockIdx.z") if splits > 1 else contextlib.nullcontext()


def _k_range(k_extent: int, step: int, splits: int, split: ir.Value | None) -> tuple[int, ir.Value, ir.Value]:
    """This block's part of K: (its length, where it starts, where K or it ends)."""
    if split is None:
        return k_extent, ht.index(0), ht.index(k_extent)
    per = split_length(k_extent, splits, step)
    first = _times(split, per)
    return per, first, arith.MinUIOp(_plus(first, ht.index(per)), ht.index(k_extent)).result


def _fence() -> None:
    """Order this thread's global memory accesses before and after, GPU-wide (PTX fence.acq_rel.gpu)."""
    llvm.InlineAsmOp(None, [], "fence.acq_rel.gpu;", "~{memory}", has_side_effects=True)


def _reduce_splits(values: list[Callable[[], ir.Value]], element: ir.Type,
                   finish: Callable[[int, Callable[[], ir.Value]], None], split: ir.Value | None,
                   block: tuple[ir.Value, ir.Value], grid: tuple[exprs.Expr, ...], thread: ir.Value,
                   threads: int) -> None:
    """finish(c, value) for each of a thread's sums: directly without a split; with one, each block
    writes its partial sums to device memory (`global` buffers) and counts itself in its tile's
    arrivals; the last to arrive adds the tile's partial sums in split order (the same result
    whichever block is last), finishes, and zeroes the count for the next launch."""
    if split is None:
        for c, value in enumerate(values):
            finish(c, value)
        return
    splits, tiles = grid[2], grid[0] * grid[1]  # (static: only a static product splits)
    tile = _plus(_times(block[0], grid[0]), block[1])  # its index in the grid (row-major)
    i32 = ir.IntegerType.get_signless(32)
    partial = ht.alloc_local([splits, tiles, len(values), threads], element, "global")
    arrivals = ht.alloc_local([tiles], i32, "global")
    last = ht.alloc_local([1], i32, "shared")
    for c, value in enumerate(values):
        ht.store(value(), partial, [split, tile, ht.index(c), thread])
    _fence()
    ht.barrier()
    with ht.when(arith.CmpIOp(arith.CmpIPredicate.eq, thread, ht.index(0)).result):
        one = arith.ConstantOp(i32, 1).result
        ht.store(memref.AtomicRMWOp(arith.AtomicRMWKind.addi, one, arrivals, [tile]).result, last, [ht.index(0)])
    ht.barrier()
    with ht.when(arith.CmpIOp(arith.CmpIPredicate.eq, ht.load(last, [ht.index(0)]),
                              arith.ConstantOp(i32, splits - 1).result).result):
        _fence()
        for c in range(len(values)):
            finish(c, lambda c=c: _sum(lambda part: ht.load(partial, [ht.index(part), tile, ht.index(c), thread]),
                                       splits))
        with ht.when(arith.CmpIOp(arith.CmpIPredicate.eq, thread, ht.index(0)).result):
            ht.store(arith.ConstantOp(i32, 0).result, arrivals, [tile])


def _sum(load: Callable[[int], ir.Value], count: int) -> ir.Value:
    """load(0) + load(1) + ... + load(count - 1), added in that order."""
    return functools.reduce(lambda total, other: arith.AddFOp(total, load(other)).result, range(1, count), load(0))


def _zeros(shape: list[int], element: ir.Type) -> ir.Value:
    """A thread's private buffer of sums, zeroed. Its every index is a constant (the loops over
    it are unrolled here, not left to LLVM), so NVVM keeps it in registers, never on the stack."""
    sums = ht.alloc_local(shape, element)
    zero = _zero(element)
    for at in itertools.product(*map(range, shape)):
        ht.store(zero, sums, list(map(ht.index, at)))
    return sums


def _zero(element: ir.Type) -> ir.Value:
    return arith.ConstantOp(element, ir.FloatAttr.get(element, 0.0)).result


def _spread(i: int, threads: int, width: int) -> int:
    """Where a thread's i-th row (column) lies from its first: runs of `width`, `threads * width` apart."""
    return i // width * threads * width + i % width


def _vector_run(tile: ir.Value, buffer: ir.Value, kk: ir.Value, thread: ir.Value, threads: int, width: int,
                per: int) -> list[ir.Value]:
    """The thread's `per` elements of row kk of `tile[buffer]`, as `per / width` 128-bit loads."""
    element = ir.MemRefType(tile.type).element_type
    vector_type = ir.VectorType.get([width], element)
    values = []
    for run in range(per // width):
        start = _plus(_times(thread, width), ht.index(run * threads * width))
        loaded = vector.LoadOp(vector_type, tile, [buffer, kk, start], alignment=width * _width_bytes(element)).result
        values += [vector.ExtractOp(loaded, [], [v]).result for v in range(width)]
    return values


def _width_bytes(element: ir.Type) -> int:
    return ir.FloatType(element).width // 8


def _warp_places(thread: ir.Value, block: tuple[ir.Value, ir.Value], tiling: Sequence[int]) -> tuple:
    """A thread of a block of warps (the tensor-core kernels'): its lane, the lane's (group, place in
    it), where its warp's part of the tile starts in the tile and where the block's tile starts in out."""
    tile_m, tile_n, warps_m, warps_n = tiling
    warp, lane = _split(thread, 32)
    group, in_group = _split(lane, 4)
    warp_row = _times(arith.DivUIOp(warp, ht.index(warps_n)).result, tile_m // warps_m)
    warp_column = _times(arith.RemUIOp(warp, ht.index(warps_n)).result, tile_n // warps_n)
    return lane, (group, in_group), (warp_row, warp_column), (_times(block[0], tile_m), _times(block[1], tile_n))


def _c_place(places: tuple, mma_m: int, i: int, j: int, h: int) -> tuple[ir.Value, ir.Value]:
    """Where C value h of a warp's mma tile (i, j) goes in out (`places`: `_warp_places`' last three):
    rows group [+ 8], columns 2 in_group + (0, 1)."""
    (group, in_group), (warp_row, warp_column), (row0, column0) = places
    row = _plus(row0, _plus(warp_row, _plus(ht.index(mma_m * i + 8 * (h // 2)), group)))
    return row, _plus(column0, _plus(warp_column, _plus(ht.index(8 * j + h % 2), _times(in_group, 2))))


def _slices(operands: tuple, tiles: tuple, thread: ir.Value, threads: int, tiling: tuple[int, int, int],
            origin: tuple[ir.Value, ir.Value], bounds: tuple, k_part: tuple, compute: Callable, stages: int,
            run: int, whole: bool = True, bypass: bool = False, kmajor: bool = False, x_transposed: bool = False
            ) -> None:
    """Walk the block's part of K (`k_part`: its length, its start, the split or None) through the
    shared tiles of x and w: `stages` buffers filled by cp.async (`run` elements a copy; `bypass`:
    past L1), or with stages 0 two buffers through registers (`whole` as `_fetch` has it; x's
    tile k-major where `x_transposed`). w is [K, N], or [N, K] (`kmajor`: read as x is)."""
    (x, w), (x_tile, w_tile), (tile_m, tile_n, step), (row0, column0), (rows, depth, columns) = \
        operands, tiles, tiling, origin, bounds
    k_length, k_first, split = k_part
    x_count, w_count = tile_m * step // threads, tile_n * step // threads
    if stages:
        def copy(k0: ir.Value, buffer: ir.Value) -> list[ir.Value]:
            k0 = k0 if split is None else _plus(k_first, k0)
            w_part = (step, (column0, k0), (columns, depth)) if kmajor else (tile_n, (k0, column0), (depth, columns))
            return (_copy_async(x, x_tile, buffer, thread, threads, step, x_count, (row0, k0), (rows, depth), run,
                                bypass)
                    + _copy_async(w, w_tile, buffer, thread, threads, w_part[0], w_count, *w_part[1:], run, bypass))
        return _pipeline_async(k_length, step, stages, copy, compute)
    element = ir.MemRefType(x_tile.type).element_type
    x_staged, w_staged = ht.alloc_local([x_count], element), ht.alloc_local([w_count], element)

    def fetch(k0: ir.Value) -> None:
        k0 = k0 if split is None else _plus(k_first, k0)
        _fetch(x, x_staged, thread, threads, step, (row0, k0), (rows, depth), whole)
        _fetch(w, w_staged, thread, threads, tile_n, (k0, column0), (depth, columns), whole)

    def put(buffer: ir.Value) -> None:
        _put(x_staged, x_tile, buffer, thread, threads, step, x_transposed)
        _put(w_staged, w_tile, buffer, thread, threads, tile_n)
    _pipeline(k_length, step, fetch, put, compute)


def linear_dmma(args: Sequence[ir.Value], symbols: dict[str, ir.Value], request: Request) -> ht.Launch:
    x, w, out, bias, m, k_extent, n = _operands(args, request)
    element = ir.MemRefType(out.type).element_type
    tiling = dmma_tiling(m, n, k_extent, request.target.cuda_archs) if request.variant is None else \
        next(t for t, _ in DMMA_TILINGS if dmma_name(t) == request.variant)
    tile_m, tile_n, step, warps_m, warps_n, pairs = tiling
    threads = 32 * warps_m * warps_n
    # m16n8k4 where every target has it (sm_90: twice the rate of m8n8k4; docs/tuning.md, "CUDA
    # DMMA instruction"), else m8n8k4 (sm_80 on)
    mma_m = 16 if all(arch_number(a) >= 90 for a in request.target.cuda_archs) else 8
    frags_m, frags_n = tile_m // warps_m // mma_m, tile_n // warps_n // 8   # mma tiles per warp
    tiles = (exprs.ceildiv(n, tile_n), exprs.ceildiv(m, tile_m))
    splits = 1 if not isinstance(m, int) else split_k(tiles[0] * tiles[1], k_extent, step,
                                                  tile_m * tile_n * _width_bytes(element), *DMMA_SPLIT)
    grid = (*tiles, splits)
    rows, columns = ht.size_value(m, symbols), ht.index(n)
    halves, sums_per = mma_m // 8, mma_m // 4  # a thread's A values (rows g, g + 8) and C values
    ht.set_variant(request.variant or "dmma")
    with _splits_loop(splits) as split, \
            ht.loop(0, ht.size_value(grid[1], symbols), "parallel", "blockIdx.y") as block_row, \
            ht.loop(0, grid[0], "parallel", "blockIdx.x") as block_column:
        # slices by cp.async (`copy_run` elements a copy), or through registers on the big
        # tiles when a copy takes one element (see DMMA_STAGES)
        run = copy_run(k_extent, n)
        stages = DMMA_STAGES if run > 1 or (tile_m, tile_n) != DMMA_REGISTER_TILE else 0
        paired = pairs == 2
        assert not paired or step % 8 == 0, "paired fragment loads take the slice's k's 8 at a time"
        x_tile, w_tile = (ht.alloc_local(shape, element, "shared") for shape in dmma_tiles(tiling, stages or 2))
        k_length, k_first, depth = _k_range(k_extent, step, splits, split)
        with ht.loop(0, threads, "parallel", "threadIdx.x") as thread:
            sums = _zeros([frags_m, frags_n, sums_per], element)
            _, *spots = _warp_places(thread, (block_row, block_column), (tile_m, tile_n, warps_m, warps_n))
            (group, in_group), (warp_row, warp_column), _ = spots

            def a_row(f: int, r: int) -> ir.Value:
                return _plus(warp_row, _plus(ht.index(mma_m * f + 8 * r), group))

            def compute(buffer: ir.Value, k0: ir.Value) -> None:
                # fragments: A (rows group [+ 8], a column per in_group), B (that row, column group).
                # Paired: of each 8 k's, thread in_group takes 2 in_group and 2 in_group + 1, its
                # x values one 16-byte load, an mma on the even ones then one on the odd (which k
                # of four a thread holds is ours to choose, alike in A and B)
                for kq in range(0, step // 4, 1 + paired):  # unrolled here: constant shared offsets
                    if paired:
                        kk = _plus(ht.index(4 * kq), _times(in_group, 2))
                        pair = ir.VectorType.get([2], element)
                        loaded = [[vector.LoadOp(pair, x_tile, [buffer, a_row(f, r), kk], alignment=16).result
                                   for r in range(halves)] for f in range(frags_m)]
                        ks = [(kk, [[vector.ExtractOp(v, [], [h]).result for v in row] for row in loaded])
                              for kk, h in ((kk, 0), (_plus(kk, ht.index(1)), 1))]
                    else:
                        kk = _plus(ht.index(4 * kq), in_group)
                        ks = [(kk, [[ht.load(x_tile, [buffer, a_row(f, r), kk]) for r in range(halves)]
                                    for f in range(frags_m)])]
                    for kk, a in ks:
                        b = [ht.load(w_tile, [buffer, kk, _plus(warp_column, _plus(ht.index(8 * f), group))])
                             for f in range(frags_n)]
                        for fi, fj in itertools.product(range(frags_m), range(frags_n)):
                            at = [ht.index(fi), ht.index(fj)]
                            c = [ht.load(sums, [*at, ht.index(h)]) for h in range(sums_per)]
                            d = _mma_f64(mma_m, a[fi], b[fj], c)
                            for h in range(sums_per):
                                ht.store(llvm.ExtractValueOp(element, d, [h]).result, sums, [*at, ht.index(h)])

            _slices((x, w), (x_tile, w_tile), thread, threads, (tile_m, tile_n, step), spots[2], (rows, depth, columns),
                    (k_length, k_first, split), compute, stages, run, DMMA_WHOLE)
            places = list(itertools.product(range(frags_m), range(frags_n), range(sums_per)))

            def finish(c: int, value: Callable[[], ir.Value]) -> None:
                _store(value, out, _c_place(spots, mma_m, *places[c]), (rows, columns), bias, request)
            values = [lambda at=at: ht.load(sums, list(map(ht.index, at))) for at in places]
            _reduce_splits(values, element, finish, split, (block_row, block_column), grid, thread, threads)
    return ht.Launch(grid, (threads, 1, 1))


def _mma_f64(m: int, a: list[ir.Value], b: ir.Value, c: list[ir.Value]) -> ir.Value:
    """D = A B + C on the FP64 tensor cores, `mma.sync.aligned.m{m}n8k4.row.col.f64` (NVVM's mma
    op knows only m8n8k4 for f64), as a struct of the thread's C values."""
    return cuda_mma.mma_sync(f"m{m}n8k4.row.col.f64.f64.f64.f64", a, [b], c, "f64", "d")

