"""Export the v1 test modules of tests/data (see README.md) with the compiler at commit a35bbb6."""
import sys

import numpy as np

import hexir

out = sys.argv[1]
rng = np.random.default_rng(0)
W1 = rng.random((8, 16), dtype=np.float32)
W2 = rng.random((16, 4), dtype=np.float32)


@hexir.jit
def mlp(x):
    h = hexir.relu(hexir.linear(x, W1))
    y = hexir.linear(h, W2)
    hexir.print(y)
    return y


x = rng.random((2, 8), dtype=np.float32)
hexir.export(mlp, f"{out}/mlp_v1.hxb", hexir.TensorSpec((2, 8), "float32"))
np.save(f"{out}/mlp_v1_x.npy", x)
np.save(f"{out}/mlp_v1_y.npy", np.maximum(x @ W1, 0) @ W2)

rng = np.random.default_rng(1)
V1 = rng.standard_normal((8, 16)).astype(np.float32)
V2 = rng.standard_normal((16, 4)).astype(np.float32)
B2 = rng.standard_normal(4).astype(np.float32)


@hexir.jit
def split(x):
    with hexir.on("cuda"):
        h = hexir.linear(x, V1)
    r = hexir.relu(h)
    y = hexir.linear(r, V2, B2)
    hexir.print(y)
    return y


x = rng.standard_normal((4, 8)).astype(np.float32)
hexir.export(split, f"{out}/split_v1.hxb", hexir.TensorSpec((4, 8), "float32"))
np.save(f"{out}/split_v1_x.npy", x)
np.save(f"{out}/split_v1_y.npy", np.maximum(x @ V1, 0) @ V2 + B2)
