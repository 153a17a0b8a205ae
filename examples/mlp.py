"""A two-layer perceptron: trace, compile and run it with hexir, check it against numpy, and
export one module for every batch size.

    python examples/mlp.py [FOLDER]   # writes mlp.hxb, mlp_x2.npy, mlp_x5.npy next to itself (or in FOLDER)
    hexir-run examples/mlp.hxb --input x=examples/mlp_x5.npy
"""

import os
import sys
from pathlib import Path

import numpy as np

import hexir

rng = np.random.default_rng(0)
W1 = rng.random((8, 16), dtype=np.float32)
W2 = rng.random((16, 4), dtype=np.float32)


@hexir.jit
def mlp(x):
    h = hexir.relu(hexir.linear(x, W1))
    y = hexir.linear(h, W2)
    hexir.print(y)
    return y


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
    x = rng.random((2, 8), dtype=np.float32)
    y = mlp(x)
    expected = np.maximum(x @ W1, 0) @ W2
    np.testing.assert_allclose(y, expected, rtol=1e-5)
    print(f"matches numpy: max abs difference {np.abs(y - expected).max():.2e}")
    # one module for every batch size: the leading extent is the symbol "batch"
    path = hexir.export(mlp, out / "mlp.hxb", hexir.TensorSpec(("batch", 8), "float32"))
    np.save(out / "mlp_x2.npy", x)
    np.save(out / "mlp_x5.npy", rng.random((5, 8), dtype=np.float32))
    here = os.path.relpath  # paths as the reader would type them
    print(f"wrote {here(path)}; run it with: hexir-run {here(path)} --input x={here(out / 'mlp_x2.npy')}")
