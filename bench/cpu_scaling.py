"""The cpu linear kernel's own scaling over cores: raw threads, a thread pool, and the runtime's
launch, on the same kernel (is the pool the limit, or the kernel?).

    python bench/cpu_scaling.py build DIR      # here (needs hexir)
    PYTHONPATH=runtime python bench/cpu_scaling.py run DIR    # on the machine to measure
"""

# ruff: noqa: B023 - every closure below is timed at once, inside the iteration that made it
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

SIZES = (1024, 2048)


def build(out: Path) -> None:
    os.environ["HEXIR_CACHE_DIR"] = ""
    import hexir

    out.mkdir(parents=True, exist_ok=True)
    for n in SIZES:
        f = hexir.jit(lambda x, w: hexir.linear(x, w), target="cpu:x86-64-v4,cpu:x86-64-v3,cpu:x86-64")
        (out / f"l{n}.hxb").write_bytes(f.compile(hexir.TensorSpec((n, n), "float32"),
                                                  hexir.TensorSpec((n, n), "float32")))


def timed(f, repeats: int = 5) -> float:
    f()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(folder: Path) -> None:
    from hexir_runtime.cpu import CpuDevice
    from hexir_runtime.format import evaluate, read

    for n in SIZES:
        hxb = read(folder / f"l{n}.hxb")
        function, work, _ = CpuDevice().load(hxb).kernels[0]
        x, w = np.random.rand(n, n).astype(np.float32), np.random.rand(n, n).astype(np.float32)
        out = np.empty((n, n), np.float32)
        args, extent, flops = [x.ctypes.data, w.ctypes.data, out.ctypes.data], evaluate(work.extent, {}), 2 * n**3
        print(f"n={n} extent {extent}: 1 thread {flops / timed(lambda: function(*args, 0, extent)) / 1e9:.0f} GF/s")
        for threads in (2, 4, 8, 16):
            bounds = [extent * i // threads for i in range(threads + 1)]

            def raw():
                started = [threading.Thread(target=function, args=(*args, bounds[i], bounds[i + 1]))
                           for i in range(threads)]
                for thread in started:
                    thread.start()
                for thread in started:
                    thread.join()
            pool = ThreadPoolExecutor(threads)

            def pooled():
                for future in [pool.submit(function, *args, bounds[i], bounds[i + 1]) for i in range(threads)]:
                    future.result()
            program = CpuDevice(threads=threads).load(hxb)
            launched = timed(lambda program=program: program.launch(0, [x, w, out], {}))
            print(f"  {threads:2d} threads: raw {flops / timed(raw) / 1e9:6.0f} GF/s, pool "
                  f"{flops / timed(pooled) / 1e9:6.0f}, launch {flops / launched / 1e9:6.0f}")


if __name__ == "__main__":
    (build if sys.argv[1] == "build" else run)(Path(sys.argv[2]))
