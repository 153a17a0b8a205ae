"""The cuda linear's tile tables and the choices made from them: the SIMT kernel's tilings
(`linear_tiling`), the FP64 tensor-core kernel's (`dmma_table`, `dmma_tiling`, `uses_dmma`),
split-K (`split_k`) and, for a symbolic batch, the variants tried per call (`linear_variants`).
Each table says why it is as it is; what was measured to choose it is in docs/tuning.md. The
kernels that use them are in cuda.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from hexir_runtime.format import exprs
from mlir import ir

from hexir.schedules import Request, extent
from hexir.target import MAX_SHARED_BYTES, arch_number

#: The SIMT linear's tilings, (out tile per block, k slice per step, sums per thread axis), with
#: the fewest blocks (times split-K's parts: `split_k`) each must give the GPU (132 SMs on an
#: H100/H200) to be chosen: the first that fills the GPU wins. Bigger tiles do more work per
#: shared-memory load but leave SMs idle on small outputs; 16x16 tiles keep a product of a few
#: dozen rows from running on a few dozen blocks (docs/tuning.md, "CUDA SIMT tilings" and "CUDA
#: split-K").
TILINGS = (((128, 16, 8), 128), ((64, 16, 4), 256), ((32, 16, 2), 128), ((16, 16, 1), 0))
LARGE_TILING = TILINGS[0][0]


def linear_tiling(m: exprs.Expr, n: int, k: int = 0, element_bytes: int = 4) -> tuple[int, int, int]:
    """The tiling of an [m, n] output (of a product over k): the first of TILINGS that gives
    enough blocks, K's splits counted (a symbolic m: the largest; `linear_variants` adds the
    smaller ones, for the batches they fill the GPU at)."""
    if not isinstance(m, int):
        return LARGE_TILING
    for (tile, step, per), fewest in TILINGS:
        blocks = -(-m // tile) * -(-n // tile)
        if blocks * split_k(blocks, k, step, tile * tile * element_bytes) >= fewest:
            return tile, step, per
    return TILINGS[-1][0]


def linear_variants(types: list[ir.Type], request: Request) -> list[tuple[str, dict[str, int]]]:
    """With a symbolic batch, a kernel per tile of TILINGS (SIMT) or DMMA_TILINGS (FP64 tensor
    cores): the smaller tiles run the batches too small for the larger ones to give the GPU
    enough blocks (what the static choice does at compile time, done per call)."""
    m, n = extent(0, 0, request), extent(len(types) - 1, 1, request)
    if request.dtype in ("bfloat16", "float16") or request.w_kmajor:  # (the tensor-core kernels' one tiling
        return arch_variants(request)  # serves every batch)
    if isinstance(m, int) or request.precision == "tf32":
        return []
    m = exprs.to_text(m)  # a symbol, or the product of x's leading ones (`mul(batch, seq)`)
    # the batch from which each tiling but the last gives enough blocks: it runs below the next one's
    if uses_dmma(request):  # the same for the FP64 tensor-core kernel's tiles
        table = dmma_table(extent(0, 1, request), n, request.target.cuda_archs)
        starts = [tiling[0] * -(-fewest // -(-n // tiling[1])) for tiling, fewest in table[:-1]]
        return [(dmma_name(table[i][0]), {m: starts[i - 1]}) for i in range(len(table) - 1, 0, -1)]
    starts = [tile * -(-fewest // -(-n // tile)) for (tile, _, _), fewest in TILINGS[:-1]]
    return [(f"t{TILINGS[i][0][0]}", {m: starts[i - 1]}) for i in range(len(TILINGS) - 1, 0, -1)]


def arch_variants(request: Request) -> list[tuple[str, dict[str, int]]]:
    """A 16-bit linear for targets of which some are sm_XYa and some are not: the "a"
    architectures' own kernel (wgmma on sm_90a) as a variant run where their image is loaded
    (named `wgmma_sm_90a`: `variant_arch` reads the architecture back), if it differs."""
    from hexir.schedules.cuda_wgmma import uses_wgmma  # (it imports the cuda schedules, which import this)

    archs = request.target.cuda_archs
    if all(a.endswith("a") for a in archs):
        return []
    k, n = extent(0, 1, request), extent(1, 0 if request.w_kmajor else 1, request)
    return [(f"wgmma_{a}", {}) for a in archs if a.endswith("a")
            and uses_wgmma(replace(request, target=replace(request.target, cuda_archs=(a,))), k, n)]


def variant_arch(variant: str | None) -> str | None:
    """The architecture an `arch_variants` variant is for, or None."""
    return variant.removeprefix("wgmma_") if variant and variant.startswith("wgmma_") else None


def dmma_name(tiling: tuple[int, ...]) -> str:
    return f"dmma{tiling[0]}x{tiling[1]}"


def uses_dmma(request: Request) -> bool:
    return request.dtype == "float64" and all(arch_number(a) >= DMMA_FROM for a in request.target.cuda_archs)


#: The FP64 tensor-core kernel's tilings, (block rows, block columns, k slice, warps along
#: rows, warps along columns, k's a thread's x fragment load takes: 1, or 2 in one 16-byte load),
#: with the fewest blocks each must give the GPU to be chosen: the biggest tile that still fills
#: the GPU was the fastest, and 4x2 warps with paired loads on 128x128 beat 128x64 from 4096^3
#: (docs/tuning.md, "CUDA DMMA tilings"). Tiles as wide as DMMA_EVEN_WIDTH are for 16-byte copies
#: (K and N even) only: with 8-byte ones 128x64 keeps its register pipeline. A tiling
#: whose buffers need more shared memory than a target's block may have is not used.
DMMA_TILINGS = (((128, 128, 16, 4, 2, 2), 512), ((128, 64, 16, 2, 2, 1), 264), ((64, 64, 16, 2, 2, 1), 256),
                ((64, 32, 16, 2, 2, 1), 128), ((32, 32, 16, 2, 2, 1), 0))
DMMA_EVEN_WIDTH = 128


def dmma_table(k: int, n: int, archs: Sequence[str]) -> tuple[tuple[tuple[int, ...], int], ...]:
    """The DMMA tilings a product with K = k, N = n may use on every one of `archs`."""
    room = min(MAX_SHARED_BYTES[arch] for arch in archs)
    return tuple((tiling, fewest) for tiling, fewest in DMMA_TILINGS
                 if (copy_run(k, n) > 1 or tiling[1] < DMMA_EVEN_WIDTH)
                 and 8 * sum(map(math.prod, dmma_tiles(tiling, DMMA_STAGES))) <= room)


def copy_run(k: int, n: int) -> int:
    """Elements a cp.async copy of the DMMA kernel's slices takes: DMMA_RUN (16 bytes) where K and N
    are even (every row then starts 16-byte aligned), else one."""
    return DMMA_RUN if k % DMMA_RUN == 0 and n % DMMA_RUN == 0 else 1


def dmma_tiles(tiling: tuple[int, ...], buffers: int) -> tuple[list[int], list[int]]:
    """The shapes of the DMMA kernel's x and w slice buffers, rows padded against bank conflicts
    in the warps' fragment loads (DMMA_PAD, by the fragment loads' mode)."""
    tile_m, tile_n, step, *_, pairs = tiling
    pad = DMMA_PAD[pairs == 2]
    return [buffers, tile_m, step + pad[0]], [buffers, step, tile_n + pad[1]]


def dmma_tiling(m: exprs.Expr, n: int, k: int, archs: Sequence[str] = ("sm_90",)) -> tuple[int, ...]:
    """The DMMA tiling of an [m, n] output over K = k: the first of its `dmma_table` that gives
    enough blocks (a symbolic m: the largest; `linear_variants` adds the smaller ones)."""
    table = dmma_table(k, n, archs)
    for tiling, fewest in table:
        if not isinstance(m, int) or -(-m // tiling[0]) * -(-n // tiling[1]) >= fewest:
            return tiling
    return table[-1][0]


#: Whether the DMMA kernel's blocks inside the matrices load their slices without a test per
#: element, and the SIMT tiles whose blocks do: only 32x32 SIMT tiles gained (docs/tuning.md,
#: "CUDA loads without a test per element").
DMMA_WHOLE, SIMT_WHOLE_TILES = True, (32,)
#: Shared buffers of the DMMA kernel's slices filled by asynchronous copies (cp.async,
#: `_pipeline_async`), DMMA_RUN elements (16 bytes) a copy where K and N are even (every row then
#: starts 16-byte aligned), else one; with one-element copies DMMA_REGISTER_TILE keeps two buffers
#: filled through registers (`_pipeline`): 3 stages of 16-byte copies beat registers, and 2 or 4
#: stages (docs/tuning.md, "CUDA DMMA pipeline").
DMMA_STAGES, DMMA_RUN, DMMA_REGISTER_TILE = 3, 2, (128, 64)
#: Padding of the x and w tiles' rows (f64 elements) against shared-memory bank conflicts, for
#: fragment loads of one k a thread, and of two (x's in one 16-byte load, DMMA_TILINGS). One k:
#: a half warp's 16 8-byte loads, x's from 4 rows (group) 8 banks apart, w's from 4 rows
#: (in_group) 24 banks apart, each 4 columns, fall on 32 distinct banks. Two: x's rows are 16
#: banks apart (a quarter warp's 8 loads, 2 rows x 4 pairs, on 32 banks) and w's row 2 in_group 8
#: banks on from row 0 (a half warp's 16 loads, 4 rows x 4 columns, on 32). w's one-k padding
#: is 12, not 8 (whose rows 0 and 2 shared banks) or 4 (docs/tuning.md, "CUDA DMMA padding").
DMMA_PAD = ((4, 12), (8, 2))
#: DMMA (mma.sync m8n8k4 f64) exists from sm_80 on.
DMMA_FROM = 80
#: Split-K: a (static) product over SPLIT_MIN_K or more k's whose tiles give the GPU fewer than
#: SPLIT_FILL blocks splits K over up to SPLIT_MAX blocks per tile (as many as bring it to
#: SPLIT_FILL), each walking at least SPLIT_MIN_STEPS slices, while the partial sums that a tile's
#: last block adds up stay within SPLIT_BYTES (`_reduce_splits`). The FP64 tensor-core kernel's
#: blocks do more per slice: it splits only to reach DMMA_SPLIT's fill, over its K. The rule
#: comes close to the best split per shape (docs/tuning.md, "CUDA split-K").
SPLIT_FILL, SPLIT_MIN_K, SPLIT_MAX, SPLIT_MIN_STEPS, SPLIT_BYTES = 256, 256, 8, 4, 64 << 10
DMMA_SPLIT = (128, 512)  # (fill, min K)


def split_k(blocks: int, k: int, step: int, tile_bytes: int, fill: int = SPLIT_FILL, min_k: int = SPLIT_MIN_K) -> int:
    """How many blocks share each tile's K (1: no split), for a grid of `blocks` tiles."""
    if blocks >= fill or k < min_k:
        return 1
    splits = min(-(-fill // blocks), SPLIT_MAX, k // (SPLIT_MIN_STEPS * step), SPLIT_BYTES // tile_bytes)
    if splits <= 1:
        return 1
    return -(-k // split_length(k, splits, step))


def split_length(k: int, splits: int, step: int) -> int:
    """The k's of each of K's `splits` parts: whole slices of `step` (the last part may be shorter)."""
    return -(-k // splits // step) * step
