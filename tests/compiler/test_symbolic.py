"""A symbolic batch: one module for every batch size, from TensorSpec to hexir-run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hexir_runtime import DeviceError, InputError, load
from hypothesis import given, settings
from hypothesis import strategies as st

import hexir
from hexir.driver import Options, run_stage
from hexir.jit import JitFunction

REPO = Path(__file__).resolve().parents[2]
RNG = np.random.default_rng(7)
W1 = {d: RNG.standard_normal((8, 16)).astype(d) for d in ("float32", "float64")}
B1 = {d: RNG.standard_normal(16).astype(d) for d in ("float32", "float64")}
W2 = {d: RNG.standard_normal((16, 4)).astype(d) for d in ("float32", "float64")}


def mlp_of(dtype: str):
    def mlp(x):
        return hexir.linear(hexir.relu(hexir.linear(x, W1[dtype], B1[dtype])), W2[dtype])
    return mlp


def expected(x: np.ndarray) -> np.ndarray:
    d = x.dtype.name
    return np.maximum(x @ W1[d] + B1[d], 0) @ W2[d]


@pytest.fixture(scope="module", params=["float32", "float64"])
def exported(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("symbolic") / f"mlp-{request.param}.hxb"
    hexir.export(mlp_of(request.param), path, hexir.TensorSpec(("batch", 8), request.param),
                 placement="hexir.linear=cuda")  # cuda kernels, run here as their cpu twins
    return path, request.param


@pytest.mark.parametrize("batch", [0, 1, 2, 7, 1000])
def test_one_module_runs_every_batch_size(exported, batch):
    path, dtype = exported
    module = load(path, "cpu")
    x = RNG.standard_normal((batch, 8)).astype(dtype)
    y = module.main(x)
    assert y.shape == (batch, 4) and y.dtype == dtype
    np.testing.assert_allclose(y, expected(x), rtol=1e-4 if dtype == "float32" else 1e-10, atol=1e-4)
    np.testing.assert_allclose(load(path, "reference").main(x), expected(x), rtol=1e-4, atol=1e-4)


def test_hexir_run_takes_two_batch_sizes_of_one_file(exported, tmp_path):
    path, dtype = exported
    for batch in (3, 5):
        x = RNG.standard_normal((batch, 8)).astype(dtype)
        np.save(tmp_path / "x.npy", x)
        result = subprocess.run([sys.executable, "-m", "hexir_runtime", str(path), "--device=cpu", "--input",
                                 f"x={tmp_path / 'x.npy'}", "--output", str(tmp_path / "y.npz")],
                                capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        np.testing.assert_allclose(np.load(tmp_path / "y.npz")["output0"], expected(x), rtol=1e-4, atol=1e-4)
    info = subprocess.run([sys.executable, "-m", "hexir_runtime", str(path), "--info"], capture_output=True, text=True)
    assert f"main(x: {dtype}[batch, 8]) -> {dtype}[batch, 4]" in info.stdout


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(0, 600))
def test_any_batch_drawn_per_call_matches_numpy(batch):
    module = _module_f32()
    x = np.random.default_rng(batch).standard_normal((batch, 8)).astype(np.float32)
    np.testing.assert_allclose(module.main(x), expected(x), rtol=1e-4, atol=1e-4)


_modules: list = []


def _module_f32():
    if not _modules:  # one compile for every example
        _modules.append(load(hexir.jit(mlp_of("float32")).compile(hexir.TensorSpec((None, 8), "float32"))))
    return _modules[0]


def test_jit_compiles_at_most_twice_for_fifty_batch_sizes():
    jitted = hexir.jit(mlp_of("float32"))
    for batch in range(1, 51):
        x = RNG.standard_normal((batch, 8)).astype(np.float32)
        np.testing.assert_allclose(jitted(x), expected(x), rtol=1e-4, atol=1e-4)
    assert jitted.trace_count == 2


@pytest.mark.parametrize(("dynamic", "traces"), [(True, 1), (False, 3)])
def test_jit_dynamic_option(dynamic, traces):
    jitted = hexir.jit(mlp_of("float64"), dynamic=dynamic)
    for batch in (1, 2, 3, 2, 1):
        x = RNG.standard_normal((batch, 8))
        np.testing.assert_allclose(jitted(x), expected(x), rtol=1e-10)
    assert jitted.trace_count == traces


def test_jit_gives_inputs_of_different_leading_sizes_their_own_symbols():
    """At the switch to a symbolic batch, inputs whose leading sizes differ get a symbol each
    (`batch`, `batch_1`): that module then serves every later pair of different sizes."""
    def two(x, y):
        return hexir.linear(x, W1["float32"]), hexir.relu(y)
    jitted = hexir.jit(two)
    for rows in ((2, 3), (5, 7), (7, 5), (1, 6), (3, 2)):
        x, y = (RNG.standard_normal((n, 8)).astype(np.float32) for n in rows)
        got_x, got_y = jitted(x, y)
        np.testing.assert_allclose(got_x, x @ W1["float32"], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(got_y, np.maximum(y, 0))
    assert jitted.trace_count == 2
    _, (symbolic, _) = jitted._compiled.values()  # the first call's module, then the symbolic one
    assert str(symbolic.signature("main")).startswith("main(x: float32[batch, 8], y: float32[batch_1, 8]) ->")


def test_inputs_with_one_symbol_must_agree():
    def add_rows(x, y):
        return hexir.linear(x, W1["float32"]), hexir.linear(y, W1["float32"])
    module = load(hexir.jit(add_rows).compile(hexir.TensorSpec(("n", 8), "float32"),
                                              hexir.TensorSpec(("n", 8), "float32")))
    x, y = np.ones((2, 8), np.float32), np.ones((3, 8), np.float32)
    with pytest.raises(InputError, match=r"'y'.*n = 3.*'x'.*n = 2|'x'.*n = 2.*'y'.*n = 3"):
        module.main(x, y)


def test_the_ir_prints_the_symbol_at_every_stage():
    jitted = JitFunction(mlp_of("float32"), Options(placement=(("hexir.linear", "cuda"),)))
    spec = hexir.TensorSpec(("batch", 8), "float32")
    assert 'tensor<?x8xf32, "batch">' in str(run_stage(jitted.trace(spec), "mlir", jitted.options))
    tir = str(run_stage(jitted.trace(spec), "mlir-tir", jitted.options))
    assert "memref<?x8xf32>" in tir and 'hextir.sizes = ["batch"]' in tir
    assert 'grid = ["1", "ceildiv(batch, 64)", "1"]' in tir       # 16 columns: one 64-wide tile
    assert 'extent = "ceildiv(batch, 24)"' in tir  # the cpu twin: tiles of 24 rows, all 16 columns
    loops = str(run_stage(jitted.trace(spec), "mlir-linalg", jitted.options))
    assert "memref.reinterpret_cast" in loops and "memref<f32>" in loops


@pytest.mark.parametrize(("shape", "message"), [
    ((8, None), "shape must be non-negative integers"),
    (("bad name", 8), "shape must be non-negative integers"),
    ((2**62, 4), "more than 2\\^63 bytes"),
])
def test_bad_symbolic_specs_are_refused(shape, message):
    with pytest.raises(hexir.TraceError, match=message):
        hexir.TensorSpec(shape, "float32")


def test_spec_spellings():
    assert hexir.TensorSpec((None, 8), "f32") == hexir.TensorSpec(("batch", 8), "float32")


def test_a_symbolic_weight_is_an_error_naming_the_op_and_argument():
    def f(x, w):
        return hexir.linear(x, w)
    with pytest.raises(hexir.TraceError, match="linear: argument 'w' is float32\\[n, 4\\]; a weight's extents"):
        hexir.jit(f).compile(hexir.TensorSpec((2, 8), "float32"), hexir.TensorSpec(("n", 4), "float32"))


@pytest.mark.parametrize("spec", ["x=?x8xf32", "x=batchx8xf32", "x=batchx8xfloat32"])
def test_the_command_line_takes_a_symbolic_spec(spec, tmp_path):
    result = subprocess.run([sys.executable, "-m", "hexir.cli", f"{REPO}/examples/mlp.py:mlp", f"-spec={spec}",
                             "-emit=mlir"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert 'tensor<?x8xf32, "batch">' in result.stdout


def test_a_symbolic_cuda_linear_carries_a_kernel_per_tile_chosen_per_call():
    from hexir_runtime.format import decode

    def layer(x):
        return hexir.linear(x, np.ones((64, 1024), np.float32))
    data = hexir.jit(layer, placement="hexir.linear=cuda").compile(hexir.TensorSpec(("batch", 64), "float32"))
    hxb = decode(data)
    (kernel,) = hxb.manifest.kernels
    code = kernel.gpu_code
    # 1024 columns: 32x32 tiles give 128 blocks from 128 rows on, 64x64 256 from 1024, 128x128 128 from 2048
    assert [(v.symbol.rsplit("__", 1)[1], dict(v.below)) for v in code.variants] == \
        [("t16", {"batch": 128}), ("t32", {"batch": 1024}), ("t64", {"batch": 2048})]
    assert code.pick({"batch": 127})[0].endswith("__t16")
    assert code.pick({"batch": 128})[0].endswith("__t32")
    assert code.pick({"batch": 1000})[0].endswith("__t32")
    assert code.pick({"batch": 1024})[0].endswith("__t64")
    assert code.pick({"batch": 2047})[0].endswith("__t64")
    assert code.pick({"batch": 2048}) == (code.symbol, code.launch)
    assert [v.launch.grid for v in code.variants] == [(64, ("ceildiv", "batch", 16), 1),
                                                      (32, ("ceildiv", "batch", 32), 1),
                                                      (16, ("ceildiv", "batch", 64), 1)]
    assert code.launch.grid == (8, ("ceildiv", "batch", 128), 1)
    x = RNG.standard_normal((5, 64)).astype(np.float32)  # and the cpu twin still computes it
    np.testing.assert_allclose(load(data, "cpu").main(x), x @ np.ones((64, 1024), np.float32), rtol=1e-5)


def test_a_symbolic_float64_cuda_linear_carries_a_tensor_core_kernel_per_tile():
    """The FP64 tensor-core kernel's tiles the same way: with 1024 columns 32x32 tiles run batches
    below 256 rows (where 64x32 first gives 128 blocks), 64x32 below 1024 (64x64: 256 blocks),
    64x64 below 2176 (128x64: 264 blocks), 128x64 below 8192 (128x128: 512), 128x128 the rest;
    with an odd K (8-byte copies) no 128x128 tiles (DMMA_EVEN_WIDTH): 128x64 the rest."""
    from hexir_runtime.format import decode

    def variants(k):
        def layer(x):
            return hexir.linear(x, np.ones((k, 1024)))
        data = hexir.jit(layer, placement="hexir.linear=cuda").compile(hexir.TensorSpec(("batch", k), "float64"))
        return decode(data).manifest.kernels[0].gpu_code
    code = variants(64)
    assert [(v.symbol.rsplit("__", 1)[1], dict(v.below)) for v in code.variants] == \
        [("dmma32x32", {"batch": 256}), ("dmma64x32", {"batch": 1024}), ("dmma64x64", {"batch": 2176}),
         ("dmma128x64", {"batch": 8192})]
    assert [v.launch.grid for v in code.variants] == [(32, ("ceildiv", "batch", 32), 1),
                                                      (32, ("ceildiv", "batch", 64), 1),
                                                      (16, ("ceildiv", "batch", 64), 1),
                                                      (16, ("ceildiv", "batch", 128), 1)]
    assert code.launch.grid == (8, ("ceildiv", "batch", 128), 1) and code.launch.block == (256, 1, 1)
    assert code.pick({"batch": 64})[0].endswith("__dmma32x32") and code.pick({"batch": 8192})[0] == code.symbol
    odd = variants(63)
    assert [v.symbol.rsplit("__", 1)[1] for v in odd.variants] == ["dmma32x32", "dmma64x32", "dmma64x64"]
    assert odd.launch.grid == (16, ("ceildiv", "batch", 128), 1) and odd.launch.block == (128, 1, 1)


def test_a_batch_too_big_for_memory_is_a_device_error_not_a_memory_error():
    fn = hexir.jit(lambda x: hexir.relu(x), dynamic=True, cache=False)
    fn(np.ones((2, 8), np.float32))
    huge = np.broadcast_to(np.float32(1), (2**47, 8))  # 2^52 bytes, held in 4
    with pytest.raises(DeviceError, match=r"main\(\): out of memory allocating input 'x' \(buffer 0\), "
                                                        r"float32\[140737488355328, 8\]: 4,503,599,627,370,496 bytes"):
        fn(huge)
