"""Benchmark: hexir's linear (matrix product) against the baseline, measured in the same run.

    python bench/linear.py build bench/modules            # here: compile the modules (needs hexir)
    python bench/linear.py run bench/modules --device cpu --max-gflop 20  # hexir cpu vs numpy
    python bench/linear.py run bench/modules --device cuda # hexir cuda kernels vs cuBLAS (torch)

Weights are arguments, so the modules are small and the data is drawn where it runs. Each
row times one kernel launch on buffers already on the device (warm-up first, then the median
of repeated runs); the baseline is timed the same way: numpy's `matmul` into a preallocated
output, or `torch.matmul(out=...)` followed by a synchronize. Ratio = baseline time / hexir
time (above 1: hexir is faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

SIZES = [(128, 128, 128), (512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096),
         (1, 4096, 4096), (4096, 1024, 33)]


def build(out: Path) -> None:
    import hexir

    out.mkdir(parents=True, exist_ok=True)

    def linear(x, w):
        return hexir.linear(x, w)

    rows = []
    for m, k, n in SIZES:
        for device in ("cpu", "cuda"):
            for dtype in ("float32", "float64"):
                name = f"linear_{m}x{k}x{n}_{dtype}_{device}"
                hexir.export(linear, out / f"{name}.hxb", hexir.TensorSpec((m, k), dtype),
                             hexir.TensorSpec((k, n), dtype), placement={"hexir.linear": device})
                rows.append({"name": name, "m": m, "k": k, "n": n, "dtype": dtype, "device": device})
    (out / "modules.json").write_text(json.dumps(rows, indent=1))
    print(f"built {len(rows)} modules in {out}")


def _median_seconds(fn, repeats: int, budget: float = 2.0) -> float:
    fn()  # warm-up: module load, first-touch, JIT
    times = []
    deadline = time.perf_counter() + budget
    while len(times) < repeats and (len(times) < 3 or time.perf_counter() < deadline):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _kernel_runner(path: Path, device: str, arrays: list[np.ndarray]):
    """A function launching the module's one kernel on buffers already on `device`."""
    from hexir_runtime.format import read

    hxb = read(path)
    kernel = hxb.manifest["kernels"][0]
    if device == "cuda":
        from hexir_runtime.cuda import CudaDevice
        place = CudaDevice()
    else:
        from hexir_runtime.cpu import CpuDevice
        place = CpuDevice()
    program = place.load(hxb)
    buffers = [place.alloc(a.shape, a.dtype.name) for a in arrays]
    buffers.append(place.alloc(tuple(kernel["args"][-1]["shape"]), kernel["args"][-1]["dtype"]))
    for buffer, array in zip(buffers[:-1], arrays, strict=True):
        place.copy_in(buffer, array)

    def launch() -> None:
        program.launch(0, buffers)
        place.synchronize()
    return launch


def run(modules: Path, device: str, repeats: int, max_gflop: float) -> None:
    rows = [r for r in json.loads((modules / "modules.json").read_text())
            if r["device"] == device and 2 * r["m"] * r["k"] * r["n"] <= max_gflop * 1e9]
    rng = np.random.default_rng(0)
    if device == "cuda":
        import torch
        baseline_name = f"cuBLAS (torch {torch.__version__})"
        gpu = torch.cuda.get_device_name(0)
        torch.backends.cuda.matmul.allow_tf32 = False  # same arithmetic as hexir: plain fp32 FMAs
    else:
        baseline_name = f"numpy {np.__version__}"
        gpu = None
    print(f"device: {gpu or 'cpu'}; baseline: {baseline_name}; median of up to {repeats} runs")
    print(f"{'M x K x N':>18} {'dtype':>8} {'hexir ms':>10} {'base ms':>10} {'hexir GF/s':>11} {'base GF/s':>10} "
          f"{'ratio':>7}")
    for row in rows:
        m, k, n, dtype = row["m"], row["k"], row["n"], row["dtype"]
        x = rng.standard_normal((m, k)).astype(dtype)
        w = rng.standard_normal((k, n)).astype(dtype)
        hexir_time = _median_seconds(_kernel_runner(modules / f"{row['name']}.hxb", device, [x, w]), repeats)
        if device == "cuda":
            tx, tw = torch.from_numpy(x).cuda(), torch.from_numpy(w).cuda()
            tout = torch.empty((m, n), dtype=tx.dtype, device="cuda")

            def baseline(tx=tx, tw=tw, tout=tout) -> None:
                torch.matmul(tx, tw, out=tout)
                torch.cuda.synchronize()
        else:
            out = np.empty((m, n), dtype)

            def baseline(x=x, w=w, out=out) -> None:
                np.matmul(x, w, out=out)
        base_time = _median_seconds(baseline, repeats)
        flops = 2.0 * m * k * n
        print(f"{f'{m} x {k} x {n}':>18} {dtype:>8} {hexir_time * 1e3:10.3f} {base_time * 1e3:10.3f} "
              f"{flops / hexir_time / 1e9:11.1f} {flops / base_time / 1e9:10.1f} {base_time / hexir_time:7.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("build").add_argument("out", type=Path)
    run_parser = commands.add_parser("run")
    run_parser.add_argument("modules", type=Path)
    run_parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    run_parser.add_argument("--repeats", type=int, default=20)
    run_parser.add_argument("--max-gflop", type=float, default=float("inf"),
                            help="skip products of more than this many GFLOP (the cpu's 4096^3 takes minutes)")
    args = parser.parse_args(argv)
    if args.command == "build":
        build(args.out)
    else:
        run(args.modules, args.device, args.repeats, args.max_gflop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
