"""The compile cache across processes: the README's MLP, first call in a fresh process.

    python bench/cache.py [--runs N]

Process 1 starts with an empty cache folder and compiles; each later process (N of them)
finds the module on disk. Each process reports `import numpy` and `import hexir` apart, its
first call (trace + cache lookup + load + run) and, within it, the time in
`hexir.cache.compile_cached` (key, folder and tag checks, read: or the compile), and a second
call. A last process with the cache off shows what the cache saves.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROGRAM = """
import json, time
started = time.perf_counter()
import numpy as np
numpy_imported = time.perf_counter()
import hexir
imported = time.perf_counter()
import hexir.cache as cache
spent = []
original = cache.compile_cached
def timed(*args):
    begin = time.perf_counter()
    try:
        return original(*args)
    finally:
        spent.append(time.perf_counter() - begin)
cache.compile_cached = timed
rng = np.random.default_rng(0)
W1, W2 = rng.random((8, 16), dtype=np.float32), rng.random((16, 4), dtype=np.float32)

@hexir.jit
def mlp(x):
    h = hexir.relu(hexir.linear(x, W1))
    y = hexir.linear(h, W2)
    return y

x = rng.random((2, 8), dtype=np.float32)
begin = time.perf_counter()
mlp(x)
first = time.perf_counter()
mlp(x)
second = time.perf_counter()
print(json.dumps({"numpy": numpy_imported - started, "import": imported - numpy_imported, "first": first - begin,
                  "cache": sum(spent), "second": second - first}))
"""


def process(folder: str) -> dict[str, float]:
    path = os.pathsep.join([str(REPO), str(REPO / "runtime"), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": path, "HEXIR_CACHE_DIR": folder})
    return json.loads(done.stdout)


def show(name: str, times: dict[str, float]) -> None:
    print(f"{name:<28} import numpy {times['numpy'] * 1e3:6.1f} ms  import hexir {times['import'] * 1e3:7.1f} ms  "
          f"first call {times['first'] * 1e3:7.1f} ms (cache {times['cache'] * 1e3:6.1f} ms)  "
          f"second call {times['second'] * 1e6:6.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="later processes (default 10)")
    runs = parser.parse_args().runs
    with tempfile.TemporaryDirectory() as folder:
        show("process 1 (empty cache)", process(folder))
        later = [process(folder) for _ in range(runs)]
        for i, times in enumerate(later[:3]):
            show(f"process {i + 2} (cache hit)", times)
        median = {k: statistics.median(t[k] for t in later) for k in later[0]}
        show(f"median of {runs} hit processes", median)
        for what, name in (("import", "import hexir"), ("first", "first call with a hit")):
            times = sorted(t[what] * 1e3 for t in later)
            print(f"{name}: fastest {times[0]:.1f} ms, slowest {times[-1]:.1f} ms")
    show("cache off (HEXIR_CACHE_DIR=)", process(""))


if __name__ == "__main__":
    main()
