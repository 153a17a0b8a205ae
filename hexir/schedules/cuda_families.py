"""cuda kernels of the pointwise and reduce families (the same shape as `cpu_families.py`).

pointwise: one flat axis over the output, blocks of POINTWISE_BLOCK threads, a thread per
element; an input of the output's shape is read at the flat position, a broadcast one at the
index the position's coordinates give it (numpy's rules).

reduce: a block of up to REDUCE_BLOCK threads per row. For each reduction of the program the
threads walk the row in strides (thread t: elements t, t + T, ...), then combine their partial
results: in each warp by shuffles, the warps' results through shared memory (one barrier), then
again by shuffles (argmax keeps the first index of the largest, as numpy); the output is written
by thread 0 (per row) or by all of them in strides (per element). A static row along the last
axis of at most REGISTER_ROW elements is read once into registers instead; one over 64 KiB is
split over a thread-block cluster (`_row_cluster`), whose blocks meet in each other's shared memory.
"""

from __future__ import annotations

from collections.abc import Sequence

from hexir_runtime.format import exprs, scalars
from mlir import ir
from mlir.dialects import arith, gpu, llvm, memref, nvvm, vector

from hexir.dialects import hextir as ht
from hexir.schedules import Request, broadcast_indices, extent
from hexir.schedules.cpu_attention import batch_coordinates
from hexir.schedules.cpu_families import _initial, accumulate, accumulator, combine, result
from hexir.schedules.emit import compute_type, convert, emit
from hexir.target import arch_number

POINTWISE_BLOCK = 256
REDUCE_BLOCK = 256
REGISTER_THREADS = 256   # the most threads of a block holding a row in registers
REGISTER_ROW = 16384     # the longest row (elements) held in registers: 16 f32 (8 f64 pairs) a thread
REGISTER_VECTORS = 4     # the 16-byte vectors a thread of such a block aims to hold (fewer threads, fewer barriers)
REGISTER_MOST = 8        # and the most it holds (128 bytes): past that, more threads, up to 1024 (round 8)
REGISTER_CLUSTER = 512   # the most threads of such a block: a longer row is split over a cluster of blocks (round 9)
REGISTER_PART = 256      # and the most of a cluster's block (4 of 256 for f64 16384: 0.84 of copy, 2 of 512: 0.80)
REGISTER_CAP = 64        # the registers a thread of a cluster's block is held to (launch bounds: blocks an SM)


def _flat(buffer: ir.Value, total: exprs.Expr) -> ir.Value:
    shaped = ir.MemRefType(buffer.type)
    if shaped.rank == 1:
        return buffer
    flat_type = ir.MemRefType.get([ir.ShapedType.get_dynamic_size() if not isinstance(total, int) else total],
                                  shaped.element_type)
    reassociation = ir.ArrayAttr.get([ir.ArrayAttr.get(
        [ir.IntegerAttr.get(ir.IntegerType.get_signless(64), d) for d in range(shaped.rank)])])
    return memref.CollapseShapeOp(flat_type, buffer, reassociation).result


def _lanes(buffer: ir.Value) -> int:
    """Elements in 16 bytes (a 128-bit load) of `buffer`'s type."""
    element = ir.MemRefType(buffer.type).element_type
    width = ir.IntegerType(element).width if isinstance(element, ir.IntegerType) else ir.FloatType(element).width
    return 128 // width


def _vector_reads(inputs: Sequence[ir.Value], last: exprs.Expr, lanes: int) -> bool:
    """Whether each input's elements along the last axis are 16-byte vectors where the output's
    are: rows a multiple of `lanes` long (so each row starts 16-byte aligned), each input's
    last axis that long or 1 (broadcast)."""
    return isinstance(last, int) and last > 0 and last % lanes == 0 and all(
        ir.MemRefType(x.type).shape[-1] in (last, 1) and _lanes(x) == lanes for x in inputs)


def _read(x: ir.Value, indices: list[ir.Value], lanes: int) -> list[ir.Value]:
    """`lanes` elements of `x` from `indices` along its last axis (one 16-byte load), or its one
    element there repeated (a last axis of 1)."""
    if ir.MemRefType(x.type).shape[-1] == 1:
        return [ht.load(x, indices)] * lanes
    vector_type = ir.VectorType.get([lanes], ir.MemRefType(x.type).element_type)
    loaded = vector.LoadOp(vector_type, x, indices, alignment=16).result
    return [vector.ExtractOp(loaded, [], [i]).result for i in range(lanes)]


def _write(values: list[ir.Value], buffer: ir.Value, indices: list[ir.Value]) -> None:
    element = ir.MemRefType(buffer.type).element_type
    values = [convert(v, element) for v in values]
    vector_type = ir.VectorType.get([len(values)], element)
    vector.StoreOp(vector.FromElementsOp(vector_type, values).result, buffer, indices, alignment=16)


def pointwise(args: Sequence[ir.Value], symbols: dict[str, ir.Value], request: Request) -> ht.Launch:
    *inputs, out = args
    rank, kind = ir.MemRefType(out.type).rank, compute_type(*(a.type for a in args))
    extents = [extent(out, axis, request) for axis in range(rank)]
    total = exprs.product(extents)
    lanes = _lanes(out) if _vector_reads(inputs, extents[-1], _lanes(out)) else 1
    items = exprs.ceildiv(total, lanes)  # exact: rows are a multiple of lanes long
    blocks = exprs.ceildiv(items, POINTWISE_BLOCK)
    count = ht.size_value(items, symbols)
    flat_out = _flat(out, total)
    same = [ir.MemRefType(x.type).shape == ir.MemRefType(out.type).shape for x in inputs]
    flat_inputs = [_flat(x, total) if s else None for x, s in zip(inputs, same, strict=True)]
    with ht.loop(0, ht.size_value(blocks, symbols), "parallel", "blockIdx.x") as block, \
            ht.loop(0, POINTWISE_BLOCK, "parallel", "threadIdx.x") as thread:
        item = arith.AddIOp(arith.MulIOp(block, ht.index(POINTWISE_BLOCK)).result, thread).result
        with ht.when(arith.CmpIOp(arith.CmpIPredicate.ult, item, count).result):
            position = arith.MulIOp(item, ht.index(lanes)).result if lanes > 1 else item
            coordinates = None if all(same) else batch_coordinates(position,
                                                                   [ht.size_value(e, symbols) for e in extents])
            if lanes == 1:
                values = [ht.load(flat, [position]) if flat is not None else
                          ht.load(x, broadcast_indices(x, coordinates)) for x, flat in zip(inputs, flat_inputs,
                                                                                          strict=True)]
                ht.store(convert(emit(request.expr, values, type_=kind), ir.MemRefType(out.type).element_type),
                         flat_out, [position])
            else:  # 16-byte loads and stores, the tree per element
                columns = [_read(flat, [position], lanes) if flat is not None else
                           _read(x, broadcast_indices(x, coordinates), lanes)
                           for x, flat in zip(inputs, flat_inputs, strict=True)]
                _write([emit(request.expr, [c[i] for c in columns], type_=kind) for i in range(lanes)], flat_out,
                       [position])
    return ht.Launch((blocks, 1, 1), (POINTWISE_BLOCK, 1, 1))


def _threads(length: exprs.Expr) -> int:
    threads = 32
    while threads < REDUCE_BLOCK and (not isinstance(length, int) or threads < length):
        threads *= 2
    return threads


def _combine_partials(kind: str, mine: list[ir.Value], other: list[ir.Value]) -> list[ir.Value]:
    """Two threads' partial results: a later thread's argmax may hold an earlier index."""
    if kind != "argmax":
        return combine(kind, mine, other[0], None) if kind == "max" else [arith.AddFOp(mine[0], other[0]).result]
    (v1, i1), (v2, i2) = mine, other
    nan1 = arith.CmpFOp(arith.CmpFPredicate.UNO, v1, v1).result
    nan2 = arith.CmpFOp(arith.CmpFPredicate.UNO, v2, v2).result
    tie = arith.OrIOp(arith.CmpFOp(arith.CmpFPredicate.OEQ, v1, v2).result, arith.AndIOp(nan1, nan2).result).result
    better = arith.OrIOp(
        arith.OrIOp(arith.CmpFOp(arith.CmpFPredicate.OGT, v2, v1).result,
                    arith.AndIOp(nan2, arith.XOrIOp(nan1, arith.ConstantOp(nan1.type, 1).result).result).result).result,
        arith.AndIOp(tie, arith.CmpIOp(arith.CmpIPredicate.slt, i2, i1).result).result).result
    return [arith.SelectOp(better, v2, v1).result, arith.SelectOp(better, i2, i1).result]


def _shuffled(kind: str, values: list[ir.Value], lanes: int) -> list[ir.Value]:
    """`values` combined across the first `lanes` lanes of each warp (a butterfly of shuffles:
    every lane ends with the result)."""
    width = arith.ConstantOp(ir.IntegerType.get_signless(32), 32).result
    offset = lanes // 2
    while offset:
        distance = arith.ConstantOp(ir.IntegerType.get_signless(32), offset).result
        other = []
        for value in values:
            wide = value if not isinstance(value.type, ir.IndexType) else \
                arith.IndexCastOp(ir.IntegerType.get_signless(64), value).result
            moved = gpu.ShuffleOp(wide, distance, width, gpu.ShuffleMode.XOR).results[0]
            other.append(moved if wide is value else arith.IndexCastOp(value.type, moved).result)
        values = _combine_partials(kind, values, other)
        offset //= 2
    return values


def _block_reduce(kind: str, partial: list[ir.Value], thread: ir.Value, threads: int,
                  cluster: tuple[int, ir.Value] = (1, None)) -> list[ir.Value]:
    """Every thread's `partial` combined, the result read by all threads: within each warp by
    shuffles, then the warps' results through shared memory (one barrier), combined again by
    shuffles in every warp. In a cluster of `blocks` (`cluster`: blocks, this block's rank) each
    warp's lane b stores its result into block b's shared memory, so one cluster barrier gives
    every block all the cluster's warps' results, in the same order."""
    values = _shuffled(kind, partial, 32)
    blocks, rank = cluster
    if threads == 32 and blocks == 1:
        return values
    warps = threads // 32
    shared = [ht.alloc_local([warps * blocks], value.type, "shared") for value in values]
    lane = arith.RemUIOp(thread, ht.index(32)).result
    with ht.when(arith.CmpIOp(arith.CmpIPredicate.ult, lane, ht.index(blocks)).result):
        slot = arith.DivUIOp(thread, ht.index(32)).result
        for buffer, value in zip(shared, values, strict=True):
            if blocks == 1:
                ht.store(value, buffer, [slot])
                continue
            i64 = ir.IntegerType.get_signless(64)
            value = arith.IndexCastOp(i64, value).result if isinstance(value.type, ir.IndexType) else value
            bits = (ir.IntegerType if isinstance(value.type, ir.IntegerType) else ir.FloatType)(value.type).width
            at = arith.AddIOp(arith.MulIOp(rank, ht.index(warps)).result, slot).result
            at = arith.AddIOp(memref.ExtractAlignedPointerAsIndexOp(buffer).result,
                              arith.MulIOp(at, ht.index(bits // 8)).result).result
            local = llvm.IntToPtrOp(ir.Type.parse("!llvm.ptr<3>"), arith.IndexCastOp(i64, at).result).result
            llvm.StoreOp(value, nvvm.mapa(ir.Type.parse("!llvm.ptr<7>"), local,
                                          arith.IndexCastOp(ir.IntegerType.get_signless(32), lane).result))
    if blocks == 1:
        ht.barrier()
    else:
        nvvm.cluster_arrive(aligned=True)
        nvvm.cluster_wait(aligned=True)
    at = arith.RemUIOp(lane, ht.index(warps * blocks)).result  # lanes past the warps re-read one (harmless:
    return _shuffled(kind, [ht.load(b, [at]) for b in shared], warps * blocks)  # pairs below `warps` meet first)


def _row_threads(length: exprs.Expr, lanes: int) -> int:
    """The threads of a block that holds a row in registers, 16 bytes a load (0: it cannot): a
    power of two from 32 to REGISTER_THREADS dividing the row's vectors, about REGISTER_VECTORS
    of them a thread, at most REGISTER_THREADS unless that leaves a thread more than REGISTER_MOST
    (then enough for REGISTER_MOST each, up to 1024) (docs/tuning.md, "CUDA memory-bound kernels"
    and "CUDA reduce: long rows")."""
    if not isinstance(length, int) or length % lanes or length > REGISTER_ROW:
        return 0
    vectors = length // lanes
    threads = 1 << max(5, (max(vectors // REGISTER_VECTORS, 1)).bit_length() - 1)  # ~REGISTER_VECTORS each
    threads = min(threads, REGISTER_THREADS)
    if vectors > threads * REGISTER_MOST:  # rows of 64 KiB: 512 threads of 8; of 128 KiB (f64 16384): 1024
        threads = min(1024, 1 << (-(-vectors // REGISTER_MOST) - 1).bit_length())
    while threads >= 32 and vectors % threads:
        threads //= 2
    return threads if threads >= 32 else 0


def _row_cluster(length: exprs.Expr, lanes: int, archs: Sequence[str]) -> tuple[int, int]:
    """The blocks of a cluster that hold a row in registers, a part each, and each block's threads
    (0: it cannot): past REGISTER_CLUSTER threads the row is split in 2, 4, ... until a block has at
    most REGISTER_PART (the cluster's warps at most 32: one shuffle combines them), from sm_90
    (docs/tuning.md, "f64 long rows")."""
    blocks, threads = 1, _row_threads(length, lanes)
    while threads > (REGISTER_PART if blocks > 1 else REGISTER_CLUSTER) and min(map(arch_number, archs)) >= 90 \
            and length % (2 * blocks * lanes) == 0 \
            and 0 < (part := _row_threads(length // (2 * blocks), lanes)) <= 512 // blocks:
        blocks, threads = 2 * blocks, part
    return blocks, threads


def _reduce_in_registers(inputs: Sequence[ir.Value], out: ir.Value, symbols: dict[str, ir.Value],
                         request: Request, rows: exprs.Expr, threads: int, blocks: int) -> ht.Launch:
    """A row over the last axis read once, 16 bytes a load, into registers (thread t holds vectors
    t, t + T, ...): each reduction from registers then across the block, then the output from
    registers, 16 bytes a store. Memory sees the row once each way (the strided kernel reads it
    once per reduction and once more for a per-element output). In a block of more than
    REGISTER_THREADS the other inputs (layer_norm's weight and bias) are read where a tree uses
    them: loaded with x, they held as many registers again across the reductions (docs/tuning.md,
    "CUDA reduce: long rows"). A row over a cluster of `blocks` (grid: rows x blocks) gives block b
    of the row its b-th part; the reductions combine across the cluster, and each block's
    registers are capped at REGISTER_CAP (several blocks an SM: one loads while another reduces)."""
    program: scalars.Program = request.expr
    x = inputs[0]
    rank, element = ir.MemRefType(x.type).rank, compute_type(*(a.type for a in (*inputs, out)))
    stored = ir.MemRefType(out.type).element_type
    length, lanes = ir.MemRefType(x.type).shape[-1], _lanes(x)
    chunks = length // lanes // threads // blocks
    if blocks > 1:  # launch bounds: at most REGISTER_CAP registers a thread
        kernel = ir.BlockArgument(x).owner.owner.attributes
        kernel["nvvm.cluster_dim"] = ir.DenseI32ArrayAttr.get([blocks, 1, 1])
        kernel["nvvm.minctasm"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), 65536 // threads // REGISTER_CAP)
    with ht.loop(0, ht.size_value(exprs.mul(rows, blocks), symbols), "parallel", "blockIdx.x") as block, \
            ht.loop(0, threads, "parallel", "threadIdx.x") as thread:
        length_value = arith.ConstantOp(element, float(length)).result
        part = arith.RemUIOp(block, ht.index(blocks)).result  # (of 1 block: folded away)
        row = arith.DivUIOp(block, ht.index(blocks)).result
        kept = batch_coordinates(row, [ht.size_value(extent(x, a, request), symbols) for a in range(rank - 1)])
        if blocks > 1:  # (this block has started: the cluster waits for all before storing into another's)
            nvvm.cluster_arrive_relaxed(aligned=True)
        offset = arith.MulIOp(part, ht.index(length // blocks)).result
        starts = [arith.AddIOp(offset, arith.MulIOp(arith.AddIOp(thread, ht.index(c * threads)).result,
                                                    ht.index(lanes)).result).result for c in range(chunks)]
        # past REGISTER_THREADS a thread's registers are few (65536 / threads): the other inputs
        # are read late; below, with x (2-5% faster there on the H200: round 8)
        early = threads <= REGISTER_THREADS and blocks == 1  # (a cluster's blocks: REGISTER_CAP)
        loaded = [[_read(v, broadcast_indices(v, [*kept, start]), lanes) for v in (inputs if early else inputs[:1])]
                  for start in starts]
        held = [columns[0] for columns in loaded]

        def elements(tree: scalars.Tree, c: int) -> list[tuple[list[ir.Value], ir.Value]]:
            """The inputs of each element of the thread's vector c for `tree` (x's from registers;
            one the tree does not use stands in as x) and its position in the row."""
            others = loaded[c][1:] if early else [
                _read(v, broadcast_indices(v, [*kept, starts[c]]), lanes) if scalars.uses(tree, "arg", i)
                else held[c] for i, v in enumerate(inputs) if i]
            return [([held[c][i], *(o[i] for o in others)], arith.AddIOp(starts[c], ht.index(i)).result if i
                     else starts[c]) for i in range(lanes)]

        reds: list[ir.Value] = []
        for kind, tree in program.reductions:
            acc = _initial(kind, accumulator(kind, element))
            for values, position in (e for c in range(chunks) for e in elements(tree, c)):
                acc = combine(kind, acc, emit(tree, values, reds, length_value, element), position)
            if blocks > 1 and not reds:
                nvvm.cluster_wait(aligned=True)
            reds.append(result(kind, _block_reduce(kind, acc, thread, threads, (blocks, part)), element))
        if program.rows:
            with ht.when(arith.CmpIOp(arith.CmpIPredicate.eq, arith.AddIOp(thread, part).result, ht.index(0)).result):
                index = list(kept) + ([ht.index(0)] if ir.MemRefType(out.type).rank == rank else [])
                ht.store(convert(emit(program.out, [], reds, length_value, element), stored), out, index)
        else:
            for c, start in enumerate(starts):
                _write([emit(program.out, v, reds, length_value, element) for v, _ in elements(program.out, c)], out,
                       [*kept, start])
    return ht.Launch((exprs.mul(rows, blocks), 1, 1), (threads, 1, 1))


def reduce(args: Sequence[ir.Value], symbols: dict[str, ir.Value], request: Request) -> ht.Launch:
    *inputs, out = args
    program: scalars.Program = request.expr
    x, axis = inputs[0], program.axis
    rank = ir.MemRefType(x.type).rank
    element, stored = compute_type(*(a.type for a in args)), ir.MemRefType(out.type).element_type
    others = [a for a in range(rank) if a != axis]
    rows = exprs.product(extent(x, a, request) for a in others)
    if axis == rank - 1 and _vector_reads(inputs, extent(x, axis, request), _lanes(x)) and (
            split := _row_cluster(extent(x, axis, request), _lanes(x), request.target.cuda_archs))[1]:
        return _reduce_in_registers(inputs, out, symbols, request, rows, split[1], split[0])
    length_expr = extent(x, axis, request)
    threads = _threads(length_expr)
    with ht.loop(0, ht.size_value(rows, symbols), "parallel", "blockIdx.x") as block, \
            ht.loop(0, threads, "parallel", "threadIdx.x") as thread:
        length = ht.size_value(length_expr, symbols)
        length_value = arith.UIToFPOp(element, arith.IndexCastOp(ir.IntegerType.get_signless(64), length).result).result
        kept = batch_coordinates(block, [ht.size_value(extent(x, a, request), symbols) for a in others])
        where = dict(zip(others, kept, strict=True))

        def at(j: ir.Value) -> list[ir.Value]:
            full = [where[a] if a != axis else j for a in range(rank)]
            return [ht.load(v, broadcast_indices(v, full)) for v in inputs]

        reds: list[ir.Value] = []
        for kind, tree in program.reductions:
            partial = ht.fold(thread, length, threads, _initial(kind, accumulator(kind, element)),
                              accumulate(kind, tree, at, reds, length_value, element))
            reds.append(result(kind, _block_reduce(kind, partial, thread, threads), element))
        if program.rows:
            with ht.when(arith.CmpIOp(arith.CmpIPredicate.eq, thread, ht.index(0)).result):
                index = list(kept)
                if ir.MemRefType(out.type).rank == rank:  # keepdims
                    index.insert(axis, ht.index(0))
                ht.store(convert(emit(program.out, [], reds, length_value, element), stored), out, index)
        else:
            with ht.loop(thread, length, "serial", step=threads) as j:
                ht.store(convert(emit(program.out, at(j), reds, length_value, element), stored), out,
                         [where[a] if a != axis else j for a in range(rank)])
    return ht.Launch((rows, 1, 1), (threads, 1, 1))
