"""cuda attention (ops/attention.py; the same algorithm as cpu_attention.py): out = softmax(
tree(q @ kᵀ, mask)) @ v, one pass over the keys with a running max and sum per query row.

A block of TX x TY threads (TY by the tiling: 16 x 16 holding 128 query rows x 64 keys at d 64 and
d 128) takes one batch index's `rows` query rows (blockIdx.x: batch index, row tile) and walks the
keys `keys` at a time. q's tile, and each key tile's k and v, come to shared memory by cp.async (16
bytes a copy where D, Dv are multiples of 16 bytes; rows past the sequence and columns past D zero-
filled); v's copy is in flight while the scores are computed, the next k's while the weights
multiply v. Thread (ty, tx) holds RM query rows (_rows: ty * RM + r, or runs of 16 bytes
interleaved with thread ty ^ 1's, INTERLEAVE) and keys tx + TX * c of a tile: its scores are RM x
CN dot products over D (128-bit shared loads, a loop of ROLL steps; k's rows padded so 8
consecutive rows hit distinct banks, q's where a warp's rows need it), the tree applied (the mask
read at its broadcast index, a key past Sk -inf); the row's max over the tile is combined across
the 16 lanes holding the row (warp shuffles), the running max m raised, the thread's sums and its
part of the row sum l rescaled by exp(m_old - m), and the weights exp(s - m) stored to shared
memory transposed (key-major: a thread's RM rows of one key are one 128-bit load; each key's row
swizzled, SWIZZLE); then each thread's RM x Dv/TX outputs accumulate weights x v's rows (a loop of
ROLL keys). At the end the row sums are combined across the lanes and out = sums / l, guarded. An
all -inf row takes its exps against 0: 0 / 0 = NaN, as the unfused softmax gives.

    for item in [0, batches * ceil(Sq / rows)) bind blockIdx.x      q_s[rows][D'], k_s, v_s, p_s
      for ty, tx bind threadIdx.y, threadIdx.x: copy q's tile, k's tile 0
        for each key tile t: wait; barrier; copy v's tile t
                             s = tree(q_s k_sᵀ, mask); m' = max(m, shuffle-max s); c = exp(m - m')
                             acc *= c; l = l c + sum p; p_s = p = exp(s - m')
                             wait; barrier; copy k's tile t + 1; acc += p_s v_s
        out = acc / shuffle-sum(l)
"""

from __future__ import annotations

import itertools
import math as math_module
from collections.abc import Callable, Sequence

from hexir_runtime.format import exprs
from mlir import ir
from mlir.dialects import arith, gpu, math, nvgpu, scf, vector

from hexir.dialects import hextir as ht
from hexir.schedules import Request, broadcast_indices, extent
from hexir.schedules.cpu_attention import batch_coordinates, batch_extents, product, safe_max
from hexir.schedules.emit import constant, emit

TX = 16  # threads of a block along the keys: a row's lanes, one half-warp
#: (rows, keys a thread holds in a tile, threads along the rows): the first whose shared buffers
#: fit SHARED_MOST bytes and whose sums and scores a thread holds, rows x (Dv / TX + keys), are at
#: most HELD (8x4x16 at d 128 holds 96: 202 registers, 163 KiB; past it 4x4x32, 128 query rows with
#: 512 threads) (docs/tuning.md, "CUDA attention", "Attention d128 (round 9)")
TILINGS = ((8, 4, 16), (4, 4, 32), (4, 4, 16), (4, 2, 16), (2, 2, 16), (1, 1, 16))
SHARED_MOST, HELD = 164 * 1024, 96
#: The weights' tile unpadded, the 16-byte column of key r at column ^ (r % 8) (key tx + 16 c:
#: one turn a thread): the keys written side by side still hit distinct banks, and with q's tile
#: unpadded two blocks of 64 x 64 tiles fit an SM at d 128 (113 KiB each)
SWIZZLE = True
#: The scores are kept times log2(e) and their exps taken as exp2 (libdevice's exp2f is one
#: ex2.approx, 2 ulp; its expf a dozen instructions) (docs/tuning.md, "CUDA attention").
EXP2 = True
#: A warp's two half-warps read q's rows RM apart (rows ty * RM + r), or with INTERLEAVE where RM
#: is runs of 16 bytes, 16 bytes apart (a thread's runs 32 bytes apart, the other half-warp's
#: between); q's tile is padded by 16 bytes a row (QPAD) where that puts those rows in distinct
#: banks: unpadded, at d 128 with 4 rows a thread they lie 2 KiB apart, the same banks, two
#: passes a load (docs/tuning.md, "Attention d128 (round 9)")
INTERLEAVE, QPAD = True, True
#: The scores' loop over D and the weights x v loop over the keys as loops of (16-byte steps,
#: keys) an iteration, not unrolled whole (None): unrolled, 8x4x16's tile loop at d 128 is 152 KiB
#: of code (8,192 FFMA) and ran 2.0 ms, either loop alone 0.48-0.60 (past the instruction cache);
#: rolled, 0.92 / 0.87 ms at (8, 16), 0.92 / 1.01 at (4, 8) (docs/tuning.md, "Attention d128 (round 9)").
#: ROLL_WIDE for heads of 128 or more where it divides the keys: 0.90 / 0.88 ms against (8, 16)'s 0.92 / 0.92 (run 137)
ROLL, ROLL_WIDE = (8, 16), (16, 32)


def _index_math(a: ir.Value, b: int | ir.Value, op=arith.AddIOp) -> ir.Value:
    return op(a, ht.index(b)).result


def _less(a: ir.Value, b: ir.Value) -> ir.Value:
    return arith.CmpIOp(arith.CmpIPredicate.ult, a, b).result


def _both(a: ir.Value, b: ir.Value) -> ir.Value:
    return arith.AndIOp(a, b).result


def _pad(columns: int, width: int) -> int:
    """The length of the weights' tile's rows: as they are where they are swizzled (SWIZZLE)."""
    return columns if SWIZZLE and columns % (8 * width) == 0 else columns + width


def _column(key: ir.Value | int, column: ir.Value, columns: int, width: int) -> ir.Value:
    """Where column `column` of key `key` lies in the weights' tile of rows of `columns`."""
    if _pad(columns, width) != columns:
        return column
    turn = ht.index(key % 8 * width) if isinstance(key, int) else \
        _index_math(_index_math(key, 7, arith.AndIOp), width, arith.MulIOp)
    return arith.XOrIOp(column, turn).result


def _rows(rm: int, ty: int, width: int) -> tuple[int, list[int]]:
    """(apart, offsets): thread row ty's query rows are (ty // 2) 2 RM + (ty % 2) apart + offset."""
    if INTERLEAVE and rm > width and rm % width == 0 and ty % 2 == 0:
        return width, [r // width * 2 * width + r % width for r in range(rm)]
    return rm, list(range(rm))


def _q_row(rm: int, ty: int, padded: int, width: int) -> int:
    """The length of q's tile's rows (QPAD)."""
    apart = _rows(rm, ty, width)[0]
    return padded + width if QPAD and apart * (padded // width + 1) % 8 else padded


def _plan(d: int, dv: int, width: int, element_bytes: int) -> tuple[int, int, int, int, int]:
    """(rows, keys a thread, threads along the rows, D padded, Dv padded) of the first tiling
    whose shared buffers fit."""
    padded, dv_padded = -(-d // width) * width, -(-dv // (TX * width)) * TX * width
    for rm, cn, ty in TILINGS:
        rows, keys = ty * rm, TX * cn
        size = rows * _q_row(rm, ty, padded, width) + keys * (padded + width + dv_padded + _pad(rows, width))
        if size * element_bytes <= SHARED_MOST and rm * (dv_padded // TX + cn) <= HELD or (rm, cn, ty) == TILINGS[-1]:
            return rm, cn, ty, padded, dv_padded
    raise AssertionError("unreachable")


def _copy(source: ir.Value, at: Callable[[ir.Value, ir.Value], list[ir.Value]], tile: ir.Value, rows: int,
          width: int, limits: tuple[ir.Value, int], origin: ir.Value, run: int, thread: tuple[ir.Value, int]
          ) -> list[ir.Value]:
    """Copy source's rows [origin, origin + rows) x columns [0, width) into tile by cp.async,
    `run` elements a copy, consecutive threads at consecutive addresses; what lies past
    `limits` (rows, columns) is written 0. Returns the copies' tokens."""
    (thread, threads), tokens, total = thread, [], rows * width // run
    size = ir.IntegerAttr.get(ir.IndexType.get(), run)
    for e in range(-(-total // threads)):
        position = _index_math(thread, e * threads)
        r = arith.DivUIOp(_index_math(position, run, arith.MulIOp), ht.index(width)).result
        c = arith.RemUIOp(_index_math(position, run, arith.MulIOp), ht.index(width)).result
        row = _index_math(origin, r) if isinstance(origin, int) else arith.AddIOp(origin, r).result
        inside = _both(_less(row, limits[0]), _less(c, ht.index(limits[1])))
        clamped = [arith.SelectOp(inside, a, ht.index(0)).result for a in (row, c)]
        elements = arith.SelectOp(inside, ht.index(run), ht.index(0)).result

        def issue(r=r, c=c, clamped=clamped, elements=elements) -> ir.Value:
            return nvgpu.DeviceAsyncCopyOp(tile, [r, c], source, at(*clamped), size, srcElements=elements).result
        if (e + 1) * threads <= total:
            tokens.append(issue())
        else:  # the last round: threads past the tile's end copy nothing
            inside_tile = scf.IfOp(_less(position, ht.index(total)))
            with ir.InsertionPoint(inside_tile.then_block):
                issue()
                scf.YieldOp([])
    return tokens


def _group(tokens: list[ir.Value]) -> ir.Value:
    return nvgpu.DeviceAsyncCreateGroupOp(tokens).result


def _across_row(value: ir.Value, combine: Callable[[ir.Value, ir.Value], ir.Value]) -> ir.Value:
    """`value` combined over the TX lanes holding one row (a half-warp: xor shuffles)."""
    i32 = ir.IntegerType.get_signless(32)
    offset = TX // 2
    while offset:
        other = gpu.ShuffleOp(value, arith.ConstantOp(i32, offset).result, arith.ConstantOp(i32, 32).result,
                              gpu.ShuffleMode.XOR).results[0]
        value = combine(value, other)
        offset //= 2
    return value


def attention(args: Sequence[ir.Value], symbols: dict[str, ir.Value], request: Request) -> ht.Launch:
    q, k, v, out, mask = args[0], args[1], args[2], args[-1], (args[3] if len(args) == 5 else None)
    element = ir.MemRefType(out.type).element_type
    element_bytes = ir.FloatType(element).width // 8
    width = 16 // element_bytes
    d, dv = ir.MemRefType(q.type).shape[-1], ir.MemRefType(v.type).shape[-1]
    rm, cn, ty_extent, padded, dv_padded = _plan(d, dv, width, element_bytes)
    rows, keys, dvt = ty_extent * rm, TX * cn, dv_padded // TX
    roll = ROLL_WIDE if d >= 128 and keys % ROLL_WIDE[1] == 0 else ROLL
    batch = batch_extents(out, request)
    sq, sk = extent(out, len(batch), request), extent(k, ir.MemRefType(k.type).rank - 2, request)
    row_tiles = exprs.ceildiv(sq, rows)
    grid = (exprs.mul(product(batch), row_tiles), 1, 1)
    vtype = ir.VectorType.get([width], element)
    with ht.loop(0, ht.size_value(grid[0], symbols), "parallel", "blockIdx.x") as item:
        q_s = ht.alloc_local([rows, _q_row(rm, ty_extent, padded, width)], element, "shared")
        k_s = ht.alloc_local([keys, padded + width], element, "shared")  # (a swizzle's addresses cost registers)
        v_s = ht.alloc_local([keys, dv_padded], element, "shared")
        p_s = ht.alloc_local([keys, _pad(rows, width)], element, "shared")
        with ht.loop(0, ty_extent, "parallel", "threadIdx.y") as ty, ht.loop(0, TX, "parallel", "threadIdx.x") as tx:
            tiles, sq_v, sk_v = (ht.size_value(e, symbols) for e in (row_tiles, sq, sk))
            at = batch_coordinates(arith.DivUIOp(item, tiles).result, [ht.size_value(e, symbols) for e in batch])
            q0 = _index_math(arith.RemUIOp(item, tiles).result, rows, arith.MulIOp)
            thread = arith.AddIOp(_index_math(ty, TX, arith.MulIOp), tx).result, TX * ty_extent

            def reader(buffer: ir.Value) -> Callable[[ir.Value, ir.Value], list[ir.Value]]:
                return lambda r, c: broadcast_indices(buffer, [*at, r, c])

            def copy_k(k0: ir.Value) -> list[ir.Value]:
                return _copy(k, reader(k), k_s, keys, padded, (sk_v, d), k0, width if d % width == 0 else 1, thread)

            first = _group(_copy(q, reader(q), q_s, rows, padded, (sq_v, d), q0, width if d % width == 0 else 1, thread)
                   + copy_k(ht.index(0)))
            m, total = ht.alloc_local([rm], element), ht.alloc_local([rm], element)
            acc, held = ht.alloc_local([rm, dvt], element), ht.alloc_local([rm, cn], element)
            ninf, zero = constant(float("-inf"), element), constant(0.0, element)
            log2e, exp = constant(1 / math_module.log(2), element), math.Exp2Op if EXP2 else math.ExpOp
            for r in range(rm):
                ht.store(ninf, m, [ht.index(r)])
                ht.store(zero, total, [ht.index(r)])
                for c in range(dvt):
                    ht.store(zero, acc, [ht.index(r), ht.index(c)])
            apart, offsets = _rows(rm, ty_extent, width)
            base = _index_math(ty, rm, arith.MulIOp) if apart == rm else arith.AddIOp(
                _index_math(_index_math(ty, 2, arith.DivUIOp), 2 * rm, arith.MulIOp),
                _index_math(_index_math(ty, 2, arith.RemUIOp), apart, arith.MulIOp)).result
            my_rows = [_index_math(base, offset) for offset in offsets]
            my_keys = [_index_math(tx, TX * c) for c in range(cn)]
            with ht.loop(0, arith.CeilDivUIOp(sk_v, ht.index(keys)).result, "serial") as tile:
                k0 = _index_math(tile, keys, arith.MulIOp)
                nvgpu.DeviceAsyncWaitOp(first, numGroups=0)  # (the wait is for every group: any token)
                ht.barrier()
                v_run = width if dv % width == 0 else 1
                v_group = _group(_copy(v, reader(v), v_s, keys, dv_padded, (sk_v, dv), k0, v_run, thread))
                steps = padded // width  # 16-byte steps along D, `step` of them an iteration (ROLL)
                step = next(u for u in range(min(roll[0] or steps, steps), 0, -1) if steps % u == 0)
                for r, c in itertools.product(range(rm), range(cn)):
                    ht.store(zero, held, [ht.index(r), ht.index(c)])
                with ht.loop(0, steps // step, "serial") as i:
                    scores = [[ht.load(held, [ht.index(r), ht.index(c)]) for c in range(cn)] for r in range(rm)]
                    for u in range(step):
                        d0 = _index_math(_index_math(i, step * width, arith.MulIOp), u * width)
                        qs = [vector.LoadOp(vtype, q_s, [row, d0]).result for row in my_rows]
                        ks = [vector.LoadOp(vtype, k_s, [key, d0]).result for key in my_keys]
                        for r, c, w in itertools.product(range(rm), range(cn), range(width)):
                            product_ = arith.MulFOp(vector.ExtractOp(qs[r], [], [w]).result,
                                                    vector.ExtractOp(ks[c], [], [w]).result, fastmath=_contract())
                            scores[r][c] = arith.AddFOp(scores[r][c], product_.result, fastmath=_contract()).result
                    for r, c in itertools.product(range(rm), range(cn)):
                        ht.store(scores[r][c], held, [ht.index(r), ht.index(c)])
                scores = [[ht.load(held, [ht.index(r), ht.index(c)]) for c in range(cn)] for r in range(rm)]
                for r, row in enumerate(my_rows):
                    global_row = arith.AddIOp(q0, row).result
                    for c, key in enumerate(my_keys):
                        global_key = arith.AddIOp(k0, key).result
                        value = scores[r][c]
                        if mask is not None:  # (read inside: a row or key past the end reads the last)
                            inside = [arith.MinUIOp(a, arith.SubIOp(b, ht.index(1)).result).result
                                      for a, b in ((global_row, sq_v), (global_key, sk_v))]
                            value = emit(request.expr, [value, ht.load(mask, broadcast_indices(mask, [*at, *inside]))])
                        elif request.expr is not None:
                            value = emit(request.expr, [value])
                        if EXP2:  # (a positive factor: the max is the same score's)
                            value = arith.MulFOp(value, log2e).result
                        scores[r][c] = arith.SelectOp(_less(global_key, sk_v), value, ninf).result
                for r in range(rm):
                    top = scores[r][0]
                    for c in range(1, cn):
                        top = arith.MaximumFOp(top, scores[r][c]).result
                    old = ht.load(m, [ht.index(r)])
                    new = arith.MaximumFOp(old, _across_row(top, lambda a, b: arith.MaximumFOp(a, b).result)).result
                    ht.store(new, m, [ht.index(r)])
                    base = safe_max(new)
                    scale = exp(arith.SubFOp(old, base).result).result
                    part = arith.MulFOp(ht.load(total, [ht.index(r)]), scale).result
                    for c in range(cn):
                        scores[r][c] = exp(arith.SubFOp(scores[r][c], base).result).result
                        part = arith.AddFOp(part, scores[r][c]).result
                    ht.store(part, total, [ht.index(r)])
                    for c in range(dvt):
                        at_acc = [ht.index(r), ht.index(c)]
                        ht.store(arith.MulFOp(ht.load(acc, at_acc), scale).result, acc, at_acc)
                for c, key in enumerate(my_keys):  # rm consecutive rows: runs of `width`
                    for r0 in range(0, rm, width):
                        lanes = min(width, rm - r0)
                        values = [scores[r][c] for r in range(r0, r0 + lanes)]
                        if lanes == 1:
                            ht.store(values[0], p_s, [key, _column(tx, my_rows[r0], rows, width)])
                            continue
                        packed = vector.FromElementsOp(ir.VectorType.get([lanes], element), values).result
                        vector.StoreOp(packed, p_s, [key, _column(tx, my_rows[r0], rows, width)])
                nvgpu.DeviceAsyncWaitOp(v_group, numGroups=0)
                ht.barrier()
                _group(copy_k(_index_math(k0, keys)))
                row_type = ir.VectorType.get([min(width, rm)], element)
                # the sums read once and written once an iteration of `chunk` keys (ROLL: a multiple of 8,
                # the swizzle's turn known), SSA values between (after LLVM's mem2reg: fewer ops to convert)
                chunk = roll[1] or keys
                columns = [_index_math(_index_math(tx, width, arith.MulIOp), run * TX * width)
                           for run in range(dvt // width)]
                with ht.loop(0, keys // chunk, "serial") as i:
                    running = {(r, c): ht.load(acc, [ht.index(r), ht.index(c)])
                               for r, c in itertools.product(range(rm), range(dvt))}
                    for u in range(chunk):
                        key = _index_math(_index_math(i, chunk, arith.MulIOp), u)
                        weights = []
                        for r0 in range(0, rm, width):
                            loaded = vector.LoadOp(row_type, p_s, [key, _column(u, my_rows[r0], rows, width)]).result
                            weights += [vector.ExtractOp(loaded, [], [w]).result for w in range(min(width, rm))]
                        values = []
                        for column in columns:
                            loaded = vector.LoadOp(vtype, v_s, [key, column]).result
                            values += [vector.ExtractOp(loaded, [], [w]).result for w in range(width)]
                        for r, c in itertools.product(range(rm), range(dvt)):
                            product_ = arith.MulFOp(weights[r], values[c], fastmath=_contract()).result
                            running[r, c] = arith.AddFOp(running[r, c], product_, fastmath=_contract()).result
                    for (r, c), total_ in running.items():
                        ht.store(total_, acc, [ht.index(r), ht.index(c)])
            nvgpu.DeviceAsyncWaitOp(first, numGroups=0)  # (the last tile's k copies: none left in flight)
            for r, row in enumerate(my_rows):
                global_row = arith.AddIOp(q0, row).result
                l_row = _across_row(ht.load(total, [ht.index(r)]), lambda a, b: arith.AddFOp(a, b).result)
                for c in range(dvt):
                    column = _index_math(_index_math(tx, width, arith.MulIOp), c // width * TX * width + c % width)
                    inside = scf.IfOp(_both(_less(global_row, sq_v), _less(column, ht.index(dv))))
                    with ir.InsertionPoint(inside.then_block):
                        value = arith.DivFOp(ht.load(acc, [ht.index(r), ht.index(c)]), l_row).result
                        ht.store(value, out, [*at, global_row, column])
                        scf.YieldOp([])
    return ht.Launch(grid, (TX, ty_extent, 1))


def _contract() -> ir.Attribute:
    return ir.Attribute.parse("#arith.fastmath<contract>")
