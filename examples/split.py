"""Split placement: the first layer on the GPU, the rest on the CPU, one .hxb for both.

    python examples/split.py [FOLDER]   # runs on the GPU if there is one, else on the CPU twins;
                                        # writes split.hxb and split_x.npy next to itself (or in FOLDER)

The compiler inserts the transfers (see `hexir examples/split.py:mlp -spec=x=4x8xf32
-emit=mlir-hetero`), and the module carries CUBIN + PTX for the GPU kernel and a CPU
version of it, so `hexir-run --device=cpu split.hxb` runs anywhere.
"""

import os
import sys
from pathlib import Path

import numpy as np

import hexir

rng = np.random.default_rng(1)
W1 = rng.standard_normal((8, 16)).astype(np.float32)
W2 = rng.standard_normal((16, 4)).astype(np.float32)
B2 = rng.standard_normal(4).astype(np.float32)


@hexir.jit
def mlp(x):
    with hexir.on("cuda"):
        h = hexir.linear(x, W1)      # GPU kernel
    r = hexir.relu(h)                # CPU kernel; transfers inserted around it
    y = hexir.linear(r, W2, B2)
    hexir.print(y)
    return y


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
    x = rng.standard_normal((4, 8)).astype(np.float32)
    y = mlp(x)
    expected = np.maximum(x @ W1, 0) @ W2 + B2
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    print(f"matches numpy: max abs difference {np.abs(y - expected).max():.2e}")
    path = hexir.export(mlp, out / "split.hxb", x)
    np.save(out / "split_x.npy", x)
    here = os.path.relpath  # paths as the reader would type them
    print(f"wrote {here(path)}; run it with: hexir-run {here(path)} --input x={here(out / 'split_x.npy')}")
