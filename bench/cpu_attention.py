"""Benchmark (#25, round 9): fused attention on the cpu, softmax(q @ kᵀ / sqrt(d) + mask) @ v with a
causal (additive -inf) mask: hexir's fused kernel (recognised from the user's ops) against hexir's
unfused form (kᵀ given, so the three kernels stay: batched matmul, softmax, batched matmul) and
numpy evaluating the same expression (a temporary per op, its matmuls on OpenBLAS), side by side.

    python bench/cpu_attention.py build DIR     # here (hexir): DIR/*.hxb.xz, float32 and float64
    python bench/cpu_attention.py run DIR       # anywhere with hexir_runtime and numpy

The run first checks each module against numpy (float64), then times each shape: wall clock and
the process's CPU time per call (median of --repeats), hexir's cpu threads as many as the
process's affinity allows (`taskset -c 0` for one; OPENBLAS_NUM_THREADS=1 for numpy's), and last
how much one call at seq 4096 raises a fresh process's peak resident memory, fused and unfused:
the fused kernel holds no [seq, seq] scores.

    python bench/cpu_attention.py memory DIR fused|unfused   # (the run's child process)
"""

from __future__ import annotations

import argparse
import lzma
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

#: [batch, heads, seq, d] timed, per dtype
SHAPES = ((8, 12, 512, 64), (8, 12, 512, 128), (2, 12, 1024, 64), (2, 12, 1024, 128))
LONG = (1, 4, 4096, 64)  # the memory row (float32)
DTYPES = ("float32", "float64")


def attention(hexir, scale: float, transposed: bool):
    def fused(q, k, v, mask):
        kt = k if transposed else k.transpose(0, 1, 3, 2)
        return hexir.softmax(q @ kt * scale + mask, axis=-1) @ v
    return fused


def numpy_attention(q, k, v, mask, scale):
    scores = q @ np.swapaxes(k, -1, -2) * q.dtype.type(scale) + mask
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return (weights / weights.sum(-1, keepdims=True)) @ v


def _tag(shape, dtype: str) -> str:
    return f"{'x'.join(map(str, shape))}-{dtype}"


def build(out: Path) -> None:
    os.environ["HEXIR_CACHE_DIR"] = ""  # (a schedule being tuned: no cached kernels)
    import hexir
    out.mkdir(parents=True, exist_ok=True)
    rows = [(shape, dtype) for dtype in DTYPES for shape in SHAPES] + [(LONG, "float32")]
    for shape, dtype in rows:
        b, h, s, d = shape
        for kind in ("fused", "unfused"):
            started = time.perf_counter()
            k_shape = (b, h, d, s) if kind == "unfused" else shape
            specs = [hexir.TensorSpec(x, dtype) for x in (shape, k_shape, shape, (s, s))]
            path = out / f"{kind}-{_tag(shape, dtype)}.hxb"
            hexir.export(attention(hexir, 1 / np.sqrt(d), kind == "unfused"), path, *specs, placement="*=cpu")
            (out / f"{path.name}.xz").write_bytes(lzma.compress(path.read_bytes(), preset=6))
            path.unlink()
            print(f"built {path.name} in {time.perf_counter() - started:.1f} s", flush=True)


def _load(hexir_runtime, directory: Path, name: str):
    return hexir_runtime.load(lzma.decompress((directory / f"{name}.hxb.xz").read_bytes()), "cpu")


def _time(fn, repeats: int) -> tuple[float, float]:
    """(wall, CPU) seconds per call, medians."""
    fn()
    walls, cpus = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return statistics.median(walls), statistics.median(cpus)


def _inputs(shape, dtype: str, rng):
    q, k, v = (rng.standard_normal(shape).astype(dtype) for _ in range(3))
    s = shape[2]
    return q, k, v, np.triu(np.full((s, s), -np.inf, dtype), k=1)


def _compare(hexir_runtime, directory: Path, shape, dtype: str, rng, repeats: int) -> int:
    """One row: fused, unfused, numpy; 1 if hexir's results are off."""
    q, k, v, mask = _inputs(shape, dtype, rng)
    kt = np.ascontiguousarray(np.swapaxes(k, -1, -2))
    fused, unfused = (_load(hexir_runtime, directory, f"{kind}-{_tag(shape, dtype)}") for kind in ("fused", "unfused"))
    scale = 1 / np.sqrt(shape[-1])
    want = numpy_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), mask, scale)
    error = max(float(np.abs(got - want).max() / np.abs(want).max())
                for got in (fused.main(q, k, v, mask), unfused.main(q, kt, v, mask)))
    bad = error > (1e-4 if dtype == "float32" else 1e-10)
    times = [_time(lambda: numpy_attention(q, k, v, mask, scale), repeats)]
    times += [_time(lambda m=m, key=key: m.main(q, key, v, mask), repeats) for m, key in ((unfused, kt), (fused, k))]
    (nw, nc), (uw, uc), (fw, fc) = times
    print(f"{'x'.join(map(str, shape)):>16} {dtype:>8} {fw * 1e3:9.2f} {uw * 1e3:10.2f} {nw * 1e3:9.2f} "
          f"{uw / fw:9.2f} {nw / fw:8.2f} {fc * 1e3:9.1f} {uc * 1e3:8.1f} {nc * 1e3:7.1f} {error:8.1e}"
          f"{'  WRONG' if bad else ''}", flush=True)
    fused.close()
    unfused.close()
    return int(bad)


def run(directory: Path, repeats: int, dtypes: list[str], memory: bool = True) -> int:
    import hexir_runtime
    rng, failures = np.random.default_rng(0), 0
    print(f"hexir cpu threads: {len(os.sched_getaffinity(0))}; OPENBLAS_NUM_THREADS="
          f"{os.environ.get('OPENBLAS_NUM_THREADS', '(unset)')}; median of {repeats}; causal mask")
    print(f"{'shape':>16} {'dtype':>8} {'fused ms':>9} {'unfused ms':>10} {'numpy ms':>9} {'unf/fused':>9} "
          f"{'np/fused':>8} {'fused cpu':>9} {'unf cpu':>8} {'np cpu':>7} {'error':>8}")
    for dtype in dtypes:
        for shape in SHAPES:
            if (directory / f"fused-{_tag(shape, dtype)}.hxb.xz").exists():
                failures += _compare(hexir_runtime, directory, shape, dtype, rng, repeats)
    if memory and (directory / f"fused-{_tag(LONG, 'float32')}.hxb.xz").exists():
        grown = [subprocess.run([sys.executable, __file__, "memory", str(directory), kind], check=True, text=True,
                                capture_output=True).stdout.strip() for kind in ("fused", "unfused")]
        print(f"seq 4096 {'x'.join(map(str, LONG))} float32, the peak resident memory a call adds (a process "
              f"each): fused {grown[0]} MiB, unfused {grown[1]} MiB (the scores alone: "
              f"{LONG[0] * LONG[1] * LONG[2] ** 2 * 4 / 2**20:.0f} MiB)")
    print(f"failures: {failures}")
    return int(failures > 0)


def _status(field: str) -> float:
    """A field of /proc/self/status in MiB (VmRSS: resident now; VmHWM: its peak since the last reset)."""
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) / 1024


def memory(directory: Path, kind: str) -> None:
    """Print by how much one call of the seq-4096 module takes this process's peak resident memory
    past what it holds before the call (MiB). (Not getrusage's ru_maxrss: a child starts with its
    parent's.)"""
    import hexir_runtime
    q, k, v, mask = _inputs(LONG, "float32", np.random.default_rng(0))
    key = np.ascontiguousarray(np.swapaxes(k, -1, -2)) if kind == "unfused" else k
    module = _load(hexir_runtime, directory, f"{kind}-{_tag(LONG, 'float32')}")
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) from now
    before = _status("VmRSS")
    module.main(q, key, v, mask)
    print(f"{_status('VmHWM') - before:.0f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("build", "run", "memory"))
    parser.add_argument("dir", type=Path)
    parser.add_argument("kind", nargs="?", default="fused", help="memory: fused or unfused")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtypes", nargs="*", default=list(DTYPES), help="run: the dtypes timed")
    parser.add_argument("--no-memory", action="store_true", help="run: without the seq-4096 memory row")
    args = parser.parse_args(argv)
    if args.action == "build":
        build(args.dir)
        return 0
    if args.action == "memory":
        memory(args.dir, args.kind)
        return 0
    return run(args.dir, args.repeats, args.dtypes, not args.no_memory)


if __name__ == "__main__":
    sys.exit(main())
