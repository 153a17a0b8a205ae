"""A two-layer perceptron: trace, compile and run it with hexir, then check it against numpy.

    python examples/mlp.py            # runs it, prints the output and the check
"""

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
    x = rng.random((2, 8), dtype=np.float32)
    y = mlp(x)
    expected = np.maximum(x @ W1, 0) @ W2
    np.testing.assert_allclose(y, expected, rtol=1e-5)
    print(f"matches numpy: max abs difference {np.abs(y - expected).max():.2e}")
    path = hexir.export(mlp, "mlp.hxb", hexir.TensorSpec((2, 8), "float32"))
    np.save("x.npy", x)
    print(f"wrote {path}; run it with: hexir-run {path} --input x=x.npy")
