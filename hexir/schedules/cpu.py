"""cpu schedules: the outermost loop is `parallel` (the runtime splits its range across host
threads: the kernel's work record says how many iterations it has), the rest `serial`.

linear (out[M,N] = x[M,K] @ w[K,N], epilogues: bias, then fused element-wise ops) is a
register-blocked GEMM. The output is cut into tiles of MC rows x NC columns, the parallel
work items, so a 1-row product still has a column tile per core. In a tile, K is walked in
blocks of KC (so the KC x NR slice of w a micro-kernel streams stays in L1), and the columns
in panels of NR: the micro-kernel keeps MR x NR sums in vector registers (`vector.fma` of a
broadcast x[i, k] and the row w[k, j:j+NR]), loading nothing else in its k loop.

    for t in [0, tiles) parallel                      tiles = ceil(M/MC) * ceil(N/NC)
      for kb in [0, ceil(K/KC)) serial
        for each NR panel of the tile's columns       (the last one NR or narrower: N % NR; the
                                                      narrower with the last full one where the
                                                      registers hold both: `_merges_edge`)
          for each MR rows of the tile's rows         (then the left-over rows one by one)
            acc[MR] = bias or 0 (first k block) or out[rows, panel]
            for k in kb's KC (UNROLL k's a trip, then the rest):
                b = w[k, panel]; acc[r] = fma(broadcast x[row r, k], b, acc[r])
            out[rows, panel] = epilogues(acc) (last k block) or acc

The tile sizes, per x86-64 level and dtype, are the table `MICRO` below: MR x NR fills about
12 vector registers with sums (16 registers on every level, 32 on AVX-512).

A constant w wider than a panel comes packed at compile time (passes/pack_weights.py: panels
of PANEL_BYTES columns, K-major; `request.panels`): no tile copies it, and every micro-kernel reads its panel
slice contiguously, w[k, j] at panels[j / L, k, j % L]. Such a product takes tiles whatever its
rows: each tile's KC x NR slices are contiguous already, where streaming them KS rows at a time
reads a few hundred bytes of each panel per step (docs/tuning.md, "CPU constant w in panels").

A w known only at run time (an argument, or computed) of a static product tall enough
(`packs_w`, `PACK_ROWS`: f64 from 1024 rows) comes in the same panels: lower-to-tir calls a
`pack_panels` kernel on it first,
once per call, parallel over the panels' blocks of KC k's (BLIS's order: each tile copying its
own block of w packed each block once per row tile, 11 times at 2048 rows). A symbolic batch's
tiles still copy their block of w on their stack (`_pack`), if they have PACK_FROM_ROWS rows.

Up to STREAM_ROWS static rows of a w in rows (an argument, or a constant of one panel or less),
w is streamed instead (`_stream`): the parallel loop is bound to `chunk`, so a thread's run of
column tiles is one span, walked in sub-blocks of STREAM_COLUMNS columns, STREAM_KS rows of w at
a time (up to STREAM_FEW rows: longer sub-blocks, blocks of fewer rows). Each k block's x
(m x KS) is first copied to a small contiguous buffer, and a sub-block's sums wait between k
blocks in another (`held`), out written once, at the last block:

    for [first, last) of the column tiles, once    (hextir.chunk_end = last)
      for each sub-block of the span
        for kb in [0, ceil(K/KS)) serial
          xs = x[:, kb]
          for each group of rows (all of them, up to STREAM_SUMS), each call of vectors:
            sums = bias or 0 or held; += xs[rows] @ w[kb, vectors] (prefetching w: `_fetch`)
            out = epilogues(sums) (last k block) or held = sums

x's rows and out's are often a multiple of 4 KiB apart, as w's are (K, N powers of two): reading
x in place, a group's rows fell on one set of the L1 cache, and each sum written to out stalled
the next call's loads of w, 4 KiB apart (docs/tuning.md, "CPU streamed products").

The pointwise and reduce families' kernels: cpu_families.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from hexir_runtime.format import exprs
from mlir import ir
from mlir.dialects import arith, memref, vector

from hexir.dialects import hextir as ht
from hexir.schedules import Request, extent

#: (MR rows, NR columns) of the micro-kernel, by x86-64 level and dtype.
MICRO = {
    ("x86-64-v4", "float32"): (6, 32), ("x86-64-v4", "float64"): (6, 16),   # 12 zmm sums
    ("x86-64-v3", "float32"): (6, 16), ("x86-64-v3", "float64"): (6, 8),    # 12 ymm sums
    ("x86-64-v2", "float32"): (4, 8), ("x86-64-v2", "float64"): (4, 4),     # 8 xmm sums
    ("x86-64", "float32"): (4, 8), ("x86-64", "float64"): (4, 4),
}
#: k block: w's KC x NR slice stays in the L1 cache (16-32 KiB).
KC = 256
#: k's a trip of a tile's micro-kernel loop (LLVM leaves the loop as it is): 4 beat 1, tiled and
#: streamed (docs/tuning.md, "CPU micro-kernel").
UNROLL = 4
#: A constant w comes packed in panels this wide (passes/pack_weights.py; one a 1-row product alone
#: reads, NC_BYTES wide): every level's NR divides both.
PANEL_BYTES = 128
#: A product of at most this many rows (static) streams w (`_stream`): its span in sub-blocks of
#: STREAM_COLUMNS columns, STREAM_KS rows of w at a time, each call's sums at most STREAM_SUMS
#: vectors (of 32 registers on AVX-512, else 16: `_stream_groups`), a prefetch of w STREAM_AHEAD
#: calls ahead: the values that were fastest on the 16-core host (docs/tuning.md, "CPU streamed
#: products").
STREAM_ROWS, STREAM_COLUMNS, STREAM_KS, STREAM_SUMS, STREAM_AHEAD = 16, 256, 32, {"x86-64-v4": 16}, 2
#: A product of up to STREAM_FEW rows reads w from memory more than it computes: blocks of
#: STREAM_FEW_KS rows of w (fewer concurrent streams of w), sub-blocks of up to STREAM_FEW_BYTES of
#: sums (w's rows read in long runs where a thread's span is wide), and a prefetch of w's row
#: k + STREAM_FEW_AHEAD at each vector of a call (docs/tuning.md, "CPU streamed products").
STREAM_FEW, STREAM_FEW_KS, STREAM_FEW_BYTES, STREAM_FEW_AHEAD = 8, 8, 65536, {"float32": 32, "float64": 8}
#: A tile of at least this many rows packs w's block first (fewer: the copy costs more than it saves).
PACK_FROM_ROWS = 24
#: Whether a tile copies its block of x (its rows x KC) into a buffer of rows KC + X_PAD elements
#: apart, by dtype, before its micro-kernels read it: x's own rows, K apart, fall on one set of
#: the L1 cache when K * size is a multiple of 4 KiB (docs/tuning.md, "CPU linear with w known
#: at run time").
PACK_X: dict[str, bool] = {"float32": False, "float64": False}
X_PAD = 16
#: The parallel tiles: MC rows (a multiple of every MR) x NC_BYTES of columns (a multiple of
#: every NR). The same on every level, so the work record is too: a module's libraries for
#: several levels share one manifest. MC is the most rows that still leave WORK_ITEMS tiles
#: (twice the cores of a 16-core host): more rows per tile reuse each packed block of w more.
#: 512-byte columns rather than 1 KiB give small products tiles enough for 16 cores; 24-row tiles
#: are for the products that even 48 rows leave short of items, 12-row tiles (never packing) for
#: static products that 24 rows leave short too (docs/tuning.md, "CPU tile sizes"). A symbolic
#: batch's tiles keep MC_SYMBOLIC rows (12 would never pack w, whatever the batch).
MC_CHOICES, NC_BYTES, WORK_ITEMS, MC_SYMBOLIC = (192, 96, 48, 24, 12), 512, 32, 24
assert all(size % (nr * np.dtype(dtype).itemsize) == 0 for (_, dtype), (_, nr) in MICRO.items()
           for size in (PANEL_BYTES, NC_BYTES))  # the widths of panels: passes/pack_weights.py
#: A w in panels (a constant) is copied by no tile, so a tile's rows buy no reuse of a copy: its
#: tiles take at most 48 rows, whose x block (48 x KC) the panel loop re-reads from nearer
#: caches (docs/tuning.md, "CPU tiles of a w in panels").
MC_PANELS = (48, 24, 12)


def tiling(level: str, dtype: str, m: exprs.Expr = 0, n: int = 0, panels: bool = False) -> tuple[int, int, int, int]:
    """(MR, NR, MC, NC) for a level, a dtype and an [m, n] output, w in `panels` or not (a
    symbolic m: MC_SYMBOLIC rows, for the small batches)."""
    mr, nr = MICRO[level, dtype]
    nc = NC_BYTES // np.dtype(dtype).itemsize
    column_tiles = max(1, -(-n // nc))
    if not isinstance(m, int):
        return mr, nr, MC_SYMBOLIC, nc
    choices = MC_PANELS if panels else MC_CHOICES
    mc = next((mc for mc in choices if -(-m // mc) * column_tiles >= WORK_ITEMS), choices[-1])
    return mr, nr, mc, nc


#: The fewest rows from which a cpu linear's run-time w is packed once per call (`packs_w`), by
#: dtype; None: never (each tile packs its own block). On the H200's host only f64 products of
#: 1024 rows and more gained; smaller ones and f32 were level or lost (docs/tuning.md, "CPU
#: linear with w known at run time").
PACK_ROWS: dict[str, int | None] = {"float32": None, "float64": 1024}


def packs_w(m: exprs.Expr, n: int, dtype: str) -> bool:
    """Whether a cpu linear of [m, n] whose w comes at run time has it packed in panels first, by a
    `pack_panels` kernel of its own (launched once per call, before the linear, which then reads
    the panels as it reads a constant's): a static product too tall to stream w, and w wider
    than a panel (narrower rows are contiguous already). A symbolic batch keeps each tile's own
    copy of w's block (`_pack`): the batch may be a few rows, whose product would pay for the
    pack more than it gains."""
    rows = PACK_ROWS.get(dtype)
    return (isinstance(m, int) and rows is not None and m >= rows and m > STREAM_ROWS
            and n > PANEL_BYTES // np.dtype(dtype).itemsize)


def pack_panels(args: Sequence[ir.Value], symbols: dict[str, ir.Value], request: Request) -> ht.Work:
    """panels[p, k, j] = w[k, p * L + j], zeros past N (the layout pack-weights gives a constant):
    the work items are the panels' blocks of KC k's, a panel's blocks in turn, each KC rows of
    L contiguous elements of w copied into one contiguous stretch of panels."""
    w, panels = args
    k_extent, n = ir.MemRefType(w.type).shape
    count, _, lanes = ir.MemRefType(panels.type).shape
    element, blocks = ir.MemRefType(w.type).element_type, -(-k_extent // KC)
    with ht.loop(0, count * blocks, "parallel") as item:
        panel = arith.DivUIOp(item, _i(blocks)).result
        k0 = arith.MulIOp(arith.RemUIOp(item, _i(blocks)).result, _i(KC)).result
        j0 = arith.MulIOp(panel, _i(lanes)).result

        def copy(width: int) -> None:
            with ht.loop(k0, _min(arith.AddIOp(k0, _i(KC)).result, _i(k_extent)), "serial") as k:
                row = vector.LoadOp(ir.VectorType.get([width], element), w, [k, j0]).result
                vector.StoreOp(row, panels, [panel, k, _i(0)])
                if width < lanes:
                    vector.StoreOp(_splat_zero(ir.VectorType.get([lanes - width], element)), panels,
                                   [panel, k, _i(width)])

        if n % lanes == 0:
            copy(lanes)
        else:  # the last panel holds n % L columns of w
            ht.choose(arith.CmpIOp(arith.CmpIPredicate.eq, panel, _i(count - 1)).result, lambda: copy(n % lanes),
                      lambda: copy(lanes))
    return ht.Work(count * blocks)


def _splat_zero(type_: ir.VectorType) -> ir.Value:
    return arith.ConstantOp(type_, ir.DenseElementsAttr.get_splat(
        type_, ir.FloatAttr.get(type_.element_type, 0.0))).result


def _min(a: ir.Value, b: ir.Value) -> ir.Value:
    return arith.MinUIOp(a, b).result


def _i(value: int | ir.Value) -> ir.Value:
    return ht.index(value)


def linear(args: Sequence[ir.Value], symbols: dict[str, ir.Value], request: Request) -> ht.Work:
    request = request.with_args(args)
    x, w, out = args[0], args[1], args[-1]
    bias = args[2] if request.bias else None
    m, k_extent, n = extent(x, 0, request), extent(x, 1, request), extent(out, 1, request)
    mr, nr, mc, nc = tiling(request.target.cpu, request.dtype, m, n, request.panels)
    nc = min(nc, -(-n // nr) * nr)
    if isinstance(m, int) and m <= STREAM_ROWS and not request.panels:
        return _stream((x, w, out, bias, request), m, k_extent, n, nr, nc)
    column_tiles = -(-n // nc)
    tiles = exprs.mul(exprs.ceildiv(m, mc), column_tiles)
    rows = ht.size_value(m, symbols)
    element = ir.MemRefType(out.type).element_type
    # w's block of the tile, KC rows x the tile's columns, copied panel by panel (NR columns, k
    # rows, contiguous): each call of the kernel (a thread's share) has its own, on its stack
    packed = ht.alloc_local([nc // nr + (nc % nr > 0), KC, nr], element) \
        if _packs(m, mc) and not request.panels else None
    xs = ht.alloc_local([mc, min(KC, k_extent) + X_PAD], element) if PACK_X.get(request.dtype) else None
    operands = (x, w, out, bias, request)
    row_tiles = ht.size_value(exprs.ceildiv(m, mc), symbols)
    with ht.loop(0, ht.size_value(tiles, symbols), "parallel") as tile:
        # tiles in column order: a thread's run of tiles mostly shares one column block of w,
        # which the caches then keep between its tiles
        r0 = arith.MulIOp(arith.RemUIOp(tile, row_tiles).result, _i(mc)).result
        c0 = arith.MulIOp(arith.DivUIOp(tile, row_tiles).result, _i(nc)).result
        r1 = _min(arith.AddIOp(r0, _i(mc)).result, rows)
        row_span = (r0, arith.DivUIOp(arith.SubIOp(r1, r0).result, _i(mr)).result, r1)
        last_width = n - (column_tiles - 1) * nc
        if last_width == nc:
            _tile(operands, packed, xs, c0, nc, row_span, k_extent, mr, nr)
        else:  # the last column tile is narrower: its own copy, so that every width is static
            ht.choose(arith.CmpIOp(arith.CmpIPredicate.eq, c0, _i(n - last_width)).result,
                      lambda: _tile(operands, packed, xs, c0, last_width, row_span, k_extent, mr, nr),
                      lambda: _tile(operands, packed, xs, c0, nc, row_span, k_extent, mr, nr))
    return ht.Work(tiles)


def _stream(operands, m: int, k_extent: int, n: int, nr: int, nc: int) -> ht.Work:
    """A product of few rows: each thread's chunk of the column tiles is one span of columns,
    walked in sub-blocks of `columns`, `ks` rows of w at a time (KS contiguous streams of w, each
    read once), x's k block from `xs` and the sums between k blocks in `held`, vectors of
    one register (`lanes`: half an NR panel) in slots: held[slot, row] is the sum of columns
    slot * lanes + [0, lanes) of the sub-block."""
    x, w, out, bias, request = operands
    element = ir.MemRefType(out.type).element_type
    few = m <= STREAM_FEW
    ks, ahead = (STREAM_FEW_KS, STREAM_FEW_AHEAD[request.dtype]) if few else (STREAM_KS, 0)
    columns = STREAM_COLUMNS  # few rows: as many as STREAM_FEW_BYTES of sums hold, in whole STREAM_COLUMNS
    if few:
        columns = max(columns, STREAM_FEW_BYTES // (max(m, 1) * np.dtype(request.dtype).itemsize) // columns * columns)
    lanes, k_blocks = nr // 2, -(-k_extent // ks)
    xs = ht.alloc_local([m, min(ks, k_extent)], element)
    held = ht.alloc_local([-(-min(columns, n) // lanes), m, lanes], element) if k_blocks > 1 else None
    with ht.loop(0, -(-n // nc), "parallel", "chunk") as first:
        c0 = arith.MulIOp(first, _i(nc)).result
        c1 = _min(arith.MulIOp(ht.chunk_end(), _i(nc)).result, _i(n))
        subs = arith.DivUIOp(arith.AddIOp(arith.SubIOp(c1, c0).result, _i(columns - 1)).result, _i(columns)).result
        with ht.loop(0, subs, "serial") as sub:
            s0 = arith.AddIOp(c0, arith.MulIOp(sub, _i(columns)).result).result
            s1 = _min(arith.AddIOp(s0, _i(columns)).result, c1)
            vectors = arith.DivUIOp(arith.SubIOp(s1, s0).result, _i(lanes)).result
            with ht.loop(0, k_blocks, "serial") as kb:
                block = _KBlock(kb, k_blocks, k_extent, ks)
                _copy_x(x, xs, block, m)

                def call(slot: ir.Value, widths: list[int], r0: int, rows: int) -> None:
                    j0 = arith.AddIOp(s0, arith.MulIOp(slot, _i(lanes)).result).result
                    pieces = [(arith.AddIOp(j0, _i(v * lanes)).result if v else j0,
                               arith.AddIOp(slot, _i(v)).result if v else slot, width)
                              for v, width in enumerate(widths)]
                    _micro(operands, None, block, _i(r0), pieces, rows, UNROLL,
                           (xs, held, _fetch(w, pieces, ahead)))

                for r0, rows, per_call in _stream_groups(m, request.target.cpu, nc // lanes) if n >= lanes else []:
                    whole = arith.DivUIOp(vectors, _i(per_call)).result
                    with ht.loop(0, whole, "serial") as c:
                        call(arith.MulIOp(c, _i(per_call)).result, [lanes] * per_call, r0, rows)
                    if per_call > 1:  # the vectors left, one a call
                        with ht.loop(arith.MulIOp(whole, _i(per_call)).result, vectors, "serial") as slot:
                            call(slot, [lanes], r0, rows)
                if n % lanes:  # the narrow last vector, in the sub-block that ends at n
                    with ht.when(arith.CmpIOp(arith.CmpIPredicate.eq, s1, _i(n)).result):
                        for r0, rows, _ in _stream_groups(m, request.target.cpu, 1):
                            call(vectors, [n % lanes], r0, rows)
    return ht.Work(-(-n // nc), spans=True)  # a thread's chunk is its span: one chunk a thread


def _fetch(w: ir.Value, pieces: list, rows_ahead: int) -> Callable[[ir.Value], None]:
    """A streamed call's prefetch of w at each k: the row `rows_ahead` ahead of each of its
    vectors (an L2 hint), or (none) the line STREAM_AHEAD calls of its width ahead of its first."""
    k_extent, n = ir.MemRefType(w.type).shape
    if rows_ahead:
        def fetch(k: ir.Value) -> None:
            row = _min(arith.AddIOp(k, _i(rows_ahead)).result, _i(k_extent - 1))
            for j0, *_ in pieces:
                memref.prefetch(w, [row, j0], False, 2, True)
        return fetch
    ahead = _min(arith.AddIOp(pieces[0][0], _i(STREAM_AHEAD * sum(width for *_, width in pieces))).result, _i(n - 1))
    return lambda k: memref.prefetch(w, [k, ahead], False, 3, True)


def _stream_groups(m: int, level: str, most: int) -> list[tuple[int, int, int]]:
    """A streamed product's groups of rows (first, rows, vectors a call): as many rows a group as
    STREAM_SUMS allows, and the vectors a call a power of two (at most `most`: a tile's) that keeps
    rows x vectors within it."""
    sums = STREAM_SUMS.get(level, 12)
    group = min(m, sums) or 1  # (no rows: no groups)
    return [(r0, min(group, m - r0), min(most, 1 << ((sums // min(group, m - r0)).bit_length() - 1)))
            for r0 in range(0, m, group)]


def _copy_x(x: ir.Value, xs: ir.Value, block, m: int) -> None:
    """xs[r, 0:k1-k0] = x[r, k0:k1], r < m: a vector a row for a whole block, else element by
    element (only the loops that K's blocks need)."""
    ks, k_extent = ir.MemRefType(xs.type).shape[1], ir.MemRefType(x.type).shape[1]

    def whole() -> None:
        row = ir.VectorType.get([ks], ir.MemRefType(x.type).element_type)
        for r in range(m):
            vector.StoreOp(vector.LoadOp(row, x, [_i(r), block.k0]).result, xs, [_i(r), _i(0)])

    def part() -> None:
        with ht.loop(block.k0, block.k1, "serial") as k:
            for r in range(m):
                ht.store(ht.load(x, [_i(r), k]), xs, [_i(r), arith.SubIOp(k, block.k0).result])

    if k_extent % ks == 0:  # (xs is K wide where K is less than a block)
        return whole()
    ht.choose(arith.CmpIOp(arith.CmpIPredicate.eq, arith.SubIOp(block.k1, block.k0).result, _i(ks)).result, whole,
              part)


def _packs(m: exprs.Expr, mc: int) -> bool:
    """Whether the kernel packs w: unless every tile has too few rows for the copy to pay."""
    return not isinstance(m, int) or (m >= PACK_FROM_ROWS and mc >= PACK_FROM_ROWS)


def _tile(operands, packed, xs, c0, width, row_span, k_extent, mr, nr) -> None:
    """One work item: rows [r0, r1) x `width` columns from c0. Groups of MR rows take one NR
    panel at a time; the rows left over take all the tile's columns at once (a 1-row product
    streams w's rows). A tile of enough rows first packs w's block (`packed`) and reads it from
    there: contiguous panels, which the caches and the TLB hold where w's own rows, N apart,
    are each on another page. With `xs`, the tile's x block is copied there first (`_copy_rows`)
    and read from there."""
    r0, full_groups, r1 = row_span
    rows_of_x = (xs, r0) if xs is not None else None
    rest = arith.AddIOp(r0, arith.MulIOp(full_groups, _i(mr)).result).result
    pieces = [(p * nr, nr) for p in range(width // nr)] + ([(width - width % nr, width % nr)] if width % nr else [])
    # the full panels in a loop; the narrower one with the last full panel where their sums fit in
    # the registers (one broadcast of x for both), else alone
    looped = width // nr - _merges_edge(operands[4], mr, nr, width)
    k_blocks = -(-k_extent // KC)
    with ht.loop(0, k_blocks, "serial") as kb:
        block = _KBlock(kb, k_blocks, k_extent)

        def body(source) -> None:
            for together in ([None] if looped else []) + ([pieces[looped:]] if pieces[looped:] else []):
                with ht.loop(0, looped if together is None else 1, "serial") as panel:
                    spans = [(arith.AddIOp(c0, arith.MulIOp(panel, _i(nr)).result).result, panel, nr)] \
                        if together is None else [(arith.AddIOp(c0, _i(start)).result, _i(start // nr), size)
                                                  for start, size in together]
                    with ht.loop(0, full_groups, "serial") as group:
                        i0 = arith.AddIOp(r0, arith.MulIOp(group, _i(mr)).result).result
                        _micro(operands, source, block, i0, spans, mr, UNROLL, x_block=rows_of_x)
            with ht.loop(rest, r1, "serial") as i:
                _micro(operands, source, block, i,
                       [(arith.AddIOp(c0, _i(start)).result, _i(start // nr), size) for start, size in pieces], 1,
                       UNROLL, x_block=rows_of_x)

        if xs is not None:
            _copy_rows(operands[0], xs, block, r0, r1, k_extent)
        if packed is None:
            body(None)
        else:
            def packing() -> None:
                _pack(operands[1], packed, block, c0, pieces)
                body(packed)
            many = arith.CmpIOp(arith.CmpIPredicate.uge, arith.SubIOp(r1, r0).result, _i(PACK_FROM_ROWS)).result
            ht.choose(many, packing, lambda: body(None))


#: Vector registers by x86-64 level (AVX-512: 32, else 16), of which the micro-kernel leaves
#: EDGE_SPARE to w's vectors and the broadcast of x.
REGISTERS, EDGE_SPARE = {"x86-64-v4": 32}, 4


def _merges_edge(request: Request, mr: int, nr: int, width: int) -> bool:
    """Whether a tile's narrow last panel (width % NR columns) runs with the last full one: MR
    rows of both panels' sums must fit in the registers (an NR panel is two vectors; LLVM splits
    a narrower one into vectors of powers of two lanes: 15 = 8 + 4 + 2 + 1). Apart, the narrow
    panel costs a broadcast of x per row and k for its few lanes: on a 2-core AVX-512 machine
    4096x1024x33 apart/together, three passes, f32 2.32-2.40/2.15-2.18 ms, f64 3.76-4.22/3.63-4.09
    (numpy: 2.5-3.0, 5.8-6.1); 4096x1024x47 f64 together, 36 registers of sums, spilled: 16% slower."""
    rest = width % nr
    if not rest or width < nr:
        return False
    lanes = nr // 2
    vectors = 2 + rest // lanes + bin(rest % lanes).count("1")
    return mr * vectors <= REGISTERS.get(request.target.cpu, 16) - EDGE_SPARE


def _copy_rows(x: ir.Value, xs: ir.Value, block, r0: ir.Value, r1: ir.Value, k_extent: int) -> None:
    """xs[i - r0, 0:k1-k0] = x[i, k0:k1] for the tile's rows i: a vector a row (a whole block, or
    K's last, narrower one)."""
    element, rest = ir.MemRefType(x.type).element_type, k_extent % KC

    def copy(width: int) -> None:
        with ht.loop(r0, r1, "serial") as i:
            row = vector.LoadOp(ir.VectorType.get([width], element), x, [i, block.k0]).result
            vector.StoreOp(row, xs, [arith.SubIOp(i, r0).result, _i(0)])

    if k_extent <= KC or not rest:
        return copy(min(KC, k_extent))
    ht.choose(arith.CmpIOp(arith.CmpIPredicate.eq, arith.SubIOp(block.k1, block.k0).result, _i(KC)).result,
              lambda: copy(KC), lambda: copy(rest))


def _pack(w: ir.Value, packed: ir.Value, block, c0: ir.Value, pieces: list[tuple[int, int]]) -> None:
    """packed[p, k - k0, :width] = w[k, c0 + p * NR : + width] for the k block, each panel p."""
    element = ir.MemRefType(w.type).element_type
    for p, (start, width) in enumerate(pieces):
        type_ = ir.VectorType.get([width], element)
        with ht.loop(block.k0, block.k1, "serial") as k:
            row = vector.LoadOp(type_, w, [k, arith.AddIOp(c0, _i(start)).result]).result
            vector.StoreOp(row, packed, [_i(p), arith.SubIOp(k, block.k0).result, _i(0)])


class _KBlock:
    """The k block being computed: its range, and whether it is the first or the last."""

    def __init__(self, kb: ir.Value, count: int, k_extent: int, size: int = 0):
        size = size or KC
        self.k0 = arith.MulIOp(kb, _i(size)).result
        self.k1 = _min(arith.AddIOp(self.k0, _i(size)).result, _i(k_extent))
        self.first = arith.CmpIOp(arith.CmpIPredicate.eq, kb, _i(0)).result if count > 1 else None
        self.last = arith.CmpIOp(arith.CmpIPredicate.eq, kb, _i(count - 1)).result if count > 1 else None


def _micro(operands, packed, block: _KBlock, i0: ir.Value, pieces: list[tuple[ir.Value, ir.Value, int]],
           rows: int, unroll: int = 1, stream: tuple | None = None, x_block: tuple | None = None) -> None:
    """out[i0:i0+rows, piece] (+)= x[i0:i0+rows, k block] @ w[k block, piece] for each column
    piece (j0, panel, width), w read from `packed` (its panel) when given: rows x pieces
    vectors of sums, loop-carried through k (registers), `unroll` k's a trip then one by one.
    A streamed product's `stream` is (xs, held, fetch): x's block is xs, the sums between blocks
    wait in held[panel, row] (`panel` is the piece's slot), and fetch(k) prefetches w. A tile's
    `x_block` is (xs, r0): x[i, k] read at xs[i - r0, k - k0]."""
    x, w, out, bias, request = operands
    element = ir.MemRefType(out.type).element_type
    types = [ir.VectorType.get([width], element) for *_, width in pieces]
    row_index = [arith.AddIOp(i0, _i(r)).result if r else i0 for r in range(rows)]
    slots = [(i, j0, type_) for i in row_index for (j0, *_), type_ in zip(pieces, types, strict=True)]
    xs, held, fetch = stream or (None, None, None)
    between = [(held, [slot, i, _i(0)]) for i in row_index for _, slot, _ in pieces] if stream else \
        [(out, [i, j0]) for i, j0, _ in slots]

    def start() -> list[ir.Value]:
        first = [vector.LoadOp(t, bias, [j0]).result if bias is not None else _splat_zero(t)
                 for (j0, *_), t in zip(pieces, types, strict=True)]
        return first * rows

    def running() -> list[ir.Value]:
        return [vector.LoadOp(t, buffer, at).result for (buffer, at), (*_, t) in zip(between, slots, strict=True)]

    rows_of_w = [_w_at(w, j0, request) for j0, *_ in pieces] if packed is None else []
    x_rows = [arith.SubIOp(i, x_block[1]).result for i in row_index] if x_block is not None else []

    def step(k: ir.Value, sums: list[ir.Value]) -> list[ir.Value]:  # one k: rows x pieces FMAs
        if packed is None:
            b = [vector.LoadOp(t, w, at(k)).result for at, t in zip(rows_of_w, types, strict=True)]
        else:
            kk = arith.SubIOp(k, block.k0).result
            b = [vector.LoadOp(t, packed, [panel, kk, _i(0)]).result for (_, panel, _), t in zip(pieces, types,
                                                                                                 strict=True)]
        if stream:
            fetch(k)
            kk = arith.SubIOp(k, block.k0).result
            a = {i: ht.load(xs, [i, kk]) for i in row_index}
        elif x_block is not None:
            kk = arith.SubIOp(k, block.k0).result
            a = {i: ht.load(x_block[0], [at, kk]) for i, at in zip(row_index, x_rows, strict=True)}
        else:
            a = {i: ht.load(x, [i, k]) for i in row_index}
        return [vector.FMAOp(vector.BroadcastOp(t, a[i]).result, b[p % len(pieces)], acc).result
                for p, ((i, _, t), acc) in enumerate(zip(slots, sums, strict=True))]

    sums, k0 = _choose(block.first, start, running, [t for *_, t in slots]), block.k0
    if unroll > 1:
        whole = arith.MulIOp(arith.DivUIOp(arith.SubIOp(block.k1, k0).result, _i(unroll)).result, _i(unroll)).result
        middle = arith.AddIOp(k0, whole).result

        def steps(k: ir.Value, values: list[ir.Value]) -> list[ir.Value]:  # `unroll` k's a trip
            for u in range(unroll):
                values = step(arith.AddIOp(k, _i(u)).result if u else k, values)
            return values
        sums, k0 = ht.fold(k0, middle, _i(unroll), sums, steps), middle
    results = ht.fold(k0, block.k1, _i(1), sums, step)  # the sums are loop-carried: registers

    def finished() -> list[ir.Value]:
        return [request.epilogue(v, [i, j0]) for v, (i, j0, _) in zip(results, slots, strict=True)]

    def store(targets, values) -> None:
        for (buffer, at), value in zip(targets, values, strict=True):
            vector.StoreOp(value, buffer, at)

    if not stream or block.last is None:  # out, or (between blocks) the sums as they are
        store([(out, [i, j0]) for i, j0, _ in slots],
              _choose(block.last, finished, lambda: results, [t for *_, t in slots]))
        return
    # out at the last block, else the sums held
    ht.choose(block.last, lambda: store([(out, [i, j0]) for i, j0, _ in slots], finished()),
              lambda: store(between, results))


def _w_at(w: ir.Value, j0: ir.Value, request: Request) -> Callable[[ir.Value], list[ir.Value]]:
    """Where w[k, j0:] starts, as a function of k: [k, j0] in w's rows, or [panel, k, lane] in the
    panel holding column j0 (its panel and lane computed here, once, outside the k loops)."""
    if not request.panels:
        return lambda k: [k, j0]
    lanes = _i(ir.MemRefType(w.type).shape[2])
    panel, lane = arith.DivUIOp(j0, lanes).result, arith.RemUIOp(j0, lanes).result
    return lambda k: [panel, k, lane]


def _choose(condition, then, otherwise, types):
    """then() when `condition` holds (None: always), else otherwise(), as values."""
    return then() if condition is None else ht.choose(condition, then, otherwise, types)

