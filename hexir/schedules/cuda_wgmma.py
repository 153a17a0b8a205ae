"""cuda linear on Hopper's warpgroup tensor cores (`wgmma`, sm_90a only): bfloat16 / float16 in,
float32 sums, warp-specialized, persistent.

A block of three warpgroups computes 256x128 tiles of out: warpgroups 0 and 1 (the consumers)
128 rows each, as wgmma m64n128k16 from shared memory into 128 f32 sums a thread; warpgroup 2's
first thread (the producer) loads the k slices (64 deep) with TMA (the tensor copy engine: x's
[128 rows x 64 k] boxes and w's [64 k x 64 columns], 128-byte swizzled, what lies outside the
tensors filled with zeros) into WG_STAGES shared stages. Each stage has two mbarriers: `full`
(the producer's copies landed: a transaction count) and `empty` (each consumer warp is done
with it). The grid has at most WG_BLOCKS blocks, each walking tiles block, block + blocks, ...
in groups of GROUP_M tile rows (whose x rows and w columns stay in L2 together); the stages and
their phases run on across a block's tiles, so the producer loads the next tile while the
consumers store this one: straight from the accumulator's registers, the bias added and the
fused ops applied in f32, two 16-bit columns a 4-byte store, guarded. The tensor maps TMA reads
come from the runtime (`hextir.tensor_maps`: one per x and w, encoded per call for the buffers'
addresses and extents), as extra pointer parameters after the kernel's sizes. A product of at
most a wave of such tiles takes 128x128 ones (`wgmma_tile`).

TF32 (float32 with precision "tf32"): wgmma's TF32 reads both operands K-major, so w comes as
w^T [N, K] (pack-weights stores a constant so, rounded), the k slices are 32 deep (128-byte rows
of both), and each consumer rounds its rows of x in the stage to TF32 (cvt.rna) before it issues
m64n128k8 with descriptors made here.

    for b in [0, min(tiles, 132)) bind blockIdx.x          stages[S] of x[256][64], w[64][128]
      for t in [0, 384) bind threadIdx.x                   full[S], empty[S] mbarriers
        producer (t == 256): for each tile, each k slice: wait empty[s]; expect bytes; 4 TMA loads -> full[s]
        consumers (t < 256): for each tile: for each k slice: wait full[s]; 8 wgmma (async); the
          slice before done -> empty; out[r, c] = to_16bit(epilogue(sums + bias)) where r < M, c < N
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from hexir_runtime.format import exprs
from mlir import ir
from mlir.dialects import arith, builtin, llvm, memref, nvgpu, nvvm, vector

from hexir.dialects import hextir as ht
from hexir.schedules import Request, cuda, extent
from hexir.schedules.cuda_mma import _to_tf32, store_pair
from hexir.target import arch_number

#: Tile rows (two consumer warpgroups of 128), columns, k slice; shared stages in flight.
WG_TILE, WG_STAGES = (256, 128, 64), 4
#: The tile of a product of at most WG_BLOCKS WG_TILE tiles, one wave or less (consumers of 64 rows
#: each: twice the blocks): 1024 x 2048 x 2048 bf16 from 0.75 to 1.18 of cuBLAS, 2048^3 0.88 -> 0.93,
#: where 4096^3 (512 tiles) lost (0.92 -> 0.86; docs/tuning.md, "round 8").
WG_SMALL_TILE = (128, 128, 64)
#: Tile rows walked together (GROUP_M x all tile columns) before the next group; blocks at most
#: (one per SM of an H100/H200: each walks tiles block, block + WG_BLOCKS, ...).
GROUP_M, WG_BLOCKS = 8, 132
#: Registers a thread of the producer / of a consumer warpgroup keeps after setmaxnreg (384 threads
#: start with 168): the consumers' 232 took 8192^3 bf16 from 0.81 to 0.93 of cuBLAS
#: (docs/tuning.md, "CUDA tensor-core linear: wgmma").
WG_REGISTERS = (40, 232)
#: TF32: each consumer rounds its rows of x to TF32 in shared memory (cvt.rna, as cuBLAS) before
#: its wgmma (else the tensor cores truncate): 0.71 of cuBLAS at 4096^3, where truncating ran at
#: 1.01 and the producer warpgroup's idle warps rounding each stage 0.65 (docs/tuning.md, "round 8").
TF32_ROUND = True
_WORKGROUP = "#gpu.address_space<workgroup>"


def uses_wgmma(request: Request, k: int, n: int) -> bool:
    """On sm_90a alone: 16-bit inputs, or float32 in TF32 with w K-major (pack-weights); rows of x
    and w a multiple of 16 bytes (TMA's pitch)."""
    sixteen = request.dtype in ("bfloat16", "float16") and k % 8 == 0 and n % 8 == 0
    tf32 = request.dtype == "float32" and request.precision == "tf32" and request.w_kmajor and k % 4 == 0
    return (sixteen or tf32) and all(a.endswith("a") and arch_number(a) == 90 for a in request.target.cuda_archs)


def _view(base: ir.Value, offset: int | ir.Value, shape: Sequence[int], element: ir.Type) -> ir.Value:
    """A [shape] view of the shared bytes `base` at byte `offset`."""
    type_ = ir.MemRefType.get(list(shape), element, memory_space=ir.Attribute.parse(_WORKGROUP))
    return memref.ViewOp(type_, base, ht.index(offset), []).result


def _tensor_map(pointer: ir.Value, box: Sequence[int], element: ir.Type) -> ir.Value:
    """The tensor map the runtime passes (a pointer) as nvgpu's descriptor type for a [box] tile."""
    type_ = ir.Type.parse(f"!nvgpu.tensormap.descriptor<tensor = memref<{box[0]}x{box[1]}x{element}, 3>, "
                          "swizzle = swizzle_128b, l2promo = l2promo_128b, oob = zero, interleave = none>")
    return builtin.UnrealizedConversionCastOp([type_], [pointer]).result


def _parity(round_: ir.Value, flip: bool) -> ir.Value:
    """The mbarrier phase parity to wait for in round `round_` of a stage (`flip`: the producer's
    wait on `empty`, which passes in round 0)."""
    odd = arith.CmpIOp(arith.CmpIPredicate.ne, arith.RemUIOp(round_, ht.index(2)).result, ht.index(0)).result
    return arith.XOrIOp(odd, arith.ConstantOp(ir.IntegerType.get_signless(1), 1).result).result if flip else odd


def linear_wgmma(args: Sequence[ir.Value], symbols: dict[str, ir.Value], request: Request) -> ht.Launch:
    x, w = args[0], args[1]
    tf32 = request.dtype == "float32"  # (w comes K-major: [N, K])
    m, k_extent, n = extent(x, 0, request), extent(x, 1, request), extent(w, 0 if tf32 else 1, request)
    element = ir.MemRefType(x.type).element_type
    tile = wgmma_tile(m, n, tf32)
    tile_m, tile_n, step = tile
    half, size = tile_m // 2, ir.FloatType(element).width // 8
    stage_bytes = (tile_m + tile_n) * step * size   # x's two boxes (a consumer's each), w's one (TF32) or two
    w_box = (tile_n, step) if tf32 else (step, 64)
    # the tensor maps: extra pointer parameters after the sizes, described for the runtime
    entry = ir.BlockArgument(x).owner
    maps = [entry.add_argument(ir.Type.parse("!llvm.ptr"), ir.Location.unknown()) for _ in range(2)]
    entry.owner.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get([a.type for a in entry.arguments],
                                                                                  []))
    ht.set_tensor_maps(entry.owner, [(0, (step, half)), (1, w_box[::-1])])
    tiles_n, tiles_m = exprs.ceildiv(n, tile_n), exprs.ceildiv(m, tile_m)
    tiles = exprs.mul(tiles_m, tiles_n)
    blocks = exprs._make("min", tiles, WG_BLOCKS)
    ht.set_variant("wgmma_tf32" if tf32 else "wgmma")
    shape = _Shape(tile, -(-k_extent // step), stage_bytes, element, ht.size_value(tiles_m, symbols), tiles_n,
                   ht.size_value(tiles, symbols), ht.size_value(blocks, symbols))
    with ht.loop(0, shape.blocks, "parallel", "blockIdx.x") as block:
        shared = ht.alloc_local([WG_STAGES * stage_bytes], ir.IntegerType.get_signless(8), "shared")
        with ht.loop(0, 384, "parallel", "threadIdx.x") as thread:
            group = ir.Type.parse(f"!nvgpu.mbarrier.group<memorySpace = {_WORKGROUP}, num_barriers = {WG_STAGES}>")
            full, empty = nvgpu.MBarrierCreateOp(group).result, nvgpu.MBarrierCreateOp(group).result
            first = arith.CmpIOp(arith.CmpIPredicate.eq, thread, ht.index(0)).result
            for s in range(WG_STAGES):
                nvgpu.MBarrierInitOp(full, ht.index(1), ht.index(s), predicate=first)
                nvgpu.MBarrierInitOp(empty, ht.index(8), ht.index(s), predicate=first)  # a consumer warp's lane 0 each
            ht.barrier()
            tm_x, tm_w = _tensor_map(maps[0], (half, step), element), _tensor_map(maps[1], w_box, element)
            warpgroup = arith.DivUIOp(thread, ht.index(128)).result

            def producer() -> None:  # the producer warpgroup gives registers up to the consumers (setmaxnreg)
                nvvm.SetMaxRegisterOp(WG_REGISTERS[0], nvvm.SetMaxRegisterAction.decrease)
                with ht.when(arith.CmpIOp(arith.CmpIPredicate.eq, thread, ht.index(256)).result):
                    nvgpu.TmaPrefetchOp(tm_x)
                    nvgpu.TmaPrefetchOp(tm_w)
                    with _tiles(block, shape) as (origin, done):
                        _produce(tm_x, tm_w, full, empty, shared, origin, done, shape)

            def consumers() -> None:
                nvvm.SetMaxRegisterOp(WG_REGISTERS[1], nvvm.SetMaxRegisterAction.increase)
                with _tiles(block, shape) as (origin, done):
                    sums = (_consume_tf32 if tf32 else _consume)(tm_x, tm_w, full, empty, shared, warpgroup,
                                                                 thread, done, shape)
                    _epilogue(sums, origin, warpgroup, thread, args, symbols, request, tile)
            ht.choose(arith.CmpIOp(arith.CmpIPredicate.eq, warpgroup, ht.index(2)).result, producer, consumers)
    return ht.Launch((blocks, 1, 1), (384, 1, 1))


def wgmma_tile(m: exprs.Expr, n: int, tf32: bool = False) -> tuple[int, int, int]:
    """WG_TILE, or WG_SMALL_TILE for a static product of at most WG_BLOCKS WG_TILE tiles; TF32's k
    slice is half as deep (128 bytes a row, as 128-byte swizzling wants)."""
    big = -(-m // WG_TILE[0]) * -(-n // WG_TILE[1]) if isinstance(m, int) else WG_BLOCKS + 1
    tile = WG_SMALL_TILE if big <= WG_BLOCKS else WG_TILE
    return (*tile[:2], tile[2] // 2) if tf32 else tile


class _Shape:
    """What the roles share: the tile, k slices per tile, a stage's bytes, the element type, tile
    rows (a value), tile columns (an int), tiles and blocks (values)."""

    def __init__(self, tile, slices, stage_bytes, element, tiles_m, tiles_n, tiles, blocks) -> None:
        self.tile, self.slices, self.stage_bytes, self.element = tile, slices, stage_bytes, element
        self.tiles_m, self.tiles_n, self.tiles, self.blocks = tiles_m, tiles_n, tiles, blocks


@contextlib.contextmanager
def _tiles(block: ir.Value, shape: _Shape):
    """The block's tiles (block, block + blocks, ...): yields the tile's (row0, column0) and how
    many k slices the block walked before it (its stages and phases go on from there)."""
    tile_m, tile_n, _ = shape.tile
    mine = arith.CeilDivUIOp(arith.SubIOp(shape.tiles, block).result, shape.blocks).result
    with ht.loop(0, mine, "serial") as t:
        tile = cuda._plus(block, arith.MulIOp(t, shape.blocks).result)
        tile_row, tile_column = _raster(tile, shape.tiles_m, shape.tiles_n)
        yield (cuda._times(tile_row, tile_m), cuda._times(tile_column, tile_n)), cuda._times(t, shape.slices)


def _raster(tile: ir.Value, tiles_m: ir.Value, tiles_n: int) -> tuple[ir.Value, ir.Value]:
    """Tile t's place: groups of GROUP_M tile rows, each walked column by column."""
    per_group = GROUP_M * tiles_n
    first = cuda._times(arith.DivUIOp(tile, ht.index(per_group)).result, GROUP_M)
    size = arith.MinUIOp(arith.SubIOp(tiles_m, first).result, ht.index(GROUP_M)).result
    within = arith.RemUIOp(tile, ht.index(per_group)).result
    return cuda._plus(first, arith.RemUIOp(within, size).result), arith.DivUIOp(within, size).result


def _stage(count: ir.Value) -> tuple[ir.Value, ir.Value]:
    return arith.RemUIOp(count, ht.index(WG_STAGES)).result, arith.DivUIOp(count, ht.index(WG_STAGES)).result


def _produce(tm_x, tm_w, full, empty, shared, origin, done: ir.Value, shape: _Shape) -> None:
    """Thread 256, one tile: for each k slice, wait until its stage is free, then copy x's two
    boxes and w's two into it."""
    tile_m, tile_n, step = shape.tile
    half, size = tile_m // 2, ir.FloatType(shape.element).width // 8
    row0, column0 = origin
    with ht.loop(0, shape.slices, "serial") as i:
        stage, round_ = _stage(cuda._plus(done, i))
        nvgpu.MBarrierTryWaitParityOp(empty, _parity(round_, True), ht.index(10_000_000), mbarId=stage)
        nvgpu.MBarrierArriveExpectTxOp(full, ht.index(shape.stage_bytes), stage)
        base = cuda._times(stage, shape.stage_bytes)
        k0 = cuda._times(i, step)
        for h in range(2):  # coordinates innermost first: (k, row) in x, (column, k) in w, (k, column) in w^T
            nvgpu.TmaAsyncLoadOp(_view(shared, cuda._plus(base, ht.index(h * half * step * size)), [half, step],
                                       shape.element), full, tm_x, [k0, cuda._plus(row0, ht.index(h * half))], stage)
            w_at = cuda._plus(base, ht.index(tile_m * step * size + h * step * 64 * size))
            if size == 4 and h == 0:
                nvgpu.TmaAsyncLoadOp(_view(shared, w_at, [tile_n, step], shape.element), full, tm_w, [k0, column0],
                                     stage)
            elif size == 2:
                nvgpu.TmaAsyncLoadOp(_view(shared, w_at, [step, 64], shape.element), full, tm_w,
                                     [cuda._plus(column0, ht.index(64 * h)), k0], stage)


def _consume(tm_x, tm_w, full, empty, shared, warpgroup, thread, done: ir.Value, shape: _Shape) -> list[ir.Value]:
    """Warpgroups 0 and 1, one tile: 128 rows each, the sums in registers across the k slices
    (nvgpu's wgmma: m64n128k16, w [K, N] read transposed)."""
    tile_m, tile_n, step = shape.tile
    half, element = tile_m // 2, shape.element
    accumulator = ir.Type.parse(f"!nvgpu.warpgroup.accumulator<fragmented = vector<{half}x{tile_n}xf32>>")
    a_type = ir.Type.parse(f"!nvgpu.warpgroup.descriptor<tensor = memref<{half}x{step}x{element}, {_WORKGROUP}>>")
    b_type = ir.Type.parse(f"!nvgpu.warpgroup.descriptor<tensor = memref<{step}x{tile_n}x{element}, {_WORKGROUP}>>")

    def slice_(base: ir.Value, sums: list[ir.Value]) -> list[ir.Value]:
        a = _view(shared, cuda._plus(base, cuda._times(warpgroup, half * step * 2)), [half, step], element)
        b = _view(shared, cuda._plus(base, ht.index(2 * half * step * 2)), [step, tile_n], element)
        return [nvgpu.WarpgroupMmaOp(accumulator, nvgpu.WarpgroupGenerateDescriptorOp(a_type, a, tm_x).result,
                                     nvgpu.WarpgroupGenerateDescriptorOp(b_type, b, tm_w).result, sums[0],
                                     transposeB=True).result]
    sums = _k_loop(full, empty, thread, done, shape, [nvgpu.WarpgroupMmaInitAccumulatorOp(accumulator).result], slice_)
    pieces = tile_m // 128  # (the accumulator as registers: a struct of m64 pieces of tile_n / 2 values each)
    values = ir.Type.parse("!llvm.struct<(" + ", ".join(["f32"] * (tile_n // 2)) + ")>")
    whole = ir.Type.parse(f"!llvm.struct<({', '.join([str(values)] * pieces)})>")
    fragments = builtin.UnrealizedConversionCastOp([whole], sums).result
    return [llvm.ExtractValueOp(values, fragments, [h]).result for h in range(pieces)]


def _consume_tf32(tm_x, tm_w, full, empty, shared, warpgroup, thread, done: ir.Value, shape: _Shape) -> list[ir.Value]:
    """As `_consume`, in TF32: wgmma m64n128k8 from x's and w^T's K-major slices (TF32 has no
    transposed operand), its descriptors made here; x's slice rounded to TF32 in place first
    (cvt.rna, as cuBLAS rounds: the tensor cores would truncate; w^T comes rounded) when TF32_ROUND."""
    tile_m, tile_n, step = shape.tile
    half = tile_m // 2
    f32 = ir.F32Type.get()
    values = ir.Type.parse("!llvm.struct<(" + ", ".join(["f32"] * (tile_n // 2)) + ")>")
    zero = llvm.ZeroOp(values).result
    start = arith.IndexCastOp(ir.IntegerType.get_signless(64),
                              memref.ExtractAlignedPointerAsIndexOp(shared).result).result
    kinds = [ir.Attribute.parse(f"#nvvm.{text}") for text in (
        "shape<m = 64, n = 128, k = 8>", "wgmma_type<tf32>", "wgmma_type<tf32>", "wgmma_type<f32>",
        "wgmma_scale_out<one>", "wgmma_scale_in<one>", "wgmma_scale_in<one>", "mma_layout<row>", "mma_layout<col>")]

    def slice_(base: ir.Value, sums: list[ir.Value]) -> list[ir.Value]:
        a = cuda._plus(base, cuda._times(warpgroup, half * step * 4))
        if TF32_ROUND:
            _round_tf32(_view(shared, a, [half * step], f32), arith.RemUIOp(thread, ht.index(128)).result, warpgroup)
        nvvm.WgmmaFenceAlignedOp()
        out = list(sums)
        for k in range(step // 8):
            for p in range(len(out)):  # m64 pieces: 64 rows of 128 bytes = 8 KiB apart
                out[p] = nvvm.wgmma_mma_async(
                    values, out[p], _descriptor(start, cuda._plus(a, ht.index(p * 64 * step * 4 + 32 * k))),
                    _descriptor(start, cuda._plus(base, ht.index(tile_m * step * 4 + 32 * k))), *kinds)
        nvvm.WgmmaGroupSyncAlignedOp()
        nvvm.WgmmaWaitGroupSyncOp(1)
        return out
    return _k_loop(full, empty, thread, done, shape, [zero] * (half // 64), slice_)


def _descriptor(start: ir.Value, offset: ir.Value) -> ir.Value:
    """The wgmma descriptor of a K-major, 128-byte swizzled operand at shared byte `offset`: its
    address / 16, 8-row groups 1024 bytes apart, the swizzle mode (the leading offset unused)."""
    i64 = ir.IntegerType.get_signless(64)
    address = arith.AddIOp(start, arith.IndexCastOp(i64, offset).result).result
    field = arith.ShRUIOp(arith.AndIOp(address, arith.ConstantOp(i64, 0x3FFFF).result).result,
                          arith.ConstantOp(i64, 4).result).result
    return arith.OrIOp(field, arith.ConstantOp(i64, (1 << 62) | (64 << 32) | (1 << 16)).result).result


def _round_tf32(slab: ir.Value, lane: ir.Value, warpgroup: ir.Value) -> None:
    """Round a consumer's rows of x in a stage to TF32 in place (its 128 threads, 4 values each
    at a time), make the stores visible to wgmma (the async proxy), wait for the warpgroup."""
    f32 = ir.F32Type.get()
    for j in range(ir.MemRefType(slab.type).shape[0] // 512):
        at = [cuda._plus(cuda._times(lane, 4), ht.index(512 * j))]
        four = vector.LoadOp(ir.VectorType.get([4], f32), slab, at).result
        rounded = [arith.BitcastOp(f32, _to_tf32(vector.ExtractOp(four, [], [e]).result)).result for e in range(4)]
        vector.StoreOp(vector.FromElementsOp(ir.VectorType.get([4], f32), rounded).result, slab, at)
    number = arith.IndexCastOp(ir.IntegerType.get_signless(32), cuda._plus(warpgroup, ht.index(1))).result
    llvm.InlineAsmOp(None, [number], "fence.proxy.async.shared::cta;\nbar.sync $0, 128;", "r", has_side_effects=True)


def _k_loop(full, empty, thread, done: ir.Value, shape: _Shape, zero: list[ir.Value], slice_) -> list[ir.Value]:
    """The consumers' walk over a tile's k slices: wait for each stage, `slice_(its byte offset,
    sums)` -> sums, and release the stage once its wgmma are done."""
    lane0 = arith.CmpIOp(arith.CmpIPredicate.eq, arith.RemUIOp(thread, ht.index(32)).result, ht.index(0)).result

    def release(count: ir.Value) -> None:
        with ht.when(lane0):
            nvgpu.MBarrierArriveOp(empty, _stage(count)[0])

    def step(i: ir.Value, sums: list[ir.Value]) -> list[ir.Value]:
        stage, round_ = _stage(cuda._plus(done, i))
        nvgpu.MBarrierTryWaitParityOp(full, _parity(round_, False), ht.index(10_000_000), mbarId=stage)
        sums = slice_(cuda._times(stage, shape.stage_bytes), sums)
        # this slice's wgmma are in flight, the one before is done (wait_group 1): free its stage
        with ht.when(arith.CmpIOp(arith.CmpIPredicate.ugt, i, ht.index(0)).result):
            release(arith.SubIOp(cuda._plus(done, i), ht.index(1)).result)
        return sums
    sums = ht.fold(ht.index(0), ht.index(shape.slices), ht.index(1), zero, step)
    nvvm.WgmmaWaitGroupSyncOp(0)
    release(cuda._plus(done, ht.index(shape.slices - 1)))
    return sums


def _epilogue(pieces: list[ir.Value], origin, warpgroup, thread, args, symbols, request: Request, tile) -> None:
    """The sums from the accumulator's registers: value v of half h of a warpgroup's is row
    64 h + 16 (warp) + g + 8 ((v mod 4) / 2), column 8 (v / 4) + 2 t + v mod 2 (g, t: the lane / 4,
    mod 4), so a thread's pairs of columns are stored as one 4-byte store each."""
    tile_m, tile_n, _ = tile
    half, out = tile_m // 2, args[-1]
    m, n = extent(args[0], 0, request), ir.MemRefType(out.type).shape[-1]
    f32 = ir.F32Type.get()
    lane = arith.RemUIOp(thread, ht.index(32)).result
    group, in_group = cuda._split(lane, 4)
    warp = arith.RemUIOp(arith.DivUIOp(thread, ht.index(32)).result, ht.index(4)).result
    row0 = cuda._plus(origin[0], cuda._plus(cuda._times(warpgroup, half), cuda._plus(cuda._times(warp, 16), group)))
    column0 = cuda._plus(origin[1], cuda._times(in_group, 2))
    bounds = ht.size_value(m, symbols), ht.index(n)
    for h, part in enumerate(pieces):
        for v in range(0, tile_n // 2, 2):
            at = (cuda._plus(row0, ht.index(64 * h + 8 * (v % 4 // 2))), cuda._plus(column0, ht.index(8 * (v // 4))))
            pair = [llvm.ExtractValueOp(f32, part, [v + e]).result for e in range(2)]
            store_pair(pair, out, at, bounds, args[2] if request.bias else None, request)
