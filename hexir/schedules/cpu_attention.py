"""cpu attention (ops/attention.py; the online softmax of cuda_attention.py): out = softmax(
tree(q @ kᵀ, mask)) @ v in one pass over the keys, a running max and sum per query row.

The args are q[..., Sq, D], k[..., Sk, D], v[..., Sk, Dv], the mask?, out[..., Sq, Dv] (each
operand read at its own, broadcast, batch index: an axis of extent 1 at 0). The parallel work
items are (batch index, ROWS query rows). Both products are the batched matmul's micro-kernel
(cpu.py's MICRO: MR x NR sums in vector registers, an FMA of a broadcast and a vector a step).
An item copies its rows of q transposed (qt[D, ROWS], rows past Sq repeat the last) and walks
the keys KEYS at a time: the block's scores transposed, s[j, rows] = tree(k[j] @ qt, mask), MR
keys x NR rows a micro-kernel (the mask's block transposed first, NR x NR tiles in registers:
`_transpose_mask`), so the max, the exps (float64: mathlib's; float32: `_exp`, in float32) and
the sums run along the rows as vectors, no horizontal reduction anywhere; then the sums
acc[ROWS, Dv], rescaled by c = exp(m_old - m) as they are loaded, += p @ v[block], MR rows x NR
columns a micro-kernel. A row whose scores are all -inf keeps m = -inf (its exps taken against
0: all 0), so it ends 0 / 0 = NaN, as the unfused softmax gives.

    for item in [0, batches * ceil(Sq / ROWS)) parallel
      qt = q[rows]ᵀ; m = -inf, l = 0, acc = 0
      for each KEYS keys: s = tree(k[block] @ qt, mask);  m' = max(m, max_j s); c = exp(m - m')
                          s = exp(s - m'); l = l c + sum_j s;  acc = acc c + sᵀ @ v[block]
      out[rows] = acc / l
"""

from __future__ import annotations

from collections.abc import Sequence

from hexir_runtime.format import exprs
from hexir_runtime.format.exprs import product
from mlir import ir
from mlir.dialects import arith, math, vector

from hexir.dialects import hextir as ht
from hexir.schedules import Request, broadcast_indices, extent
from hexir.schedules.cpu import MICRO
from hexir.schedules.emit import constant, emit

#: A work item's query rows: at least ROWS, and 3 vectors of the widest NR (AVX-512's: every level's
#: kernel walks the same items, the module's one work record; k and v stay in the cache between rows).
ROWS = 48
#: The keys of a block (the sums are rescaled once a block): a multiple of every level's MR and NR.
KEYS = 96
#: The steps of a micro-kernel's loop unrolled (cpu.py's UNROLL).
UNROLL = 4


def batch_coordinates(flat: ir.Value, extents: Sequence[ir.Value]) -> list[ir.Value]:
    """The index over `extents` (row-major) of the flat index `flat`."""
    coordinates = []
    for size in reversed(list(extents)[1:]):
        coordinates.append(arith.RemUIOp(flat, size).result)
        flat = arith.DivUIOp(flat, size).result
    return [flat, *reversed(coordinates)] if extents else []


def batch_extents(out: ir.Value, request: Request) -> list[exprs.Expr]:
    return [extent(out, d, request) for d in range(ir.MemRefType(out.type).rank - 2)]


def safe_max(m: ir.Value) -> ir.Value:
    """The running max a row's exps are taken against: 0 while every score so far is -inf."""
    ninf = constant(float("-inf"), m.type)
    return arith.SelectOp(arith.CmpFOp(arith.CmpFPredicate.OEQ, m, ninf).result, constant(0.0, m.type), m).result


def _exp(x: ir.Value) -> ir.Value:
    """exp(x) for the x <= 0 (or NaN) of a softmax: float64's is mathlib's; float32's is computed
    in float32 (mathlib's, in float64 for 0.5 ulp, cost four times the products of d 64): 2^n p(r)
    with n = round(x / ln 2), r = x - n ln 2 (Cody and Waite's two parts), p exp's Taylor series to
    r^7 (|r| <= 0.347: under 1e-8 relative; with the roundings 1-2 ulp), 0 below -87 (a weight
    under 2^-125 of the row's largest, 1, is lost in its sum anyway; a row masked whole keeps 0 / 0)."""
    if not isinstance(ir.VectorType(x.type).element_type, ir.F32Type):
        return math.ExpOp(x).result
    i32 = ir.VectorType.get(ir.VectorType(x.type).shape, ir.IntegerType.get_signless(32))
    keep = arith.CmpFOp(arith.CmpFPredicate.OGE, x, constant(-87.0, x.type)).result  # (not NaN)
    y = arith.SelectOp(keep, x, constant(-87.0, x.type)).result
    n = arith.SubFOp(arith.AddFOp(arith.MulFOp(y, constant(1 / 0.6931471805599453, x.type)).result,
                                  constant(12582912.0, x.type)).result, constant(12582912.0, x.type)).result
    r = vector.FMAOp(n, constant(-0.693359375, x.type), y).result
    r = vector.FMAOp(n, constant(2.1219444005469058e-4, x.type), r).result
    p = constant(1 / 5040, x.type)
    for k in (720, 120, 24, 6, 2, 1, 1):
        p = vector.FMAOp(p, r, constant(1 / k, x.type)).result
    bits = arith.FPToSIOp(i32, arith.AddFOp(n, constant(127.0, x.type)).result).result  # 2^n's exponent field
    shift = arith.ConstantOp(i32, ir.DenseElementsAttr.get_splat(i32, ir.IntegerAttr.get(i32.element_type, 23)))
    value = arith.MulFOp(p, arith.BitcastOp(x.type, arith.ShLIOp(bits, shift.result).result).result).result
    return arith.SelectOp(keep, value, arith.SelectOp(arith.CmpFOp(arith.CmpFPredicate.UNO, x, x).result, x,
                                                      constant(0.0, x.type)).result).result


def _walk(upper: ir.Value, carried: list[ir.Value], step) -> list[ir.Value]:
    """carried = step(j, carried) for j in [0, upper): UNROLL j's a trip, then the rest."""
    middle = arith.MulIOp(arith.DivUIOp(upper, ht.index(UNROLL)).result, ht.index(UNROLL)).result

    def unrolled(j: ir.Value, values: list[ir.Value]) -> list[ir.Value]:
        for u in range(UNROLL):
            values = step(arith.AddIOp(j, ht.index(u)).result if u else j, values)
        return values
    carried = ht.fold(ht.index(0), middle, ht.index(UNROLL), carried, unrolled)  # (loop-carried: registers)
    return ht.fold(middle, upper, ht.index(1), carried, step)


def _groups(count: ir.Value, size: int, body) -> None:
    """body(first, size) for each `size` of [0, count), then body(i, 1) for each one left."""
    full = arith.DivUIOp(count, ht.index(size)).result
    with ht.loop(0, full, "serial") as g:
        body(arith.MulIOp(g, ht.index(size)).result, size)
    with ht.loop(arith.MulIOp(full, ht.index(size)).result, count, "serial") as i:
        body(i, 1)


def attention(args: Sequence[ir.Value], symbols: dict[str, ir.Value], request: Request) -> ht.Work:
    q, k, v, out, mask = args[0], args[1], args[2], args[-1], (args[3] if len(args) == 5 else None)
    element = ir.MemRefType(out.type).element_type
    d, dv = ir.MemRefType(q.type).shape[-1], ir.MemRefType(v.type).shape[-1]
    dtype = "float64" if isinstance(element, ir.F64Type) else "float32"
    mr, nr = MICRO[request.target.cpu, dtype]
    rows, keys = max(ROWS, 3 * MICRO["x86-64-v4", dtype][1]), KEYS
    batch = batch_extents(out, request)
    sq, sk = extent(out, len(batch), request), extent(k, ir.MemRefType(k.type).rank - 2, request)
    row_blocks = exprs.ceildiv(sq, rows)
    items = exprs.mul(product(batch), row_blocks)
    panel = ir.VectorType.get([nr], element)
    qt, scores = ht.alloc_local([d, rows], element), ht.alloc_local([keys, rows], element)
    sums, stats = ht.alloc_local([rows, dv], element), ht.alloc_local([3, rows], element)  # stats: m, l, c
    masks = ht.alloc_local([keys, rows], element) if mask is not None else None  # the mask's block, transposed
    zero, one, two = (ht.index(n) for n in range(3))
    with ht.loop(0, ht.size_value(items, symbols), "parallel") as item:
        blocks, sq_, sk_ = (ht.size_value(e, symbols) for e in (row_blocks, sq, sk))
        at = batch_coordinates(arith.DivUIOp(item, blocks).result, [ht.size_value(e, symbols) for e in batch])
        r0 = arith.MulIOp(arith.RemUIOp(item, blocks).result, ht.index(rows)).result
        count = arith.SubIOp(arith.MinUIOp(arith.AddIOp(r0, ht.index(rows)).result, sq_).result, r0).result
        last = arith.SubIOp(count, one).result
        panels = arith.CeilDivUIOp(count, ht.index(nr)).result

        def row(t: ir.Value) -> ir.Value:  # the query row of the item's t-th (past Sq: the last)
            return arith.AddIOp(r0, arith.MinUIOp(t, last).result).result

        with ht.loop(0, arith.MulIOp(panels, ht.index(nr)).result, "serial") as t:
            i = row(t)
            with ht.loop(0, d, "serial") as c:
                ht.store(ht.load(q, broadcast_indices(q, [*at, i, c])), qt, [c, t])
        with ht.loop(0, panels, "serial") as p:
            for stat, start in ((zero, float("-inf")), (one, 0.0)):
                vector.StoreOp(constant(start, panel), stats, [stat, arith.MulIOp(p, ht.index(nr)).result])
        with ht.loop(0, count, "serial") as t:
            vector.StoreOp(constant(0.0, ir.VectorType.get([dv], element)), sums, [t, zero])
        with ht.loop(0, arith.CeilDivUIOp(sk_, ht.index(keys)).result, "serial") as block:
            j0 = arith.MulIOp(block, ht.index(keys)).result
            nk = arith.SubIOp(arith.MinUIOp(arith.AddIOp(j0, ht.index(keys)).result, sk_).result, j0).result

            if masks is not None:
                _transpose_mask(mask, masks, at, row, (panels, nr), (j0, nk))

            def scores_of(first: ir.Value, size: int) -> None:  # s[first:first+size, all rows]
                with ht.loop(0, panels, "serial") as p:
                    t0 = arith.MulIOp(p, ht.index(nr)).result
                    key = [arith.AddIOp(j0, arith.AddIOp(first, ht.index(u)).result).result for u in range(size)]

                    def step(c: ir.Value, acc: list[ir.Value]) -> list[ir.Value]:
                        b = vector.LoadOp(panel, qt, [c, t0]).result
                        return [vector.FMAOp(vector.BroadcastOp(panel, ht.load(k, broadcast_indices(
                            k, [*at, j, c]))).result, b, a).result for j, a in zip(key, acc, strict=True)]
                    products = _walk(ht.index(d), [constant(0.0, panel)] * size, step)
                    for u, value in enumerate(products):
                        j = arith.AddIOp(first, ht.index(u)).result
                        extra = [vector.LoadOp(panel, masks, [j, t0]).result] if masks is not None else []
                        value = emit(request.expr, [value, *extra]) if request.expr is not None else value
                        vector.StoreOp(value, scores, [j, t0])
            _groups(nk, mr, scores_of)
            with ht.loop(0, panels, "serial") as p:
                t0 = arith.MulIOp(p, ht.index(nr)).result
                m = vector.LoadOp(panel, stats, [zero, t0]).result
                top = _walk(nk, [m], lambda j, acc: [arith.MaximumFOp(
                    acc[0], vector.LoadOp(panel, scores, [j, t0]).result).result])[0]
                base = safe_max(top)
                scale = _exp(arith.SubFOp(m, base).result)

                def exps(j: ir.Value, acc: list[ir.Value]) -> list[ir.Value]:
                    e = _exp(arith.SubFOp(vector.LoadOp(panel, scores, [j, t0]).result, base).result)
                    vector.StoreOp(e, scores, [j, t0])
                    return [arith.AddFOp(acc[0], e).result]
                total = _walk(nk, [arith.MulFOp(vector.LoadOp(panel, stats, [one, t0]).result, scale).result],
                              exps)[0]
                for stat, value in ((zero, top), (one, total), (two, scale)):
                    vector.StoreOp(value, stats, [stat, t0])

            def weigh(c0: ir.Value, width: int) -> None:
                _groups(count, mr, lambda t0, size: _weigh(v, at, (scores, sums, stats), (j0, nk), t0, size, c0, width))
            with ht.loop(0, dv // nr, "serial") as c:  # v's columns, NR at a time, then the dv % NR left
                weigh(arith.MulIOp(c, ht.index(nr)).result, nr)
            if dv % nr:
                weigh(ht.index(dv - dv % nr), dv % nr)
        with ht.loop(0, count, "serial") as t:
            wide = ir.VectorType.get([dv], element)
            total = vector.BroadcastOp(wide, ht.load(stats, [one, t])).result
            vector.StoreOp(arith.DivFOp(vector.LoadOp(wide, sums, [t, zero]).result, total).result, out,
                           [*at, arith.AddIOp(r0, t).result, zero])
    per_item = rows * (d + dv) * (sk if isinstance(sk, int) else 64)
    return ht.Work(items, max(1, -(-65536 // per_item)))


def _transpose_mask(mask: ir.Value, masks: ir.Value, at: list[ir.Value], row, panels, block) -> None:
    """masks[j, t] = mask[row t, j0 + j] for the block's keys and the item's rows: NR x NR tiles
    read as NR rows of the mask (past the block's keys: 0) and transposed in registers, log2 NR
    rounds of NR shuffles (an element a time, the kernel spent a third of its time on the mask)."""
    (count, nr), (j0, nk) = panels, block
    type_ = ir.VectorType.get([nr], ir.MemRefType(masks.type).element_type)
    shape = ir.MemRefType(mask.type).shape

    def read(i: ir.Value, jc: ir.Value) -> ir.Value:  # mask[i, j0 + jc:][:nr], a key axis of 1 broadcast
        where = broadcast_indices(mask, [*at, i, arith.AddIOp(j0, jc).result])
        if not shape or shape[-1] == 1:
            return vector.BroadcastOp(type_, ht.load(mask, where)).result
        keys = vector.CreateMaskOp(ir.VectorType.get([nr], ir.IntegerType.get_signless(1)),
                                   [arith.SubIOp(nk, jc).result]).result
        return vector.MaskedLoadOp(type_, mask, where, keys, constant(0.0, type_)).result

    with ht.loop(0, count, "serial") as p:
        t0 = arith.MulIOp(p, ht.index(nr)).result
        rows = [row(arith.AddIOp(t0, ht.index(t)).result) for t in range(nr)]
        with ht.loop(0, arith.CeilDivUIOp(nk, ht.index(nr)).result, "serial") as c:
            jc = arith.MulIOp(c, ht.index(nr)).result
            tile, h = [read(i, jc) for i in rows], nr // 2
            while h:  # swap the off-diagonal h x h blocks of every 2h x 2h block
                low = [x for s in range(0, nr, 2 * h) for x in [*range(s, s + h), *range(nr + s, nr + s + h)]]
                for i in [i for i in range(nr) if i % (2 * h) < h]:
                    tile[i], tile[i + h] = (vector.ShuffleOp(tile[i], tile[i + h], [x + shift for x in low]).result
                                            for shift in (0, h))
                h //= 2
            for u, value in enumerate(tile):
                vector.StoreOp(value, masks, [arith.AddIOp(jc, ht.index(u)).result, t0])


def _weigh(v: ir.Value, at: list[ir.Value], buffers, block, t0: ir.Value, size: int, c0: ir.Value,
           width: int) -> None:
    """sums[t0:t0+size, c0:c0+width] = sums * c + s[:, t0:t0+size]ᵀ @ v[block, c0:c0+width]."""
    scores, sums, stats = buffers
    j0, nk = block
    element = ir.MemRefType(v.type).element_type
    type_ = ir.VectorType.get([width], element)
    rows = [arith.AddIOp(t0, ht.index(u)).result if u else t0 for u in range(size)]
    start = [arith.MulFOp(vector.LoadOp(type_, sums, [t, c0]).result, vector.BroadcastOp(
        type_, ht.load(stats, [ht.index(2), t])).result).result for t in rows]

    def step(j: ir.Value, acc: list[ir.Value]) -> list[ir.Value]:
        b = vector.LoadOp(type_, v, broadcast_indices(v, [*at, arith.AddIOp(j0, j).result, c0])).result
        return [vector.FMAOp(vector.BroadcastOp(type_, ht.load(scores, [j, t])).result, b, a).result
                for t, a in zip(rows, acc, strict=True)]
    for t, value in zip(rows, _walk(nk, start, step), strict=True):
        vector.StoreOp(value, sums, [t, c0])
