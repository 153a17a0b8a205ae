"""cuda linear on the tensor cores with `mma.sync` (sm_80 on): bfloat16 / float16 in, float32 sums
(m16n8k16), and float32 in TF32 where the request asks for it (m16n8k8, inputs rounded to TF32
to nearest, ties away: `cvt.rna`, as cuBLAS does).

Each 256-thread block computes a 128x128 tile of out; its 8 warps (2 along M x 4 along N) a
64x32 part each, as 4 x 4 mma tiles whose f32 sums stay in registers. K is walked in slices of
32 through MMA_STAGES shared buffers filled by cp.async (`cuda._pipeline_async`: 16 bytes a copy
where K and N allow it, 4 otherwise; what lies outside x or w is written 0, so ragged M, N, K
need no other test), or, where no copy of 4 bytes fits (odd K or N in 16 bits), through
registers (`cuda._pipeline`). 16-bit fragments come from shared memory by `ldmatrix` (x4; w,
stored [K][N], with `.trans`), TF32's by single loads. Rows of the slices are padded by 16
bytes (16-bit) so that ldmatrix's 8 rows of 16 bytes, and TF32's loads, fall on distinct banks.

    for by in [0, ceil(M/128)) bind blockIdx.y       x_tile[S][128][32+pad], w_tile[S][32][128+pad]
      for bx in [0, ceil(N/128)) bind blockIdx.x
        for t in [0, 256) bind threadIdx.x            sums[4][4][4] f32 = 0
          for each k slice: wait for its copies; barrier; per k16 (k8): ldmatrix A, B; 16 mma; copy slice + S - 1
          out[row, col] = to_16bit(epilogue(sums + bias)) where row < M, col < N (C: rows g, g+8, cols 2t, 2t+1)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from hexir_runtime.format import exprs
from mlir import ir
from mlir.dialects import arith, llvm, nvgpu, vector

from hexir.dialects import hextir as ht
from hexir.schedules import Request, cuda

#: (block rows, block columns, k slice, warps along rows, warps along columns)
MMA_TILING = (128, 128, 32, 2, 4)
#: The tiling of a product of at most 64 columns (4 warps of 32x32): 1000 x 1024 x 33 in bf16 from
#: 0.80 to 1.45 of cuBLAS (the 128-column tile computed 95 idle columns; docs/tuning.md, "round 8").
MMA_NARROW = (64, 64, 32, 2, 2)
#: Shared buffers of slices in flight (cp.async) and the padding of a slice's rows (elements) for
#: 16-bit inputs and for TF32: 16 bytes spread ldmatrix's rows over the banks; TF32's x loads (8
#: rows x 4 k's a warp) need rows 4 banks apart, w's (4 k's x 8 columns) 8 apart.
MMA_STAGES = 3
#: Split-K (`mma_splits`): (blocks to reach, most parts, fewest k slices a part).
MMA_SPLIT = (132, 8, 4)
MMA_PAD = {16: (8, 8), 32: (4, 8)}
SIXTEEN = ("bfloat16", "float16")
#: mma.sync with 16-bit and TF32 operands exists from sm_80 on.
MMA_FROM = 80
_PTX = {"bfloat16": "bf16", "float16": "f16"}


def linear_mma(args: Sequence[ir.Value], symbols: dict[str, ir.Value], request: Request) -> ht.Launch:
    kmajor = request.w_kmajor  # TF32's w given transposed, [N, K] (pack-weights): read as x is
    x, w, out, bias, m, k_extent, n = cuda._operands(args, request, kmajor)
    element = ir.MemRefType(x.type).element_type
    bits = ir.FloatType(element).width
    tf32 = bits == 32
    f32 = ir.F32Type.get()
    tile_m, tile_n, step, warps_m, warps_n = MMA_NARROW if n <= MMA_NARROW[1] else MMA_TILING
    threads = 32 * warps_m * warps_n
    frags_m, frags_n = tile_m // warps_m // 16, tile_n // warps_n // 8
    mma_k = 8 if tf32 else 16
    tiles = (exprs.ceildiv(n, tile_n), exprs.ceildiv(m, tile_m))
    splits = mma_splits(tiles[0] * tiles[1], k_extent) if isinstance(m, int) else 1
    grid = (*tiles, splits)
    rows, columns = ht.size_value(m, symbols), ht.index(n)
    run = copy_elements(k_extent, k_extent if kmajor else n, bits)
    stages = MMA_STAGES if run else 2
    pad_x, pad_w = MMA_PAD[bits][0], MMA_PAD[bits][0 if kmajor else 1]
    ht.set_variant("tf32" if tf32 else "mma")
    with cuda._splits_loop(splits) as split, \
            ht.loop(0, ht.size_value(grid[1], symbols), "parallel", "blockIdx.y") as block_row, \
            ht.loop(0, grid[0], "parallel", "blockIdx.x") as block_column:
        k_length, k_first, depth = cuda._k_range(k_extent, step, splits, split)
        x_tile = ht.alloc_local([stages, tile_m, step + pad_x], element, "shared")
        w_tile = ht.alloc_local([stages, tile_n, step + pad_w] if kmajor else [stages, step, tile_n + pad_w], element,
                                "shared")
        with ht.loop(0, threads, "parallel", "threadIdx.x") as thread:
            sums = cuda._zeros([frags_m, frags_n, 4], f32)
            lane, *spots = cuda._warp_places(thread, (block_row, block_column), (tile_m, tile_n, warps_m, warps_n))
            (group, in_group), (warp_row, warp_column), _ = spots
            half, in_half = cuda._split(lane, 16)   # ldmatrix: lane l gives row l % 16 of column 8 (l / 16)

            def compute(buffer: ir.Value, k0: ir.Value) -> None:
                for kk in range(0, step, mma_k):  # unrolled here: constant shared offsets
                    if tf32:
                        a, b = _tf32_fragments(x_tile, w_tile, buffer, kk, (warp_row, warp_column),
                                               (group, in_group), (frags_m, frags_n), kmajor)
                    else:
                        a = [_ldmatrix(x_tile, [buffer, cuda._plus(warp_row, cuda._plus(ht.index(16 * f), in_half)),
                                                cuda._plus(ht.index(kk), cuda._times(half, 8))], False)
                             for f in range(frags_m)]
                        b = []
                        for p in range(frags_n // 2):  # x4 .trans: two n8 tiles, k 0-7 and 8-15 of each
                            column = cuda._plus(warp_column, cuda._plus(ht.index(16 * p), cuda._times(half, 8)))
                            pair = _ldmatrix(w_tile, [buffer, cuda._plus(ht.index(kk), in_half), column], True)
                            b += [pair[:2], pair[2:]]
                    for fi, fj in itertools.product(range(frags_m), range(frags_n)):
                        at = [ht.index(fi), ht.index(fj)]
                        c = [ht.load(sums, [*at, ht.index(h)]) for h in range(4)]
                        d = _mma(request.dtype if not tf32 else "tf32", a[fi], b[fj], c)
                        for h in range(4):
                            ht.store(llvm.ExtractValueOp(f32, d, [h]).result, sums, [*at, ht.index(h)])

            # (16-byte copies past L1: cp.async.cg)
            cuda._slices((x, w), (x_tile, w_tile), thread, threads, (tile_m, tile_n, step), spots[2],
                         (rows, depth, columns), (k_length, k_first, split), compute, stages if run else 0, run,
                         bypass=run * bits == 128, kmajor=kmajor)

            def place(fi: int, fj: int, h: int) -> tuple[ir.Value, ir.Value]:
                return cuda._c_place(spots, 16, fi, fj, h)
            if split is None:
                for fi, fj, h in itertools.product(range(frags_m), range(frags_n), (0, 2)):  # pairs of columns
                    pair = [ht.load(sums, list(map(ht.index, (fi, fj, h + e)))) for e in range(2)]
                    store_pair(pair, out, place(fi, fj, h), (rows, columns), bias, request)
            else:  # the tile's last block adds the parts (cuda.py's split-K)
                places = list(itertools.product(range(frags_m), range(frags_n), range(4)))
                cuda._reduce_splits([lambda at=at: ht.load(sums, list(map(ht.index, at))) for at in places], f32,
                                    lambda c, value: cuda._store(value, out, place(*places[c]), (rows, columns), bias,
                                                               request),
                                    split, (block_row, block_column), grid, thread, threads)
    return ht.Launch(grid, (threads, 1, 1))


def mma_splits(blocks: int, k: int) -> int:
    """Split-K's parts for a static product of `blocks` tiles: enough to give the GPU MMA_SPLIT[0]
    blocks, at most MMA_SPLIT[1], each part at least MMA_SPLIT[2] slices of K."""
    fill, most, slices = MMA_SPLIT
    splits = min(-(-fill // blocks), most, k // (slices * MMA_TILING[2]))
    return 1 if splits <= 1 else -(-k // cuda.split_length(k, splits, MMA_TILING[2]))


def copy_elements(k: int, n: int, bits: int) -> int:
    """Elements a cp.async copy takes: 16 bytes where K and N are multiples of them (every row then
    starts 16-byte aligned), else 4 bytes where they are multiples of those, else 0 (no copy fits:
    slices come through registers)."""
    for size in (16, 4):
        elements = size * 8 // bits
        if k % elements == 0 and n % elements == 0:
            return elements
    return 0


def store_pair(values: list[ir.Value], out: ir.Value, at: tuple[ir.Value, ir.Value],
               bounds: tuple[ir.Value, ir.Value], bias: ir.Value | None, request: Request) -> None:
    """out[row, column + e] = values[e] as `cuda._store` does, e = 0, 1 (column even): one 4-byte
    store where N is even (then both or neither are inside, and aligned), else two."""
    (row, column), (rows, columns) = at, bounds
    if ir.MemRefType(out.type).shape[1] % 2:
        for e, value in enumerate(values):
            cuda._store(lambda value=value: value, out, (row, cuda._plus(column, ht.index(e))), bounds, bias, request)
        return
    element = ir.MemRefType(out.type).element_type
    with ht.when(arith.AndIOp(cuda._less(row, rows), cuda._less(column, columns)).result):
        results = [cuda._finished(value, out, (row, cuda._plus(column, ht.index(e))), bias, request)
                   for e, value in enumerate(values)]
        pair = vector.FromElementsOp(ir.VectorType.get([2], element), results).result
        vector.StoreOp(pair, out, [row, column], alignment=2 * ir.FloatType(element).width // 8)


def _ldmatrix(tile: ir.Value, at: list[ir.Value], transpose: bool) -> list[ir.Value]:
    """ldmatrix x4 from a shared slice: the thread's four 32-bit registers (two 16-bit values each)."""
    element = ir.MemRefType(tile.type).element_type
    loaded = nvgpu.LdMatrixOp(ir.VectorType.get([4, 2], element), tile, at, transpose, 4).result
    i32 = ir.IntegerType.get_signless(32)
    registers = []
    for r in range(4):
        pair = vector.ExtractOp(loaded, [], [r]).result
        word = vector.BitCastOp(ir.VectorType.get([1], i32), pair).result
        registers.append(vector.ExtractOp(word, [], [0]).result)
    return registers


def _tf32_fragments(x_tile: ir.Value, w_tile: ir.Value, buffer: ir.Value, kk: int, warp: tuple[ir.Value, ir.Value],
                    lane: tuple[ir.Value, ir.Value], frags: tuple[int, int], kmajor: bool) -> tuple[list, list]:
    """m16n8k8 TF32 fragments, each f32 rounded to TF32 (rna): A (rows g, g + 8; k's t, t + 4), B (k's
    t, t + 4; column g), for g, t = the lane's group and place in it."""
    (warp_row, warp_column), (group, in_group) = warp, lane
    k = [cuda._plus(ht.index(kk + 4 * h), in_group) for h in range(2)]
    a = [[_to_tf32(ht.load(x_tile, [buffer, cuda._plus(warp_row, cuda._plus(ht.index(16 * f + 8 * r), group)), k[h]]))
          for h in range(2) for r in range(2)] for f in range(frags[0])]
    columns = [cuda._plus(warp_column, cuda._plus(ht.index(8 * f), group)) for f in range(frags[1])]
    b = [[_to_tf32(ht.load(w_tile, [buffer, column, k[h]] if kmajor else [buffer, k[h], column])) for h in range(2)]
         for column in columns]
    return a, b


def _to_tf32(value: ir.Value) -> ir.Value:
    i32 = ir.IntegerType.get_signless(32)
    return llvm.InlineAsmOp(i32, [value], "cvt.rna.tf32.f32 $0, $1;", "=r,f").result


def _mma(kind: str, a: list[ir.Value], b: list[ir.Value], c: list[ir.Value]) -> ir.Value:
    """D = A B + C, `mma.sync.aligned` m16n8k16 (bf16, f16) or m16n8k8 (tf32), f32 sums."""
    shape, ptx = ("m16n8k8", "tf32") if kind == "tf32" else ("m16n8k16", _PTX[kind])
    return mma_sync(f"{shape}.row.col.f32.{ptx}.{ptx}.f32", a, b, c, "f32", "r")


def mma_sync(instruction: str, a: list[ir.Value], b: list[ir.Value], c: list[ir.Value], sums: str,
             inputs: str) -> ir.Value:
    """D = A B + C by `mma.sync.aligned.<instruction>` (inline PTX: NVVM's mma op lacks some of
    ours), A and B in registers of constraint `inputs`: a struct of the thread's C values (`sums`)."""
    first, groups = 0, []
    for count in (len(c), len(a), len(b), len(c)):  # $0.. the outputs, then the operands in the order named
        groups.append("{" + ", ".join(f"${n}" for n in range(first, first + count)) + "}")
        first += count
    result = ir.Type.parse(f"!llvm.struct<({', '.join([sums] * len(c))})>")
    register = {"f32": "f", "f64": "d"}[sums]
    constraints = ",".join([f"={register}"] * len(c) + [inputs] * (len(a) + len(b)) + [register] * len(c))
    return llvm.InlineAsmOp(result, [*a, *b, *c], f"mma.sync.aligned.{instruction} {', '.join(groups)};",
                            constraints).result
