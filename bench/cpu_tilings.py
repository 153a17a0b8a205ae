"""Experiment: the cpu linear's tile sizes (schedules/cpu.py: NC_BYTES, MC_CHOICES, WORK_ITEMS,
KS, STREAM_ROWS), measured on a many-core host against numpy in the same run.

    PYTHONPATH=runtime:. python bench/cpu_tilings.py DIR                          # here: build
    PYTHONPATH=runtime python bench/linear.py run DIR --device cpu --repeats 9 --interleave  # there
    PYTHONPATH=runtime:. python bench/cpu_tilings.py DIR --mlp                    # the CPU issue's MLPs
    PYTHONPATH=runtime python bench/cpu_tilings.py DIR --run-mlp                  # there: 3 passes

Builds the same products once per variant of the table, by overriding the schedule's
constants for the duration of the build (the compile cache is off: its key cannot see them).
"""

import contextlib
import json
import os
import sys
from pathlib import Path

os.environ["HEXIR_CACHE_DIR"] = ""
sys.path.insert(0, str(Path(__file__).parent))  # bench/mlp.py

if "--run-mlp" not in sys.argv:  # (there: the runtime only)
    import hexir
    from hexir.schedules import cpu as cpu_schedule

#: name -> the constants it changes from the committed table. (Earlier sweeps, in
#: bench/results/2026-11-30-h200-pipelines.md: mc24, nc512, mc24nc512, items64.) Now: wider
#: column blocks, so that x is read fewer times over (x is read once per column block).
VARIANTS = {
    "base": {},
    "nc1024": {"NC_BYTES": 1024},
    "nc2048": {"NC_BYTES": 2048},
    "mc384nc1024": {"MC_CHOICES": (384, 192, 96, 48, 24), "NC_BYTES": 1024},
}
SIZES = [(256, 256, 256, "float32"), (256, 256, 256, "float64"), (512, 512, 512, "float32"),
         (512, 512, 512, "float64"), (1024, 1024, 1024, "float32"), (2048, 2048, 2048, "float32"),
         (1024, 1024, 1024, "float64"), (2048, 2048, 2048, "float64"),
         (1, 4096, 4096, "float32"), (4096, 1024, 33, "float32"), (64, 1024, 1024, "float32")]


#: `--mlp`: the CPU issue's 64x784x512x10 MLP (weights constants) under the parallel tiles'
#: variants: (name, the constants it changes).
MLP_VARIANTS = {  # as runs 51-52 ran them: base is the table before 12-row tiles (then adopted: mc12)
    "base": {"MC_CHOICES": (192, 96, 48, 24)},
    "mc12": {"MC_CHOICES": (192, 96, 48, 24, 12)},
    "mc12items48": {"MC_CHOICES": (192, 96, 48, 24, 12), "WORK_ITEMS": 48},
    "nc256": {"MC_CHOICES": (192, 96, 48, 24), "NC_BYTES": 256},
    "items48": {"MC_CHOICES": (192, 96, 48, 24), "WORK_ITEMS": 48},
}
MLP = (64, 784, 512, 10)


@contextlib.contextmanager
def _patched(changes: dict):
    """The cpu schedule's constants set to `changes` for the duration of the block."""
    saved = {name: getattr(cpu_schedule, name) for name in changes}
    try:
        for name, value in changes.items():
            setattr(cpu_schedule, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(cpu_schedule, name, value)


def build_mlps(out: Path) -> None:
    from mlp import mlp_of, weights  # bench/mlp.py, beside this script

    m, k, h, n = MLP
    for variant, changes in MLP_VARIANTS.items():
        with _patched(changes):
            for dtype in ("float32", "float64"):
                hexir.export(mlp_of(weights(k, h, n, dtype)), out / f"mlp_{dtype}_{variant}.hxb",
                             hexir.TensorSpec((m, k), dtype), placement={"hexir.linear": "cpu", "hexir.relu": "cpu"})
    print(f"built {2 * len(MLP_VARIANTS)} modules in {out}")


def run_mlps(directory: Path, passes: int = 3) -> None:
    """Each variant's module.main(x) against numpy's same expression, µs, `passes` times over."""
    import time

    import numpy as np
    from hexir_runtime import load
    from mlp import median_us, weights

    m, k, h, n = MLP
    print(f"cpu ({os.cpu_count()} cores): hexir/numpy µs = numpy's speed over hexir's, median of 200 calls")
    for index in range(passes):
        for dtype in ("float32", "float64"):
            w = weights(k, h, n, dtype)
            x = np.random.default_rng(1).standard_normal((m, k)).astype(dtype)

            def numpy_call(x=x, w=w):
                return np.maximum(x @ w["W1"] + w["b1"], 0) @ w["W2"] + w["b2"]
            line = []
            for variant in MLP_VARIANTS:
                module = load(directory / f"mlp_{dtype}_{variant}.hxb", "cpu")
                np.testing.assert_allclose(module.main(x), numpy_call(), rtol=1e-4, atol=1e-4)
                time.sleep(0.2)  # both pools spin a while after their last call
                ours = median_us(lambda module=module, x=x: module.main(x), 200)
                time.sleep(0.2)
                base = median_us(numpy_call, 200)
                line.append(f"{variant} {ours:.0f}/{base:.0f}={base / ours:.2f}")
            print(f"pass {index} {dtype}: " + "  ".join(line), flush=True)


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if "--mlp" in sys.argv:
        return build_mlps(out)
    if "--run-mlp" in sys.argv:
        return run_mlps(out)
    rows = []
    for variant, changes in VARIANTS.items():
        with _patched(changes):
            for m, k, n, dtype in SIZES:
                name = f"linear_{m}x{k}x{n}_{dtype}_cpu_{variant}"
                hexir.export(lambda x, w: hexir.linear(x, w), out / f"{name}.hxb", hexir.TensorSpec((m, k), dtype),
                             hexir.TensorSpec((k, n), dtype), target="cpu:x86-64-v4")
                rows.append({"name": name, "m": m, "k": k, "n": n, "dtype": dtype, "device": "cpu",
                             "variant": variant})
    (out / "modules.json").write_text(json.dumps(rows, indent=1))
    print(f"built {len(rows)} modules in {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
