"""Benchmark: the GEMMs of two compilers side by side (before/after a change), and a linear's
fused epilogue against the plain linear, timed in one run.

    # here: each side built by its own compiler (its tree first on PYTHONPATH)
    PYTHONPATH=/work/wt/h23-before:/work/wt/h23-before/runtime python bench/gemm_compare.py build .gpu/gemm/before
    PYTHONPATH=$PWD:$PWD/runtime python bench/gemm_compare.py build .gpu/gemm/after --epilogues
    # there (runtime only): both sides' kernels in turns, each launched by this tree's runtime
    python3 bench/gemm_compare.py run .gpu/gemm [--device cuda|cpu|all] [--repeats 30]

`build` compiles the products that say whether the GEMMs' speed moved (ROWS: float32 and float64
squares 1024-8192 on cuda, a few cpu rows), with w an argument (small files), as bench/linear.py
does; `--epilogues` adds, for the #23 target "a gelu epilogue within 3% of the plain linear at
4096³", that product with gelu, gelu(tanh), silu, bias+gelu fused into the linear's kernel
(each module must be one kernel). `run` times each row's two modules in turns (before, after,
before, ...: the GPU's clock drift falls on both alike) with bench/linear.py's runners: CUDA
events around one launch (products up to 2e10 FLOP: 20 launches queued behind a sleeping
kernel, so that the host's launch cost is left out), the host clock on the cpu; the median.
It prints ms, GF/s and after/before (below 1: after is faster), and checks that both sides
compute the same values (relative to the largest: 1e-4 float32, 1e-10 float64; else WRONG).
The epilogue table prints each fused module's time over the plain linear's (the target: <= 1.03).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from linear import QUEUED_FLOPS, _kernel_runner  # noqa: E402

ROWS = [(s, s, s, dtype, "cuda") for s in (1024, 2048, 4096, 8192) for dtype in ("float32", "float64")] + \
       [(m, k, n, dtype, "cpu") for m, k, n in ((512, 512, 512), (1024, 1024, 1024), (64, 784, 512))
        for dtype in ("float32", "float64")]
EPILOGUES = ("plain", "gelu", "gelu_tanh", "silu", "bias_gelu")
EPILOGUE_SIZE = 4096


def _epilogue(hexir, kind: str):
    if kind == "plain":
        return lambda x, w: hexir.linear(x, w)
    if kind == "bias_gelu":
        return lambda x, w, b: hexir.gelu(hexir.linear(x, w, b))
    if kind == "gelu_tanh":
        return lambda x, w: hexir.gelu(hexir.linear(x, w), approximate="tanh")
    return lambda x, w: getattr(hexir, kind)(hexir.linear(x, w))


def build(out: Path, epilogues: bool) -> None:
    from hexir_runtime.format import read

    import hexir

    out.mkdir(parents=True, exist_ok=True)
    rows = []
    spec = hexir.TensorSpec
    for m, k, n, dtype, device in ROWS:
        name = f"linear_{m}x{k}x{n}_{dtype}_{device}"
        hexir.export(lambda x, w: hexir.linear(x, w), out / f"{name}.hxb", spec((m, k), dtype), spec((k, n), dtype),
                     placement={"hexir.linear": device})
        rows.append({"name": name, "m": m, "k": k, "n": n, "dtype": dtype, "device": device})
    for kind in EPILOGUES if epilogues else ():
        s = EPILOGUE_SIZE
        for dtype in ("float32", "float64"):
            name = f"epilogue_{kind}_{dtype}"
            specs = [spec((s, s), dtype), spec((s, s), dtype)] + ([spec((s,), dtype)] if kind == "bias_gelu" else [])
            hexir.export(_epilogue(hexir, kind), out / f"{name}.hxb", *specs, placement="*=cuda")
            calls = [c for c in read(out / f"{name}.hxb").manifest.entries[0].program if c.op == "call"]
            if len(calls) != 1:
                raise SystemExit(f"{name}: {len(calls)} kernels, not one: the epilogue was not fused")
            rows.append({"name": name, "m": s, "k": s, "n": s, "dtype": dtype, "device": "cuda", "epilogue": kind})
    (out / "modules.json").write_text(json.dumps(rows, indent=1))
    print(f"built {len(rows)} modules in {out}")


def _reference(kind: str, x, w, b):
    """What the epilogue module computes, by torch on the GPU (float64 for float32 inputs)."""
    import torch

    y = torch.from_numpy(x).cuda().double() @ torch.from_numpy(w).cuda().double()
    if kind == "bias_gelu":
        y = y + torch.from_numpy(b).cuda().double()
    if kind in ("gelu", "bias_gelu"):
        y = torch.nn.functional.gelu(y)
    elif kind == "gelu_tanh":
        y = torch.nn.functional.gelu(y, approximate="tanh")
    elif kind == "silu":
        y = torch.nn.functional.silu(y)
    return y.cpu().numpy()


def _interleaved(runners: list, repeats: int, queued: bool) -> list[float]:
    for runner in runners:  # warm-up
        runner()
    times: list[list[float]] = [[] for _ in runners]
    for _ in range(repeats):
        for runner, seen in zip(runners, times, strict=True):
            seen.append(runner(queued=True) if queued else runner())
    return [statistics.median(seen) for seen in times]


def _differs(a: np.ndarray, b: np.ndarray, dtype: str) -> str:
    error = float(np.abs(a.astype(np.float64) - b).max() / max(float(np.abs(b).max()), 1e-30))
    return "" if error < (1e-4 if dtype == "float32" else 1e-10) else f"  WRONG (relative difference {error:.2e})"


def run(root: Path, device: str, repeats: int) -> int:
    before = json.loads((root / "before" / "modules.json").read_text())
    after = {r["name"]: r for r in json.loads((root / "after" / "modules.json").read_text())}
    rng, status = np.random.default_rng(0), 0
    where = "cpu"
    if device in ("cuda", "all"):
        import torch
        where = torch.cuda.get_device_name(0)
    print(f"== GEMMs before/after ({root / 'before'} vs {root / 'after'}), on {where}; median of {repeats}, in turns")
    print(f"{'M x K x N':>20} {'dtype':>8} {'dev':>4} {'before ms':>10} {'after ms':>10} {'before GF/s':>11} "
          f"{'after GF/s':>10} {'after/before':>12}")
    for row in before:
        if row["name"] not in after or device not in ("all", row["device"]):
            continue
        m, k, n, dtype = row["m"], row["k"], row["n"], row["dtype"]
        x, w = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
        runners = [_kernel_runner(root / side / f"{row['name']}.hxb", row["device"], [x, w], m)
                   for side in ("before", "after")]
        flops = 2.0 * m * k * n
        times = _interleaved(runners, repeats, row["device"] == "cuda" and flops <= QUEUED_FLOPS)
        note = _differs(runners[1].result(), runners[0].result().astype(np.float64), dtype)
        status |= bool(note)
        label = f"{m} x {k} x {n}"
        print(f"{label:>20} {dtype:>8} {row['device']:>4} {times[0] * 1e3:10.3f} {times[1] * 1e3:10.3f} "
              f"{flops / times[0] / 1e9:11.1f} {flops / times[1] / 1e9:10.1f} {times[1] / times[0]:12.3f}{note}",
              flush=True)
    epilogue_rows = [r for r in after.values() if "epilogue" in r]
    if epilogue_rows and device in ("cuda", "all"):
        status |= run_epilogues(root / "after", epilogue_rows, repeats, rng)
    return status


def run_epilogues(modules: Path, rows: list[dict], repeats: int, rng) -> int:
    print(f"== linear {EPILOGUE_SIZE}^3 with a fused epilogue vs the plain linear (#23 target: gelu <= 1.03)")
    print(f"{'epilogue':>10} {'dtype':>8} {'ms':>9} {'plain ms':>9} {'TF/s':>7} {'/ plain':>8}")
    status = 0
    for dtype in ("float32", "float64"):
        group = [r for r in rows if r["dtype"] == dtype]
        s = EPILOGUE_SIZE
        x, w, b = (rng.standard_normal(shape).astype(dtype) for shape in ((s, s), (s, s), (s,)))
        runners = [_kernel_runner(modules / f"{r['name']}.hxb", "cuda", [x, w, b] if r["epilogue"] == "bias_gelu"
                                  else [x, w], s) for r in group]
        times = _interleaved(runners, repeats, False)
        plain = times[[r["epilogue"] for r in group].index("plain")]
        for row, runner, seconds in zip(group, runners, times, strict=True):
            note = _differs(runner.result(), _reference(row["epilogue"], x, w, b), dtype)
            status |= bool(note)
            print(f"{row['epilogue']:>10} {dtype:>8} {seconds * 1e3:9.3f} {plain * 1e3:9.3f} "
                  f"{2.0 * s ** 3 / seconds / 1e12:7.2f} {seconds / plain:8.3f}{note}", flush=True)
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build_parser = commands.add_parser("build", help="compile ROWS with the hexir on PYTHONPATH")
    build_parser.add_argument("out", type=Path)
    build_parser.add_argument("--epilogues", action="store_true", help="also linear 4096^3 with fused epilogues")
    run_parser = commands.add_parser("run", help="time DIR/before against DIR/after (runtime only)")
    run_parser.add_argument("root", type=Path)
    run_parser.add_argument("--device", choices=("cuda", "cpu", "all"), default="all")
    run_parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    if args.command == "build":
        build(args.out, args.epilogues)
        return 0
    return run(args.root, args.device, args.repeats)


if __name__ == "__main__":
    sys.exit(main())
