"""cuda linear on Hopper's warpgroup tensor cores (`wgmma`, sm_90a only): bfloat16 / float16 in,
float32 sums, warp-specialized.

A block of three warpgroups computes a 256x128 tile of out: warpgroups 0 and 1 (the consumers)
128 rows each, as wgmma m64n128k16 from shared memory into 128 f32 sums a thread; warpgroup 2's
first thread (the producer) loads the k slices (64 deep) with TMA (the tensor copy engine: x's
[128 rows x 64 k] boxes and w's [64 k x 64 columns], 128-byte swizzled, what lies outside the
tensors filled with zeros) into WG_STAGES shared stages. Each stage has two mbarriers: `full`
(the producer's copies landed: a transaction count) and `empty` (each consumer warp is done
with it). The tensor maps TMA reads come from the runtime (`hextir.tensor_maps`: one per x and
w, encoded per call for the buffers' addresses and extents), as extra pointer parameters after
the kernel's sizes. The sums go through shared memory (rows padded) to the epilogue, where all
384 threads add the bias, apply the fused ops in f32 and store the output's type, guarded.
Blocks walk the tiles in groups of GROUP_M tile rows (each group's x rows and w columns stay in
L2 while its blocks run).

    for b in [0, tiles) bind blockIdx.x                      stages[S] of x[256][64], w[64][128]
      for t in [0, 384) bind threadIdx.x                     full[S], empty[S] mbarriers
        producer (t == 256): for each k slice i: wait empty[i % S]; expect bytes; 4 TMA loads -> full
        consumers (t < 256): for each i: wait full[i % S]; 8 wgmma (async); slice i - 1 done -> empty
        sums -> shared; barrier; out[r, c] = to_16bit(epilogue(sums + bias)) where r < M, c < N
"""

from __future__ import annotations

from collections.abc import Sequence

from hexir_runtime.format import exprs
from mlir import ir
from mlir.dialects import arith, builtin, llvm, memref, nvgpu, nvvm, scf

from hexir.dialects import hextir as ht
from hexir.schedules import Request, cuda, extent
from hexir.schedules.cuda_mma import store_f32
from hexir.target import arch_number

#: Tile rows (two consumer warpgroups of 128), columns, k slice; shared stages in flight.
WG_TILE, WG_STAGES = (256, 128, 64), 4
#: Tile rows walked together (GROUP_M x all tile columns) before the next group.
GROUP_M = 8
#: f32 padding of the staged sums' rows: a warp's 8-byte stores (8 rows x 4 pairs) on 32 banks.
SUMS_PAD = 4
_WORKGROUP = "#gpu.address_space<workgroup>"


def uses_wgmma(request: Request, k: int, n: int) -> bool:
    """16-bit inputs on sm_90a alone, rows of x and w a multiple of 16 bytes (TMA's pitch)."""
    archs = request.target.cuda_archs
    return request.dtype in ("bfloat16", "float16") and all(a.endswith("a") and arch_number(a) == 90
                                                            for a in archs) and k % 8 == 0 and n % 8 == 0


def _c(value: int) -> ir.Value:
    return ht.index(value)


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
    odd = arith.CmpIOp(arith.CmpIPredicate.ne, arith.RemUIOp(round_, _c(2)).result, _c(0)).result
    return arith.XOrIOp(odd, arith.ConstantOp(ir.IntegerType.get_signless(1), 1).result).result if flip else odd


def linear_wgmma(args: Sequence[ir.Value], symbols: dict[str, ir.Value], request: Request) -> ht.Launch:
    x, w, out = args[0], args[1], args[-1]
    bias = args[2] if request.bias else None
    m, k_extent, n = extent(x, 0, request), extent(x, 1, request), extent(w, 1, request)
    element = ir.MemRefType(x.type).element_type
    tile_m, tile_n, step = WG_TILE
    half = tile_m // 2
    a_bytes, b_box = half * step * 2, step * 64 * 2          # one x box (per consumer), one w box
    stage_bytes = 2 * a_bytes + 2 * b_box
    slices = -(-k_extent // step)
    # the tensor maps: extra pointer parameters after the sizes, described for the runtime
    entry = ir.BlockArgument(x).owner
    pointer = ir.Type.parse("!llvm.ptr")
    maps = [entry.add_argument(pointer, ir.Location.unknown()) for _ in range(2)]
    ht.set_tensor_maps(entry.owner, [(0, (step, half)), (1, (64, step))])
    tiles_n, tiles_m = exprs.ceildiv(n, tile_n), exprs.ceildiv(m, tile_m)
    ht.set_variant("wgmma")
    rows, columns = ht.size_value(m, symbols), ht.index(n)
    with ht.loop(0, ht.size_value(exprs.mul(tiles_m, tiles_n), symbols), "parallel", "blockIdx.x") as block:
        shared = ht.alloc_local([WG_STAGES * stage_bytes], ir.IntegerType.get_signless(8), "shared")
        with ht.loop(0, 384, "parallel", "threadIdx.x") as thread:
            tile_row, tile_column = _raster(block, ht.size_value(tiles_m, symbols), tiles_n)
            row0, column0 = cuda._times(tile_row, tile_m), cuda._times(tile_column, tile_n)
            group = ir.Type.parse(f"!nvgpu.mbarrier.group<memorySpace = {_WORKGROUP}, num_barriers = {WG_STAGES}>")
            full, empty = nvgpu.MBarrierCreateOp(group).result, nvgpu.MBarrierCreateOp(group).result
            first = arith.CmpIOp(arith.CmpIPredicate.eq, thread, _c(0)).result
            for s in range(WG_STAGES):
                nvgpu.MBarrierInitOp(full, _c(1), _c(s), predicate=first)
                nvgpu.MBarrierInitOp(empty, _c(8), _c(s), predicate=first)  # a consumer warp's lane 0 each
            ht.barrier()
            tm_x, tm_w = _tensor_map(maps[0], (half, step), element), _tensor_map(maps[1], (step, 64), element)
            warpgroup = arith.DivUIOp(thread, _c(128)).result
            roles = scf.IfOp(arith.CmpIOp(arith.CmpIPredicate.eq, warpgroup, _c(2)).result, has_else=True)
            with ir.InsertionPoint(roles.then_block):
                producer = scf.IfOp(arith.CmpIOp(arith.CmpIPredicate.eq, thread, _c(256)).result)
                with ir.InsertionPoint(producer.then_block):
                    _produce(tm_x, tm_w, full, empty, shared, (row0, column0), slices, stage_bytes, element)
                    scf.YieldOp([])
                scf.YieldOp([])
            with ir.InsertionPoint(roles.else_block):
                _consume(tm_x, tm_w, full, empty, shared, warpgroup, thread, slices, stage_bytes, element)
                scf.YieldOp([])
            ht.barrier()
            sums = _view(shared, 0, [tile_m, tile_n + SUMS_PAD], ir.F32Type.get())
            epilogue = scf.ForOp(thread, _c(tile_m * tile_n), _c(384))
            with ir.InsertionPoint(epilogue.body):
                r, c = cuda._split(epilogue.induction_variable, tile_n)
                store_f32(lambda r=r, c=c: memref.LoadOp(sums, [r, c]).result, out,
                          (cuda._plus(row0, r), cuda._plus(column0, c)), (rows, columns), bias, request)
                scf.YieldOp([])
    return ht.Launch((exprs.mul(tiles_m, tiles_n), 1, 1), (384, 1, 1))


def _raster(block: ir.Value, tiles_m: ir.Value, tiles_n: int) -> tuple[ir.Value, ir.Value]:
    """Block b's tile: groups of GROUP_M tile rows, each walked column by column."""
    per_group = GROUP_M * tiles_n
    first = cuda._times(arith.DivUIOp(block, _c(per_group)).result, GROUP_M)
    size = arith.MinUIOp(arith.SubIOp(tiles_m, first).result, _c(GROUP_M)).result
    within = arith.RemUIOp(block, _c(per_group)).result
    return cuda._plus(first, arith.RemUIOp(within, size).result), arith.DivUIOp(within, size).result


def _produce(tm_x, tm_w, full, empty, shared, origin, slices: int, stage_bytes: int, element: ir.Type) -> None:
    """Thread 256: for each k slice, wait until its stage is free, then copy x's two boxes and w's two."""
    tile_m, tile_n, step = WG_TILE
    half = tile_m // 2
    row0, column0 = origin
    nvgpu.TmaPrefetchOp(tm_x)
    nvgpu.TmaPrefetchOp(tm_w)
    loop = scf.ForOp(_c(0), _c(slices), _c(1))
    with ir.InsertionPoint(loop.body):
        i = loop.induction_variable
        stage, round_ = arith.RemUIOp(i, _c(WG_STAGES)).result, arith.DivUIOp(i, _c(WG_STAGES)).result
        nvgpu.MBarrierTryWaitParityOp(empty, _parity(round_, True), _c(10_000_000), mbarId=stage)
        nvgpu.MBarrierArriveExpectTxOp(full, _c(stage_bytes), stage)
        base = cuda._times(stage, stage_bytes)
        k0 = cuda._times(i, step)
        for h in range(2):  # coordinates innermost first: (k, row) in x, (column, k) in w
            nvgpu.TmaAsyncLoadOp(_view(shared, cuda._plus(base, _c(h * half * step * 2)), [half, step], element),
                                 full, tm_x, [k0, cuda._plus(row0, _c(h * half))], stage)
            nvgpu.TmaAsyncLoadOp(_view(shared, cuda._plus(base, _c(2 * half * step * 2 + h * step * 64 * 2)),
                                       [step, 64], element), full, tm_w, [cuda._plus(column0, _c(64 * h)), k0], stage)
        scf.YieldOp([])


def _consume(tm_x, tm_w, full, empty, shared, warpgroup, thread, slices: int, stage_bytes: int,
             element: ir.Type) -> None:
    """Warpgroups 0 and 1: 128 rows each, the sums in registers across the k slices; then staged."""
    tile_m, tile_n, step = WG_TILE
    half = tile_m // 2
    accumulator = ir.Type.parse(f"!nvgpu.warpgroup.accumulator<fragmented = vector<{half}x{tile_n}xf32>>")
    a_type = ir.Type.parse(f"!nvgpu.warpgroup.descriptor<tensor = memref<{half}x{step}x{element}, {_WORKGROUP}>>")
    b_type = ir.Type.parse(f"!nvgpu.warpgroup.descriptor<tensor = memref<{step}x{tile_n}x{element}, {_WORKGROUP}>>")
    zero = nvgpu.WarpgroupMmaInitAccumulatorOp(accumulator).result
    lane0 = arith.CmpIOp(arith.CmpIPredicate.eq, arith.RemUIOp(thread, _c(32)).result, _c(0)).result
    loop = scf.ForOp(_c(0), _c(slices), _c(1), [zero])
    with ir.InsertionPoint(loop.body):
        i = loop.induction_variable
        stage, round_ = arith.RemUIOp(i, _c(WG_STAGES)).result, arith.DivUIOp(i, _c(WG_STAGES)).result
        nvgpu.MBarrierTryWaitParityOp(full, _parity(round_, False), _c(10_000_000), mbarId=stage)
        base = cuda._times(stage, stage_bytes)
        a = _view(shared, cuda._plus(base, cuda._times(warpgroup, half * step * 2)), [half, step], element)
        b = _view(shared, cuda._plus(base, _c(2 * half * step * 2)), [step, tile_n], element)
        sums = nvgpu.WarpgroupMmaOp(accumulator, nvgpu.WarpgroupGenerateDescriptorOp(a_type, a, tm_x).result,
                                    nvgpu.WarpgroupGenerateDescriptorOp(b_type, b, tm_w).result,
                                    loop.inner_iter_args[0], transposeB=True).result
        # this slice's wgmma are in flight, the one before is done (wait_group 1): free its stage
        done = arith.AndIOp(lane0, arith.CmpIOp(arith.CmpIPredicate.ugt, i, _c(0)).result).result
        release = scf.IfOp(done)
        with ir.InsertionPoint(release.then_block):
            previous = arith.RemUIOp(arith.AddIOp(i, _c(WG_STAGES - 1)).result, _c(WG_STAGES)).result
            nvgpu.MBarrierArriveOp(empty, previous)
            scf.YieldOp([])
        scf.YieldOp([sums])
    nvvm.WgmmaWaitGroupSyncOp(0)
    # both consumers done with every stage before their sums overwrite them
    llvm.InlineAsmOp(None, [], "bar.sync 1, 256;", "~{memory}", has_side_effects=True)
    staged = _view(shared, 0, [tile_m, tile_n + SUMS_PAD], ir.F32Type.get())
    strided = ir.MemRefType.get([half, tile_n], ir.F32Type.get(), ir.Attribute.parse(
        f"strided<[{tile_n + SUMS_PAD}, 1], offset: ?>"), ir.Attribute.parse(_WORKGROUP))
    mine = memref.SubViewOp(strided, staged, [cuda._times(warpgroup, half)], [], [],
                            [ir.ShapedType.get_dynamic_stride_or_offset(), 0], [half, tile_n], [1, 1]).result
    nvgpu.WarpgroupMmaStoreOp(loop.results[0], mine)
