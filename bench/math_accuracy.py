"""The accuracy of hexir's math lowering (docs/math.md), per op, on the cpu and on CUDA.

    python bench/math_accuracy.py [--points N]  # here: the cpu (x86-64-v3 and the baseline)
    python bench/math_accuracy.py --speed       # here: ns per element of the cpu kernels, and numpy's
    python bench/math_accuracy.py --exhaustive exp,log,tanh  # here: every float32 input (minutes)
    python bench/math_accuracy.py build DIR     # here (MLIR): the CUDA images, for the GPU machine
    python bench/math_accuracy.py run DIR [--ptx]  # on the GPU machine (numpy, cuda-python, the runtime)

Each op runs as a kernel the way hexir compiles one: on the cpu through to-llvm and the cpu
backend, a vector loop (vector<16xf32>, vector<8xf64>) then a scalar loop for the rest; on
CUDA through the cuda backend (libdevice), one element per thread. Inputs: every 2^11-th
float32 bit pattern (all binades and signs), a dense grid over the op's interesting range,
random points, and the special values. Errors:
- float32: the largest error in float32 ulps (of the exact value's binade) against Python's
  `math` function evaluated in float64 (within 1 float64 ulp: 2^-29 of a float32 ulp);
- float64: the largest relative error against numpy's float64 function (`math.erf` for erf,
  which numpy lacks), itself within about 1 float64 ulp of the exact value, so errors near
  2e-16 are at the reference's own accuracy.
A special value (NaN, ±inf, ±0, overflow) must match the reference exactly, sign of zero included;
a mismatch is listed and fails the run.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

UNARY = ("exp", "log", "tanh", "erf", "sqrt", "rsqrt", "absf")
OPS = (*UNARY, "powf")
SIZE = 1 << 22  # the kernels' static buffer length (elements); runs cover at most this many
RANGES = {"exp": (-105.0, 90.0), "log": (0.0, 4.0), "tanh": (-10.0, 10.0), "erf": (-5.0, 5.0),
          "sqrt": (0.0, 100.0), "rsqrt": (0.0, 100.0), "absf": (-10.0, 10.0), "powf": (0.0, 10.0)}
SPECIAL = [0.0, -0.0, 1.0, -1.0, 0.5, 2.0, np.inf, -np.inf, np.nan, 1e-30, -1e-30, 1e-45, 1e30, -1e30, 5e-324, 1e-310,
           88.72, 89.0, 709.8, 710.0, -87.0, -104.0, -745.2, -746.0, 3.9, 4.0, 5.0, 6.0, 20.0, -20.0, 1000.0, -1000.0]
REFERENCE = {"exp": math.exp, "log": math.log, "tanh": math.tanh, "erf": math.erf, "sqrt": math.sqrt,
             "rsqrt": lambda x: 1.0 / math.sqrt(x), "absf": abs, "powf": math.pow}
NUMPY = {"exp": np.exp, "log": np.log, "tanh": np.tanh, "sqrt": np.sqrt, "rsqrt": lambda x: 1.0 / np.sqrt(x),
         "absf": np.abs, "powf": np.power}


def inputs(op: str, dtype: type, points: int, seed: int = 0, stride: int = 11) -> tuple[np.ndarray, np.ndarray]:
    """(x, p): the op's arguments (p: powf's exponents, else zeros); float32: every 2^stride-th bit pattern too."""
    rng = np.random.default_rng(seed)
    low, high = RANGES[op]
    if dtype is np.float32:
        spread = np.arange(0, 1 << 32, 1 << stride, dtype=np.uint64).astype(np.uint32).view(np.float32)
    else:
        spread = rng.integers(0, 1 << 64, points, dtype=np.uint64).view(np.float64)
    x = np.concatenate([np.array(SPECIAL), np.linspace(low, high, points), rng.uniform(low, high, points),
                        spread[np.isfinite(spread)]]).astype(dtype)[:SIZE]
    p = rng.uniform(-12.0, 12.0, x.size).astype(dtype) if op == "powf" else np.zeros_like(x)
    if op == "powf":
        x = np.abs(x)
        p[: len(SPECIAL)] = 2.0
    return x, p


def reference(op: str, x: np.ndarray, p: np.ndarray) -> np.ndarray:
    """The op in float64: `math` for float32 arguments, numpy (math.erf) for float64 ones."""
    wide = x.astype(np.float64)
    if x.dtype == np.float64 and op in NUMPY:
        with np.errstate(all="ignore"):
            return NUMPY[op](wide, p) if op == "powf" else NUMPY[op](wide)

    def one(v: float, q: float) -> float:
        try:
            return REFERENCE[op](v, q) if op == "powf" else REFERENCE[op](v)
        except OverflowError:
            return math.inf
        except (ValueError, ZeroDivisionError):  # math raises where numpy gives nan or inf
            if v == 0:  # log(±0) = -inf, rsqrt(±0) = ±inf, pow(0, q < 0) = inf
                return {"log": -math.inf, "rsqrt": math.copysign(math.inf, v)}.get(op, math.inf)
            return math.nan

    with np.errstate(all="ignore"):
        return np.frompyfunc(one, 2, 1)(wide, p.astype(np.float64)).astype(np.float64)


def errors(y: np.ndarray, exact: np.ndarray) -> tuple[float, list]:
    """(largest error: ulps for float32, relative for float64; the special values that differ)."""
    with np.errstate(over="ignore"):
        expected = exact.astype(y.dtype)  # the correctly rounded result (inf where it overflows)
    finite = np.isfinite(expected) & np.isfinite(y)
    same = (y == expected) & (np.signbit(y) == np.signbit(expected)) | (np.isnan(y) & np.isnan(expected))
    wrong = ~finite & ~same | finite & (expected == 0) & (y != 0)
    if y.dtype == np.float32:
        _, exponent = np.frexp(np.abs(exact[finite]))
        error = np.abs(y[finite].astype(np.float64) - exact[finite]) / np.exp2(np.maximum(exponent - 24, -149))
    else:
        scale = np.maximum(np.abs(exact[finite]), np.finfo(np.float64).tiny)
        error = np.abs(y[finite] - exact[finite]) / scale
    return float(error.max(initial=0.0)), list(np.flatnonzero(wrong))


def _kernel(op: str, t: str, width: int) -> str:
    """A cpu kernel y[i] = op(x[i] (, p[i])) for i < n: `width`-wide vectors, then scalars
    (width 1: a loop of scalars, which LLVM's loop vectoriser may vectorise)."""
    vt = f"vector<{width}x{t}>"
    mem = f"memref<{SIZE}x{t}>"

    def apply(kind: str, v: str, q: str) -> str:
        return f"math.{op} {v}, {q} : {kind}" if op == "powf" else f"math.{op} {v} : {kind}"

    vector_loop = f"""
    %w = arith.constant {width} : index
    %vectors = arith.divui %n, %w : index
    scf.for %i = %c0 to %vectors step %c1 {{
      %at = arith.muli %i, %w : index
      %v = vector.load %x[%at] : {mem}, {vt}
      %q = vector.load %p[%at] : {mem}, {vt}
      %e = {apply(vt, "%v", "%q")}
      vector.store %e, %y[%at] : {mem}, {vt}
    }}
    %rest = arith.muli %vectors, %w : index""" if width > 1 else "\n    %rest = arith.constant 0 : index"
    return f"""
  func.func @{op}_{t}_{width}(%x: {mem}, %p: {mem}, %y: {mem}, %n: index) attributes
      {{hextir.kernel = #hextir.kernel<"cpu", "{op}">, hextir.level = "LEVEL"}} {{
    %c0 = arith.constant 0 : index
    %c1 = arith.constant 1 : index{vector_loop}
    scf.for %i = %rest to %n step %c1 {{
      %v = memref.load %x[%i] : {mem}
      %q = memref.load %p[%i] : {mem}
      %e = {apply(t, "%v", "%q")}
      memref.store %e, %y[%i] : {mem}
    }}
    return
  }}"""


def _gpu_kernel(op: str, t: str) -> str:
    mem = f"memref<{SIZE}x{t}>"
    call = f"math.{op} %v, %q : {t}" if op == "powf" else f"math.{op} %v : {t}"
    return f"""
    gpu.func @{op}_{t}(%x: {mem}, %p: {mem}, %y: {mem}, %n: index) kernel {{
      %b = gpu.block_id x
      %d = gpu.block_dim x
      %t = gpu.thread_id x
      %base = arith.muli %b, %d : index
      %i = arith.addi %base, %t : index
      %inside = arith.cmpi ult, %i, %n : index
      scf.if %inside {{
        %v = memref.load %x[%i] : {mem}
        %q = memref.load %p[%i] : {mem}
        %e = {call}
        memref.store %e, %y[%i] : {mem}
      }}
      gpu.return
    }}"""


def cpu_library(level: str, ops=OPS, widths=((16, 8), (1, 1))) -> ctypes.CDLL:
    """The kernels of `ops` for both dtypes and each (f32 width, f64 width), built and loaded."""
    from mlir import ir

    from hexir.backend import cpu
    from hexir.dialects import make_context
    from hexir.passes.to_llvm import cpu_kernels_to_llvm

    text = "".join(_kernel(op, t, w[i]) for op in ops for i, t in enumerate(("f32", "f64")) for w in widths)
    with make_context():
        library = cpu.compile_kernels(cpu_kernels_to_llvm(ir.Module.parse(text.replace("LEVEL", level))), level)
    path = Path(tempfile.mkdtemp(prefix="hexir-math-")) / "math.so"
    path.write_bytes(library.shared_object)
    return ctypes.CDLL(str(path))


def run_cpu(library: ctypes.CDLL, op: str, width: int, x: np.ndarray, p: np.ndarray) -> np.ndarray:
    t = "f32" if x.dtype == np.float32 else "f64"
    y = np.empty_like(x)
    function = getattr(library, f"{op}_{t}_{width}")
    function.restype = None
    function(*(ctypes.c_void_p(a.ctypes.data) for a in (x, p, y)), ctypes.c_int64(x.size))
    return y


@functools.cache
def case(op: str, dtype: type, points: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x, p, the exact values): computed once per op and dtype, for every device and path."""
    x, p = inputs(op, dtype, points)
    return x, p, reference(op, x, p)


def report(device: str, run, points: int) -> bool:
    ok = True
    np.seterr(all="ignore")  # overflow to inf and NaN are expected outputs here
    print(f"{'op':6} {'float32 max ulp':>16} {'not nearest':>12} {'float64 max rel':>16}   ({device})")
    for op in OPS:
        cells, sizes = [], []
        for dtype in (np.float32, np.float64):
            x, p, exact = case(op, dtype, points)
            y = run(op, x, p)
            sizes.append(str(x.size))
            error, wrong = errors(y, exact)
            if dtype is np.float32:  # and how many results are not the correctly rounded value
                with np.errstate(over="ignore"):
                    other = np.sum((y != exact.astype(y.dtype)) & ~(np.isnan(y) & np.isnan(exact)))
                cells.append(f"{error:16.4f} {other:12d}")
            else:
                cells.append(f"{error:16.3g}")
            for i in wrong[:5]:
                print(f"  MISMATCH {op} {dtype.__name__}({x[i]!r}{f', {p[i]!r}' if op == 'powf' else ''}) = "
                      f"{y[i]!r}, expected {reference(op, x[i:i + 1], p[i:i + 1])[0]!r}")
            ok &= not wrong
        print(f"{op:6} {cells[0]} {cells[1]}   ({' and '.join(sizes)} points)")
    return ok


def speed(library: ctypes.CDLL, size: int = 1 << 22) -> None:
    """Nanoseconds per element of each op's vector kernel on one thread (best of 5), and numpy's
    (math.erf element by element for erf, which numpy lacks)."""
    print(f"{'op':6} {'float32':>9} {'numpy':>7} {'float64':>9} {'numpy':>7}   (ns per element, one thread)")
    for op in OPS:
        cells = []
        for dtype, width in ((np.float32, 16), (np.float64, 8)):
            x = np.random.default_rng(0).uniform(0.1, 4.0, size).astype(dtype)
            p = np.full_like(x, 1.5)
            times = []
            for repeat in range(10):
                start = time.perf_counter()
                if repeat % 2 == 0:
                    run_cpu(library, op, width, x, p)
                elif op == "erf":
                    np.frompyfunc(math.erf, 1, 1)(x)
                else:
                    NUMPY[op](x, p) if op == "powf" else NUMPY[op](x)
                times.append((time.perf_counter() - start) / size * 1e9)
            cells += [f"{min(times[0::2]):9.2f}", f"{min(times[1::2]):7.2f}"]
        print(f"{op:6} {' '.join(cells)}")


def exhaustive(library: ctypes.CDLL, op: str, chunk: int = SIZE) -> None:
    """Every float32 input (2^32 bit patterns) of `op` against numpy's float64 function rounded
    to float32 (numpy's own error, about 1 float64 ulp, can flip a result lying that close to a
    rounding midpoint: such a case would be counted here)."""
    worst, other, total = 0.0, 0, 0
    for start in range(0, 1 << 32, chunk):
        x = np.arange(start, start + chunk, dtype=np.uint64).astype(np.uint32).view(np.float32)
        y = run_cpu(library, op, 16, x, x)
        with np.errstate(all="ignore"):
            exact = NUMPY[op](x.astype(np.float64))
            expected = exact.astype(np.float32)
        same = (y == expected) & (np.signbit(y) == np.signbit(expected)) | np.isnan(y) & np.isnan(expected)
        differ = np.flatnonzero(~same)  # few: measure only these
        error, wrong = errors(y[differ], exact[differ])
        if wrong:
            i = differ[wrong[0]]
            print(f"  MISMATCH {op}({x[i]!r}) = {y[i]!r}, expected {exact[i]!r}")
        worst, other, total = max(worst, error), other + differ.size, total + x.size
    print(f"{op:6} {worst:16.4f} {other:12d}   (every float32: {total} inputs, x86-64-v3 vectors)")


def build(out: Path) -> None:
    """The CUDA kernels of every op, as the cuda backend compiles them, into `out`."""
    from mlir import ir

    from hexir.backend import cuda
    from hexir.dialects import make_context

    body = "".join(_gpu_kernel(op, t) for op in OPS for t in ("f32", "f64"))
    with make_context():
        module = ir.Module.parse("module attributes {gpu.container_module} {gpu.module @hexir_cuda {" + body + "}}")
        binary = cuda.compile_kernels(module, ("sm_80", "sm_90"))
    out.mkdir(parents=True, exist_ok=True)
    for arch, cubin in binary.cubins.items():
        (out / f"{arch}.cubin").write_bytes(cubin)
    (out / f"{binary.ptx[0]}.ptx").write_bytes(binary.ptx[1])
    (out / "kernels.json").write_text(json.dumps({"ops": OPS, "size": SIZE}))
    print(f"built {', '.join(sorted(p.name for p in out.iterdir()))} in {out}")


def cuda_runner(folder: Path, ptx: bool = False):
    """A function running an op's kernel on GPU 0 with the runtime's driver calls, from the CUBIN
    of the GPU's architecture (else, or with `ptx`, the PTX, compiled by the driver)."""
    from hexir_runtime.cuda import CudaDevice, check

    device = CudaDevice()
    driver = device.driver
    major, minor = device.capability
    image = folder / f"sm_{major}{minor}.cubin"
    image = image if image.exists() and not ptx else next(folder.glob("*.ptx"))
    code = image.read_bytes() + (b"\0" if image.suffix == ".ptx" else b"")  # the driver reads PTX as a C string
    module = check(driver.cuModuleLoadData(code), "cuModuleLoadData")
    print(f"{device.name}: {image.name}")

    def run(op: str, x: np.ndarray, p: np.ndarray) -> np.ndarray:
        t = "f32" if x.dtype == np.float32 else "f64"
        function = check(driver.cuModuleGetFunction(module, f"{op}_{t}".encode()), "cuModuleGetFunction")
        buffers = [device.alloc((SIZE,), x.dtype) for _ in range(3)]
        device.copy_in(buffers[0], np.resize(x, SIZE))
        device.copy_in(buffers[1], np.resize(p, SIZE))
        values = (ctypes.c_uint64 * 4)(*(int(b.pointer) for b in buffers), x.size)
        params = (ctypes.c_void_p * 4)(*(ctypes.addressof(values) + 8 * i for i in range(4)))
        check(driver.cuLaunchKernel(function, (x.size + 255) // 256, 1, 1, 256, 1, 1, 0, 0,
                                    ctypes.addressof(params), 0), "cuLaunchKernel")
        device.synchronize()
        y = device.copy_out(buffers[2])[: x.size]
        for buffer in buffers:
            device.free(buffer)
        return y

    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", nargs="?", choices=("cpu", "build", "run"), default="cpu")
    parser.add_argument("folder", nargs="?", type=Path)
    parser.add_argument("--points", type=int, default=1 << 20, help="grid and random points per op and dtype")
    parser.add_argument("--ptx", action="store_true", help="run: load the PTX, not the GPU's CUBIN")
    parser.add_argument("--speed", action="store_true", help="cpu: time the vector kernels against numpy")
    parser.add_argument("--exhaustive", metavar="OPS", help="cpu: every float32 input of these ops (exp,log,tanh)")
    args = parser.parse_args()
    if args.action == "build":
        build(args.folder)
        return 0
    if args.action == "run":
        return 0 if report("cuda", cuda_runner(args.folder, args.ptx), args.points) else 1
    ok = True
    for level in ("x86-64-v3",) if args.exhaustive or args.speed else ("x86-64-v3", "x86-64"):
        library = cpu_library(level)
        if args.speed:
            speed(library)
            continue
        if args.exhaustive:
            print(f"{'op':6} {'float32 max ulp':>16} {'not nearest':>12}")
            for op in args.exhaustive.split(","):
                exhaustive(library, op)
            return 0
        for widths, what in (((16, 8), "vectors"), ((1, 1), "scalars")):
            def run(op, x, p, widths=widths, library=library):
                return run_cpu(library, op, widths[x.dtype == np.float64], x, p)
            ok &= report(f"cpu {level}, {what}", run, args.points)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
