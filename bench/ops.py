"""Benchmark: memory-bound op kernels (#23's families) against a copy of the same bytes, torch
eager and torch.compile on the GPU, and numpy on the cpu. A measurement for the record (the
targets are #25's).

    python bench/ops.py build bench/ops_modules             # here: compile the modules (needs hexir)
    python bench/ops.py run bench/ops_modules --device cuda [--compile]   # there
    python bench/ops.py run bench/ops_modules --device cpu   # hexir's cpu kernels vs numpy

OPS: softmax, layer_norm (weight and bias), a pointwise chain gelu(x * a + b) (a, b rows),
each one kernel, at ROWS x COLUMNS (1024, 4096, 16384 columns; 2^26 elements on cuda, 2^22 on
the cpu), float32 and float64, static shapes. cuda: CUDA events around one launch on buffers
already on the device, median of repeats; "copy" is a device-to-device copy of x into a buffer
of its size (torch), the same bytes read and written as the kernel's x in and y out, and
"of copy" is copy time / kernel time (1.0: the kernel moves its bytes as fast as a copy);
torch eager and torch.compile (inductor, static shapes, TF32 off) are timed the same way;
"ratio" columns are torch's time / hexir's (above 1: hexir is faster). cpu: host clock around
one call of the kernels; numpy computes the same formula with temporaries, on one thread as its
ufuncs do (erf: scipy's, else torch's). A result off torch's (or numpy's) by more than 1e-4 (float32) or 1e-10
(float64) relative to the largest is printed WRONG.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

OPS = ("softmax", "log_softmax", "layer_norm", "gelu_chain")
COLUMNS = (1024, 4096, 16384)
ELEMENTS = {"cuda": 1 << 26, "cpu": 1 << 22}


def _function(hexir, op: str):
    if op == "softmax":
        return lambda x: hexir.softmax(x)
    if op == "log_softmax":
        return lambda x: hexir.log_softmax(x)
    if op == "layer_norm":
        return lambda x, w, b: hexir.layer_norm(x, w, b)
    return lambda x, a, b: hexir.gelu(x * a + b)


def build(out: Path, devices: tuple[str, ...] = ("cuda", "cpu"), ops: tuple[str, ...] = OPS,
          settings: tuple[str, ...] = (), columns: tuple[int, ...] = COLUMNS, target: str | None = None) -> None:
    import importlib
    import os

    import hexir

    if settings:  # the compile cache's key does not hold schedule constants: a variant must not hit it
        os.environ["HEXIR_CACHE_DIR"] = ""
    for setting in settings:  # MODULE.NAME=INT: a schedule constant changed for this build (a variant)
        where, value = setting.split("=")
        module, name = where.rsplit(".", 1)
        setattr(importlib.import_module(module), name, int(value))
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for device in devices:
        for op in ops:
            for n in columns:
                for dtype in ("float32", "float64"):
                    m = ELEMENTS[device] // n
                    name = f"{op}_{m}x{n}_{dtype}_{device}"
                    specs = [hexir.TensorSpec((m, n), dtype)] + [hexir.TensorSpec((n,), dtype)] * _extras(op)
                    hexir.export(_function(hexir, op), out / f"{name}.hxb", *specs, placement=f"*={device}",
                                 target=target)
                    rows.append({"name": name, "op": op, "m": m, "n": n, "dtype": dtype, "device": device})
    (out / "modules.json").write_text(json.dumps(rows, indent=1))
    print(f"built {len(rows)} modules in {out}")


def _extras(op: str) -> int:
    """The op's inputs besides x (rows of its last axis)."""
    return 0 if op in ("softmax", "log_softmax") else 2


def _numpy(op: str, x, w=None, b=None):
    if op == "softmax":
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    if op == "log_softmax":
        shifted = x - x.max(-1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    if op == "layer_norm":
        mean = x.mean(-1, keepdims=True)
        centred = x - mean
        return centred / np.sqrt((centred * centred).mean(-1, keepdims=True) + 1e-5) * w + b
    y = x * w + b
    return 0.5 * y * (1 + _erf(y / math.sqrt(2)))


def _erf(y: np.ndarray) -> np.ndarray:
    """numpy has no erf: scipy's ufunc, else torch's on the cpu (no copy), else math.erf per element."""
    try:
        from scipy.special import erf
        return erf(y)
    except ImportError:
        pass
    try:
        import torch
        return torch.special.erf(torch.from_numpy(y)).numpy()
    except ImportError:
        return np.vectorize(math.erf, otypes=[y.dtype])(y)


def _torch(op: str):
    import torch

    if op == "softmax":
        return lambda x: torch.softmax(x, -1)
    if op == "log_softmax":
        return lambda x: torch.log_softmax(x, -1)
    if op == "layer_norm":
        return lambda x, w, b: torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, 1e-5)
    return lambda x, a, b: torch.nn.functional.gelu(x * a + b)


def _runner(path: Path, device: str, arrays: list[np.ndarray]):
    """Seconds of one launch of the module's one kernel on buffers already there, and its result."""
    from hexir_runtime.format import read

    hxb = read(path)
    calls = [c for c in hxb.manifest.entries[0].program if c.op == "call"]
    if len(calls) != 1:
        raise SystemExit(f"{path}: {len(calls)} kernels, not one")
    if device == "cuda":
        from hexir_runtime.cuda import CudaDevice, check
        place = CudaDevice()
    else:
        from hexir_runtime.cpu import CpuDevice
        place = CpuDevice()
    program = place.load(hxb)
    entry = hxb.manifest.entries[0]  # the entry's buffers as its program lays them out, all on `place`:
    buffers = [place.alloc(buffer.type.concrete({}), buffer.type.dtype) for buffer in entry.buffers]
    same = {}  # a transfer's destination -> its source (one buffer here: the copy is not timed)
    for command in entry.program:
        if command.op == "input":
            place.copy_in(buffers[command.dst], arrays[command.index])
        elif command.op == "transfer":
            same[command.dst] = same.get(command.src, command.src)
        elif command.op == "return":
            result = buffers[same.get(command.srcs[0], command.srcs[0])]
    if device == "cuda":
        place.make_current()
    launch = program.launcher(calls[0].kernel, [buffers[same.get(arg, arg)] for arg in calls[0].args], {})
    if device == "cpu":
        def timed() -> float:
            start = time.perf_counter()
            launch()
            return time.perf_counter() - start
    else:
        driver = place.driver
        start, end = (check(driver.cuEventCreate(0), "cuEventCreate") for _ in range(2))

        def timed() -> float:
            check(driver.cuEventRecord(start, program.stream), "cuEventRecord")
            launch()
            check(driver.cuEventRecord(end, program.stream), "cuEventRecord")
            check(driver.cuEventSynchronize(end), "cuEventSynchronize")
            return check(driver.cuEventElapsedTime(start, end), "cuEventElapsedTime") / 1e3
    timed.result = lambda: place.copy_out(result) if device == "cuda" else result.copy()
    timed.keep = (place, program, buffers)
    return timed


def _median(fn, repeats: int) -> float:
    fn()
    return statistics.median(fn() for _ in range(repeats))


def _events(fn):
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed() -> float:
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    return timed


def _wrong(ours: np.ndarray, theirs: np.ndarray, dtype: str) -> str:
    error = float(np.abs(ours.astype(np.float64) - theirs).max() / max(float(np.abs(theirs).max()), 1e-30))
    return "" if error < (1e-4 if dtype == "float32" else 1e-10) else f"  WRONG ({error:.1e})"


def run(folders: list[Path], device: str, repeats: int, compile_: bool, compile_budget: float) -> int:
    """Each row of the first folder's modules, then the same module of each other folder (a
    variant's build, timed in turns on the same arrays: its line starts with the folder's name;
    torch's columns only on the first)."""
    rows = [r for r in json.loads((folders[0] / "modules.json").read_text()) if r["device"] == device]
    rng, status, compiling = np.random.default_rng(0), 0, 0.0
    if device == "cuda":
        import torch
        torch.backends.cuda.matmul.allow_tf32 = False
        print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}; median of {repeats}; "
              "ratio = torch's time / hexir's")
        print(f"{'op':>11} {'M x N':>13} {'dtype':>8} {'hexir ms':>9} {'GB/s':>7} {'copy ms':>8} {'of copy':>7} "
              f"{'eager ms':>9} {'ratio':>6} {'compiled':>9} {'ratio':>6}")
    else:
        print(f"device: cpu; numpy {np.__version__}; median of {repeats}; ratio = numpy's time / hexir's")
        print(f"{'op':>11} {'M x N':>13} {'dtype':>8} {'hexir ms':>9} {'GB/s':>7} {'numpy ms':>9} {'ratio':>6}")
    for row in rows:
        m, n, dtype, op = row["m"], row["n"], row["dtype"], row["op"]
        x = rng.standard_normal((m, n), dtype=dtype)  # (made in its dtype: half the time for float32)
        extras = [rng.standard_normal(n).astype(dtype) for _ in range(_extras(op))]
        seen: dict = {}  # the first folder's torch figures, for the variants' lines
        for folder in folders:
            if not (folder / f"{row['name']}.hxb").exists():
                continue
            runner = _runner(folder / f"{row['name']}.hxb", device, [x, *extras])
            ours = _median(runner, repeats)
            moved = 2 * x.nbytes  # x read, y written (the rows a, b, w, bias: negligible)
            label = f"{m}x{n}" if folder == folders[0] else f"{folder.name}:"
            head = f"{op:>11} {label:>13} {dtype:>8} {ours * 1e3:9.3f} {moved / ours / 1e9:7.1f}"
            if device == "cpu":
                theirs = _median(_host(lambda op=op, x=x, extras=extras: _numpy(op, x, *extras)),
                                 max(3, repeats // 4))
                note = _wrong(runner.result(), _numpy(op, x, *extras).astype(np.float64), dtype)
                print(f"{head} {theirs * 1e3:9.3f} {theirs / ours:6.2f}{note}", flush=True)
            else:
                line, note, spent = _torch_columns(op, [x, *extras], runner, ours, repeats,
                                                   compile_ and compiling < compile_budget, seen)
                compiling += spent
                print(f"{head} {line}{note}", flush=True)
            status |= bool(note)
            del runner
    return status


def _host(fn):
    def timed() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    return timed


def _torch_columns(op: str, arrays: list[np.ndarray], runner, ours: float, repeats: int, compile_: bool,
                   seen: dict):
    """The cuda row's copy, eager and compiled columns, its WRONG note, and the seconds compiling
    took; a variant's (`seen` holds the first folder's copy time and result) has copy's alone."""
    import torch

    if seen:
        note = _wrong(runner.result(), seen["wide"], arrays[0].dtype.name)
        return f"{seen['copy'] * 1e3:8.3f} {seen['copy'] / ours:7.2f}", note, 0.0
    tx, *textras = (torch.from_numpy(a).cuda() for a in arrays)
    copy_to = torch.empty_like(tx)
    copy = _median(_events(lambda: copy_to.copy_(tx)), repeats)
    eager_fn = _torch(op)
    eager = _median(_events(lambda: eager_fn(tx, *textras)), repeats)
    wide = eager_fn(tx.double(), *(t.double() for t in textras)).cpu().numpy()
    seen.update(copy=copy, wide=wide)
    note = _wrong(runner.result(), wide, arrays[0].dtype.name)
    compiled, started = "      n/a    n/a", time.perf_counter()
    if compile_:
        try:
            torch._dynamo.reset()  # a fresh compile per row: the rows share one code object (recompile limit)
            fn = torch.compile(_torch(op), dynamic=False)
            fn(tx, *textras)
            seconds = _median(_events(lambda: fn(tx, *textras)), repeats)
            compiled = f"{seconds * 1e3:9.3f} {seconds / ours:6.2f}"
        except Exception as error:  # noqa: BLE001 - inductor's failures vary; the row says so
            compiled = f" failed: {type(error).__name__}"
    line = f"{copy * 1e3:8.3f} {copy / ours:7.2f} {eager * 1e3:9.3f} {eager / ours:6.2f} {compiled}"
    return line, note, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build_parser = commands.add_parser("build")
    build_parser.add_argument("out", type=Path)
    build_parser.add_argument("--devices", default="cuda,cpu")
    build_parser.add_argument("--ops", default=",".join(OPS))
    build_parser.add_argument("--columns", default=",".join(map(str, COLUMNS)))
    build_parser.add_argument("--target", default=None, help='e.g. "cpu:x86-64,cuda:sm_90" (default: hexir\'s)')
    build_parser.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=INT",
                              help="a schedule constant for this build (a variant), e.g. "
                                   "hexir.schedules.cuda_families.REGISTER_THREADS=512")
    run_parser = commands.add_parser("run")
    run_parser.add_argument("modules", type=Path, nargs="+", help="a folder of modules; more: variants, in turns")
    run_parser.add_argument("--device", choices=("cuda", "cpu"), default="cpu")
    run_parser.add_argument("--repeats", type=int, default=20)
    run_parser.add_argument("--compile", action="store_true", help="cuda: also torch.compile (inductor)")
    run_parser.add_argument("--compile-budget", type=float, default=180.0,
                            help="seconds of torch.compile after which the rest are n/a")
    args = parser.parse_args(argv)
    if args.command == "build":
        build(args.out, tuple(args.devices.split(",")), tuple(args.ops.split(",")), tuple(args.set),
              tuple(int(n) for n in args.columns.split(",")), args.target)
        return 0
    return run(args.modules, args.device, args.repeats, args.compile, args.compile_budget)


if __name__ == "__main__":
    sys.exit(main())
