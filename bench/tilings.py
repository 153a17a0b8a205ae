"""Experiment: the GPU linear's tiling, measured (how gpu_schedule.linear_tiling was chosen).

    PYTHONPATH=runtime:. python bench/tilings.py bench/variants                   # here: build
    PYTHONPATH=runtime python bench/linear.py run bench/variants --device cuda    # on the GPU

Builds the same products with each (tile, k step, sums per thread axis) in turn, by
overriding the schedule's choice for the duration of the build.
"""

import json
import sys
from pathlib import Path

import hexir
from hexir.schedules import cuda as gpu_schedule

TILINGS = [(64, 16, 4), (128, 8, 8), (128, 16, 8), (64, 8, 4)]
SIZES = [(1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096)]


def linear(x, w):
    return hexir.linear(x, w)


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    chosen = gpu_schedule.linear_tiling
    try:
        for tiling in TILINGS:
            gpu_schedule.linear_tiling = lambda m, n, tiling=tiling: tiling
            tile, step, per = tiling
            for m, k, n in SIZES:
                for dtype in ("float32", "float64"):
                    name = f"linear_{m}x{k}x{n}_{dtype}_cuda_t{tile}s{step}p{per}"
                    hexir.export(linear, out / f"{name}.hxb", hexir.TensorSpec((m, k), dtype),
                                 hexir.TensorSpec((k, n), dtype), placement={"hexir.linear": "cuda"})
                    rows.append({"name": name, "m": m, "k": k, "n": n, "dtype": dtype, "device": "cuda"})
    finally:
        gpu_schedule.linear_tiling = chosen
    (out / "modules.json").write_text(json.dumps(rows, indent=1))
    print(f"built {len(rows)} modules in {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
