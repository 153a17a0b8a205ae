"""End to end: trace -> compile -> .hxb -> run with hexir_runtime, compared with numpy.

Both ways in: calling the @hexir.jit function, and exporting an .hxb that
`hexir_runtime.load(path).main(x)` runs. The numpy `reference` device of the runtime is the
second oracle; a multi-threaded cpu device checks the kernels' [first, last) work ranges."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import hexir

hexir_runtime = pytest.importorskip("hexir_runtime")
if not hasattr(hexir_runtime, "load"):
    pytest.skip("hexir_runtime.load is not there yet", allow_module_level=True)

TOLERANCE = {"float32": {"rtol": 2e-5, "atol": 1e-5}, "float64": {"rtol": 1e-12, "atol": 1e-12}}


def two_layers(dtype: str, k: int = 8, hidden: int = 16, n: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((k, hidden)).astype(dtype)
    b1 = rng.standard_normal(hidden).astype(dtype)
    w2 = rng.standard_normal((hidden, n)).astype(dtype)

    @hexir.jit
    def mlp(x):
        h = hexir.relu(hexir.linear(x, w1, b1))
        return hexir.linear(h, w2)

    def expected(x):
        return np.maximum(x @ w1 + b1, 0) @ w2

    return mlp, expected


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_jit_call_matches_numpy(dtype):
    mlp, expected = two_layers(dtype)
    x = np.random.default_rng(1).standard_normal((3, 8)).astype(dtype)
    y = mlp(x)
    assert y.dtype == np.dtype(dtype) and y.shape == (3, 4)
    np.testing.assert_allclose(y, expected(x), **TOLERANCE[dtype])
    np.testing.assert_allclose(mlp(-x), expected(-x), **TOLERANCE[dtype])
    assert mlp.trace_count == 1


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_exported_module_matches_numpy(dtype, tmp_path):
    mlp, expected = two_layers(dtype, seed=2)
    x = np.random.default_rng(3).standard_normal((5, 8)).astype(dtype)
    path = hexir.export(mlp, tmp_path / "mlp.hxb", hexir.TensorSpec((5, 8), dtype))
    module = hexir_runtime.load(path)
    np.testing.assert_allclose(module.main(x), expected(x), **TOLERANCE[dtype])
    reference = hexir_runtime.load(path, device="reference")
    np.testing.assert_allclose(module.main(x), reference.main(x), **TOLERANCE[dtype])


def test_threads_split_the_rows_correctly(tmp_path):
    from hexir_runtime.cpu import CpuDevice

    mlp, expected = two_layers("float64", k=5, hidden=7, n=3, seed=4)
    x = np.random.default_rng(5).standard_normal((37, 5))
    path = hexir.export(mlp, tmp_path / "mlp.hxb", x)
    # split_bytes=0: split every launch, however small (by default only launches of 1 MiB or more
    # are, and these are a few KiB): 37 rows, in linear's blocks of CPU_ROWS, split unevenly over 4 threads
    module = hexir_runtime.load(path, device=CpuDevice(threads=4, split_bytes=0))
    np.testing.assert_allclose(module.main(x), expected(x), **TOLERANCE["float64"])


def test_print_uses_the_c_format(capfd):
    w = np.array([[1.0, -2.0], [0.5, 0.25]], dtype=np.float32)

    @hexir.jit
    def f(x):
        y = hexir.relu(hexir.linear(x, w))
        hexir.print(y)
        return y

    f(np.array([[1.0, 2.0], [-3.0, 4.0]], dtype=np.float32))
    assert capfd.readouterr().out == "2.000000 0.000000 \n0.000000 7.000000 \n"


finite = {"float32": st.floats(-100, 100, width=32), "float64": st.floats(-1e6, 1e6)}


@st.composite
def problems(draw):
    dtype = draw(st.sampled_from(["float32", "float64"]))
    m, k, n = (draw(st.integers(1, 24)) for _ in range(3))
    x = draw(hnp.arrays(dtype, (m, k), elements=finite[dtype]))
    w = draw(hnp.arrays(dtype, (k, n), elements=finite[dtype]))
    b = draw(st.none() | hnp.arrays(dtype, (n,), elements=finite[dtype]))
    return x, w, b


@settings(max_examples=10, deadline=None)
@given(problems())
def test_linear_relu_matches_numpy_for_any_shape_and_values(problem):
    x, w, b = problem

    @hexir.jit
    def layer(x):
        return hexir.relu(hexir.linear(x, w, b))

    expected = np.maximum(x.astype(np.float64) @ w.astype(np.float64) + (0 if b is None else b), 0)
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64) + (0 if b is None else np.abs(b)) + 1
    error = np.abs(layer(x).astype(np.float64) - expected)
    epsilon = np.finfo(x.dtype).eps
    assert (error <= 4 * x.shape[1] * epsilon * scale).all()
