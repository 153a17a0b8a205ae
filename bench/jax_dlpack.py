"""#26 on the GPU machine: jax bfloat16/float16 arrays in and out of hexir modules through DLPack
(jax arrays on the GPU and on the host in; `outputs="device"` taken by `jnp.from_dlpack`; numpy
out equal to it), checked against float64 products within 2^-bits * sqrt(K) of the largest.
Reads the tensor-core modules that `ONLY=r7 bash bench/gpu_build.sh` packs in .gpu/tc.tar.xz:

    PYTHONPATH=.gpu/runtime python bench/jax_dlpack.py
"""

import os
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # (before jax is imported)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from hexir_runtime import load  # noqa: E402

CASES = [("linear_1000x1024x33_bfloat16_highest_sm_90a", (1000, 1024, 33), jnp.bfloat16, 8),
         ("linear_4096x4096x4096_float16_highest_sm_90", (4096, 4096, 4096), jnp.float16, 11)]


def main() -> int:
    folder = Path(tempfile.mkdtemp())
    with tarfile.open(".gpu/tc.tar.xz") as archive:
        wanted = [m for m in archive.getmembers() if any(m.name.endswith(f"{name}.hxb") for name, *_ in CASES)]
        archive.extractall(folder, members=wanted, filter="data")
    print("jax", jax.__version__, jax.devices())
    failures = 0
    for name, (m, k, n), dtype, bits in CASES:
        module = load(folder / "tc" / f"{name}.hxb", "cuda")
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32), dtype)
        w = jnp.asarray(rng.standard_normal((k, n)).astype(np.float32), dtype)
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        bound = 2.0**-bits * np.sqrt(k) * np.abs(want).max()
        for where in ("gpu", "cpu"):
            device = jax.devices(where)[0]
            xd, wd = jax.device_put(x, device), jax.device_put(w, device)
            got = jnp.from_dlpack(module.main(xd, wd, outputs="device"))
            values = np.asarray(jax.device_get(got), np.float64)
            error = float(np.abs(values - want).max())
            same = bool((np.asarray(module.main(xd, wd), np.float64) == values).all())
            ok = got.dtype == dtype and got.shape == (m, n) and error <= bound and same
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {name}: jax {jnp.dtype(dtype).name} arrays on the {where} in, "
                  f"jnp.from_dlpack of the output: {got.dtype}{list(got.shape)} on {list(got.devices())[0]}, "
                  f"max error {error:.2e} (bound {bound:.2e}); numpy out equal: {same}")
        module.close()
    return failures


if __name__ == "__main__":
    sys.exit(main())
