"""Experiment: the GPU linear's tilings, measured (how schedules/cuda.py's TILINGS and
DMMA_TILINGS were chosen).

    PYTHONPATH=runtime:. python bench/tilings.py bench/variants                   # here: build
    PYTHONPATH=runtime python bench/linear.py run bench/variants --device cuda    # on the GPU
    PYTHONPATH=runtime:. python bench/tilings.py bench/loads --dmma               # the FP64 fragment loads only

Builds the same products with each (tile, k step, sums per thread axis) in turn, by
overriding the schedule's choice for the duration of the build.
"""

import json
import os
import sys
from pathlib import Path

os.environ["HEXIR_CACHE_DIR"] = ""  # the variants differ only in a patched table: never reuse a cached module

import hexir
from hexir.schedules import cuda as gpu_schedule

TILINGS = [(16, 16, 1), (32, 16, 2), (64, 16, 4), (64, 8, 4), (128, 16, 8), (128, 8, 8)]
#: (M, K, N, symbolic): the sizes where the choice between tilings is close.
SIZES = [(512, 512, 512, False), (1024, 1024, 1024, False), (2048, 2048, 2048, False), (4096, 1024, 33, False),
         (256, 1024, 1024, True), (4096, 1024, 1024, True), (64, 1024, 1024, True), (1024, 4096, 4096, True),
         (1024, 2048, 2048, False), (64, 784, 512, False)]


def linear(x, w):
    return hexir.linear(x, w)


#: The FP64 tensor-core kernel's tilings (block rows, block columns, k slice, warps along rows, along columns).
DMMA_TILINGS = [(64, 64, 16, 2, 2, 1), (64, 64, 8, 2, 2, 1), (128, 64, 8, 2, 2, 1), (64, 128, 8, 2, 2, 1),
                (128, 128, 8, 4, 2, 1), (128, 128, 8, 2, 4, 1), (64, 32, 16, 2, 2, 1), (32, 64, 16, 2, 2, 1),
                (32, 32, 16, 2, 2, 1)]
DMMA_SIZES = [(1024, 1024, 1024, False), (2048, 2048, 2048, False), (4096, 4096, 4096, False),
              (4096, 1024, 1024, True), (64, 1024, 1024, False), (256, 1024, 1024, False), (512, 512, 512, False),
              (4096, 1024, 33, False)]
#: The rows kernel's loads of w in flight per block (ROWS_IN_FLIGHT and _WIDE_ both), by rows and dtype (float64
#: at 16 rows and 256 would need 64 KiB of shared memory: not built).
IN_FLIGHT = [(128, 1), (128, 8), (128, 16), (256, 1), (256, 8), (256, 16)]


#: The FP64 kernel's fragment loads (one k a thread, or two in one load), its stages and bigger
#: tiles, at the sizes of the issue's f64 rows (`--dmma`; runs 48-49): (name, k's a load, stages,
#: tiling or None: the table's, with that many k's a load); the first two at every size of
#: DMMA_LOAD_SIZES, the others at the first four.
DMMA_LOADS = [("single", 1, 3, None), ("paired", 2, 3, None),
              ("s128x128w4x2", 1, 3, (128, 128, 16, 4, 2)), ("p128x128w4x2", 2, 3, (128, 128, 16, 4, 2)),
              ("s128x128w4x2st4", 1, 4, (128, 128, 16, 4, 2)), ("p128x128w4x2st4", 2, 4, (128, 128, 16, 4, 2)),
              ("p128x128w4x2k32", 2, 3, (128, 128, 32, 4, 2))]
DMMA_LOAD_SIZES = [(2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192), (1024, 1024, 1024),
                   (2048, 2046, 2050), (512, 512, 512), (64, 784, 512), (256, 1024, 1024), (4096, 1024, 33)]


def dmma_loads(out: Path) -> list[dict]:
    rows = []
    chosen, stages = gpu_schedule.dmma_tiling, gpu_schedule.DMMA_STAGES
    try:
        for index, (variant, pairs, gpu_schedule.DMMA_STAGES, tiling) in enumerate(DMMA_LOADS):
            gpu_schedule.dmma_tiling = lambda m, n, k, *archs, tiling=tiling, pairs=pairs: (
                tiling or chosen(m, n, k, *archs)[:5]) + (pairs,)
            for m, k, n in DMMA_LOAD_SIZES if index < 2 else DMMA_LOAD_SIZES[:4]:
                name = f"linear_{m}x{k}x{n}_float64_cuda_{variant}"
                hexir.export(linear, out / f"{name}.hxb", hexir.TensorSpec((m, k), "float64"),
                             hexir.TensorSpec((k, n), "float64"), placement={"hexir.linear": "cuda"})
                rows.append({"name": name, "m": m, "k": k, "n": n, "dtype": "float64", "device": "cuda",
                             "variant": variant})
    finally:
        gpu_schedule.dmma_tiling, gpu_schedule.DMMA_STAGES = chosen, stages
    return rows


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if "--dmma" in sys.argv:
        rows = dmma_loads(out)
        (out / "modules.json").write_text(json.dumps(rows, indent=1))
        print(f"built {len(rows)} modules in {out}")
        return
    rows = []
    chosen_dmma = gpu_schedule.dmma_tiling
    try:
        for tiling in DMMA_TILINGS:
            gpu_schedule.dmma_tiling = lambda m, n, k, *archs, tiling=tiling: tiling
            for m, k, n, symbolic in DMMA_SIZES:
                label = "x".join(map(str, tiling[:5]))
                name = f"linear_{m}x{k}x{n}_float64_cuda_dmma{label}{'_sym' if symbolic else ''}"
                hexir.export(linear, out / f"{name}.hxb", hexir.TensorSpec(("batch" if symbolic else m, k), "float64"),
                             hexir.TensorSpec((k, n), "float64"), placement={"hexir.linear": "cuda"})
                rows.append({"name": name, "m": m, "k": k, "n": n, "dtype": "float64", "device": "cuda",
                             "symbolic": symbolic, "variant": "d{}x{}s{}w{}x{}".format(*tiling[:5])})
    finally:
        gpu_schedule.dmma_tiling = chosen_dmma
    rows_max = gpu_schedule.ROWS_MAX
    try:
        for limit in (32, 0):  # the row-streaming kernel, then the tiled one, for few rows
            gpu_schedule.ROWS_MAX = limit
            for m in (1, 4, 8, 16, 32):
                # (32 rows of float64 on the rows kernel would need 64 KiB of shared memory: not built)
                for dtype in ("float32", "float64") if (m, limit) != (32, 32) else ("float32",):
                    name = f"linear_{m}x4096x4096_{dtype}_cuda_{'rows' if limit else 'tiled'}"
                    hexir.export(linear, out / f"{name}.hxb", hexir.TensorSpec((m, 4096), dtype),
                                 hexir.TensorSpec((4096, 4096), dtype), placement={"hexir.linear": "cuda"})
                    rows.append({"name": name, "m": m, "k": 4096, "n": 4096, "dtype": dtype, "device": "cuda",
                                 "variant": "rows" if limit else "tiled"})
    finally:
        gpu_schedule.ROWS_MAX = rows_max
    in_flight = gpu_schedule.ROWS_IN_FLIGHT, gpu_schedule.ROWS_WIDE_IN_FLIGHT
    try:
        for flight, m in IN_FLIGHT:
            gpu_schedule.ROWS_IN_FLIGHT = gpu_schedule.ROWS_WIDE_IN_FLIGHT = flight
            for dtype in ("float32", "float64") if (flight, m) != (256, 16) else ("float32",):
                name = f"linear_{m}x4096x4096_{dtype}_cuda_rows{flight}"
                hexir.export(linear, out / f"{name}.hxb", hexir.TensorSpec((m, 4096), dtype),
                             hexir.TensorSpec((4096, 4096), dtype), placement={"hexir.linear": "cuda"})
                rows.append({"name": name, "m": m, "k": 4096, "n": 4096, "dtype": dtype, "device": "cuda",
                             "variant": f"rows, {flight} in flight"})
    finally:
        gpu_schedule.ROWS_IN_FLIGHT, gpu_schedule.ROWS_WIDE_IN_FLIGHT = in_flight
    chosen = gpu_schedule.linear_tiling
    try:
        for tiling in TILINGS:
            gpu_schedule.linear_tiling = lambda m, n, *_, tiling=tiling: tiling
            tile, step, per = tiling
            for m, k, n, symbolic in SIZES:
                for dtype in ("float32",):  # float64 runs on the tensor cores (schedules/cuda.py dmma)
                    name = f"linear_{m}x{k}x{n}_{dtype}_cuda_t{tile}s{step}p{per}{'_sym' if symbolic else ''}"
                    hexir.export(linear, out / f"{name}.hxb", hexir.TensorSpec(("batch" if symbolic else m, k), dtype),
                                 hexir.TensorSpec((k, n), dtype), placement={"hexir.linear": "cuda"})
                    rows.append({"name": name, "m": m, "k": k, "n": n, "dtype": dtype, "device": "cuda",
                                 "symbolic": symbolic, "variant": f"t{tile}s{step}"})
    finally:
        gpu_schedule.linear_tiling = chosen
    (out / "modules.json").write_text(json.dumps(rows, indent=1))
    print(f"built {len(rows)} modules in {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
