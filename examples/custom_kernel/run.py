"""A hand-written kernel (relu6, in CUDA and in C) between two compiler-generated linears.

    python examples/custom_kernel/run.py [FOLDER]   # builds, runs (GPU if present, else CPU), checks;
                                                    # writes custom.hxb, x.npy, expected.npy next to itself

The .cu is compiled with NVRTC and the .c with the system C compiler when the module is
built; both are embedded in custom.hxb, which `hexir-run --info custom.hxb` describes.
"""

import sys
from pathlib import Path

import numpy as np

import hexir

rng = np.random.default_rng(2)
W1 = rng.standard_normal((16, 64)).astype(np.float32) * 2
W2 = rng.standard_normal((64, 8)).astype(np.float32)

relu6 = hexir.kernel(
    "relu6",
    cuda="kernels/relu6.cu",
    cpu="kernels/relu6.c",
    out=lambda x: hexir.TensorSpec(x.shape, x.dtype),
    grid=lambda x: ((x.shape[0] * x.shape[1] + 255) // 256, 1, 1),
    block=(256, 1, 1),
)


@hexir.jit
def model(x):
    with hexir.on("cuda"):
        h = relu6(hexir.linear(x, W1))       # generated GPU kernel, then the hand-written one
        return hexir.linear(h, W2)


def numpy_model(x):
    return np.clip(x @ W1, 0, 6) @ W2


if __name__ == "__main__":
    x = rng.standard_normal((32, 16)).astype(np.float32)
    y = model(x)
    np.testing.assert_allclose(y, numpy_model(x), rtol=1e-4, atol=1e-4)
    print(f"matches numpy: max abs difference {np.abs(y - numpy_model(x)).max():.2e}")
    here = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
    hexir.export(model, here / "custom.hxb", x)
    np.save(here / "x.npy", x)
    np.save(here / "expected.npy", numpy_model(x))
    print(f"wrote {here / 'custom.hxb'}")
