"""The jit call path: a `@hexir.jit` call on a 2x8 -> 16 -> 4 MLP, against `module.main` alone and
numpy's own expression, best of 5 rounds of 10,000 calls each (the function is compiled first).

    python bench/jit_call.py [--profile]

What the jit layer adds is `jit call - module.main`: binding the arguments, the key, a dict
lookup. `--profile` prints cProfile's top functions for 10,000 jit calls.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import numpy as np

import hexir

rng = np.random.default_rng(0)
W1 = rng.random((8, 16), dtype=np.float32)
W2 = rng.random((16, 4), dtype=np.float32)


@hexir.jit(cache=False)
def mlp(x):
    return hexir.linear(hexir.relu(hexir.linear(x, W1)), W2)


def best(call, calls: int = 10_000, rounds: int = 5) -> float:
    """Microseconds per call, the best round."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return min(times)


if __name__ == "__main__":
    x = rng.random((2, 8), dtype=np.float32)
    mlp(x)
    main = hexir.jit.__globals__["hexir_runtime"].load(mlp.compile(x)).main
    jit, runtime = best(lambda: mlp(x)), best(lambda: main(x))
    numpy = best(lambda: np.maximum(x @ W1, 0) @ W2)
    print(f"jit call     {jit:7.2f} us")
    print(f"module.main  {runtime:7.2f} us   (jit layer: {jit - runtime:.2f} us)")
    print(f"numpy        {numpy:7.2f} us   (jit call / numpy: {jit / numpy:.1f}x)")
    if "--profile" in sys.argv:
        cProfile.run("for _ in range(10_000): mlp(x)", "/tmp/jit_call.prof")
        pstats.Stats("/tmp/jit_call.prof").sort_stats("tottime").print_stats(10)
