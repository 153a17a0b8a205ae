"""What a user's call costs beyond its kernel, per module of bench/linear.py's h29 table (numpy in,
new array out, the call as bench/linear.py times it): minor page faults per call (the kernel
running), and the Python of a call alone (the foreign call of the kernels replaced by a no-op:
argument checks, plan lookup, output recycling, addresses), median of 15 x 200 calls.

    python bench/call_parts.py DIR[.tar.xz] [64x784x512,96x128x64x128]   # bench/linear.py build's cpu modules
"""
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent / "bench")]  # in bench/, or beside it
import linear  # noqa: E402
from hexir_runtime import cpu, load  # noqa: E402

modules = linear.unpacked(Path(sys.argv[1]))
rows = json.loads((modules / "modules.json").read_text())
keep = sys.argv[2].split(",") if len(sys.argv) > 2 else None
real = cpu.Batch.run
print(f"{'module':>36} {'faults/call':>11} {'python us (wall)':>16} {'python us (cpu)':>15}")
for row in rows:
    if keep and linear.product(row) not in keep:
        continue
    x, w, _ = linear.operands(row, np.random.default_rng(0))
    module = load(modules / f"{row['name']}.hxb", "cpu")
    for _ in range(3):
        module.main(x, w)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        module.main(x, w)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10
    cpu.Batch.run = lambda self: True
    try:
        walls, cpus = [], []
        for _ in range(15):
            started, thread = time.perf_counter(), time.thread_time()
            for _ in range(200):
                module.main(x, w)
            walls.append((time.perf_counter() - started) / 200)
            cpus.append((time.thread_time() - thread) / 200)
    finally:
        cpu.Batch.run = real
    print(f"{row['name']:>36} {faults:11.1f} {statistics.median(walls) * 1e6:16.1f} "
          f"{statistics.median(cpus) * 1e6:15.1f}")
    module.close()
