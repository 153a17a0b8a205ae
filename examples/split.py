"""Split placement: the first layer on the GPU, the rest on the CPU, one .hxb for both.

    python examples/split.py      # runs on the GPU if there is one, else on the CPU twins

The compiler inserts the transfers (see `hexir examples/split.py:mlp -spec=x=4x8xf32
-emit=mlir-hetero`), and the module carries CUBIN + PTX for the GPU kernel and a CPU
version of it, so `hexir-run --device=cpu split.hxb` runs anywhere.
"""

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
    x = rng.standard_normal((4, 8)).astype(np.float32)
    y = mlp(x)
    expected = np.maximum(x @ W1, 0) @ W2 + B2
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    print(f"matches numpy: max abs difference {np.abs(y - expected).max():.2e}")
    hexir.export(mlp, "split.hxb", x)
    np.save("x.npy", x)
    print("wrote split.hxb; run it with: hexir-run split.hxb --input x=x.npy")
