"""bfloat16 and float16 (#26): stored in 16 bits, computed in float32 (torch's semantics);
hexir.cast / x.astype; numpy's rules for mixing dtypes; matmul_precision."""

from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from hexir_runtime import InputError

import hexir
from hexir.driver import Options, run_stage

BF16 = np.dtype(ml_dtypes.bfloat16)
HALVES = [BF16, np.dtype(np.float16)]


def _tir(f, *specs) -> str:
    """f's kernels and host program after lower-to-tir, as text."""
    return str(run_stage(f.trace(*specs), "mlir-tir", f.options))


def _same(got: np.ndarray, want: np.ndarray) -> None:
    """Bit for bit, except that any NaN equals any NaN."""
    assert got.dtype == want.dtype
    nan = np.isnan(want.astype(np.float32))
    assert (np.isnan(got.astype(np.float32)) == nan).all()
    assert (got.view(f"u{got.itemsize}")[~nan] == want.view(f"u{want.itemsize}")[~nan]).all()


@pytest.mark.parametrize("placement", [None, "*=cuda"], ids=["cpu", "cuda-twin"])
@pytest.mark.parametrize("half", HALVES, ids=lambda d: d.name)
def test_conversions_round_to_nearest_even_as_numpy_does(half, placement):
    """Every 16-bit value widened exactly; float32 values narrowed as numpy (ml_dtypes) rounds:
    ties, the largest finite values, subnormals, infinities and NaN."""
    every = np.arange(2**16, dtype=np.uint16).view(half)
    widen = hexir.jit(lambda x: x.astype("float32"), placement=placement, cache=False)
    _same(widen(every), every.astype(np.float32))
    bits = np.random.default_rng(0).integers(0, 2**32, 1 << 16, dtype=np.uint64).astype(np.uint32)
    halfway = every.astype(np.float32).view(np.uint32)[:-1] + (1 << (13 if half.name == "float16" else 15))
    edges = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00001, 0x477FEFFF, 0x477FF000, 0x7F7FFFFF,
                      0x33000000, 0x33000001, 0x387FC000, 0x00000001], np.uint32)
    values = np.concatenate([bits, halfway, edges]).view(np.float32)
    narrow = hexir.jit(lambda x: hexir.cast(x, half.name), placement=placement, cache=False)
    with np.errstate(all="ignore"):
        _same(narrow(values), values.astype(half))


def test_bfloat16_and_float16_convert_to_each_other_through_float32():
    x = np.linspace(-70000, 70000, 1001).astype(np.float32).astype(BF16)
    f = hexir.jit(lambda x: x.astype(np.float16))
    with np.errstate(over="ignore"):
        _same(f(x), x.astype(np.float32).astype(np.float16))


@pytest.mark.parametrize("half", HALVES, ids=lambda d: d.name)
def test_ops_compute_in_float32_and_return_the_16_bit_dtype(half):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 96)).astype(half)
    w = rng.standard_normal((96, 24)).astype(half)
    b = rng.standard_normal(24).astype(half)
    f = hexir.jit(lambda x: (hexir.softmax(x) * 2.5, hexir.argmax(x), hexir.linear(x, w, b), x @ w,
                             hexir.layer_norm(x)))
    soft, arg, lin, mm, norm = f(x)
    wide = x.astype(np.float32)
    assert (soft.dtype, arg.dtype, lin.dtype, mm.dtype, norm.dtype) == (half, np.int64, half, half, half)
    e = np.exp(wide - wide.max(-1, keepdims=True))
    np.testing.assert_allclose(soft.astype(np.float32), 2.5 * e / e.sum(-1, keepdims=True), rtol=2**-7)
    np.testing.assert_array_equal(arg, wide.argmax(-1))
    exact = wide.astype(np.float64) @ w.astype(np.float64)
    one_rounding = 2.0 ** -(8 if half == BF16 else 11)  # sums in float32, the result rounded once
    np.testing.assert_allclose(lin.astype(np.float64), (exact + b.astype(np.float64)).astype(half).astype(np.float64),
                               rtol=2 * one_rounding, atol=1e-3)
    np.testing.assert_allclose(mm.astype(np.float64), exact, rtol=one_rounding, atol=1e-3 * np.sqrt(96))
    centred = wide - wide.mean(-1, keepdims=True)
    np.testing.assert_allclose(norm.astype(np.float32), centred / np.sqrt((centred ** 2).mean(-1, keepdims=True)
                                                                          + 1e-5), rtol=2**-7, atol=2**-7)


def test_a_16_bit_linear_runs_the_float32_gemm_between_casts():
    w = np.ones((8, 4), BF16)
    f = hexir.jit(lambda x: hexir.gelu(hexir.linear(x, w)) + 1.0)
    text = _tir(f, hexir.TensorSpec((None, 8), "bf16"))
    kernels = [line.split("@")[1].split(",")[0] for line in text.splitlines() if "hexir.call" in line]
    assert [k.rsplit("_", 1)[0] for k in kernels] == ["cast", "linear", "add"], kernels  # gelu, the cast back fused
    assert 'func.func public @add_2(%arg0: memref<?x4xf32>, %arg1: memref<?x4xbf16>' in text
    assert 'name = "w.float32"' in text and "tensor<8x4xbf16>" not in text  # converted once, at compile time
    x = np.random.default_rng(2).standard_normal((3, 8)).astype(BF16)
    assert f(x).dtype == BF16
    assert 'label="linear (w.float32)' in hexir.explain(f, hexir.TensorSpec((None, 8), "bf16"))  # the same picture


def test_fusion_keeps_each_op_in_its_own_compute_dtype():
    """exp of a float32 tensor cast to float64 is computed in float64 (a kernel apart from the
    cast); bf16 -> f32 casts fuse with the float32 ops around them."""
    x = np.float32([1e-3, 20.0, -3.5])
    f = hexir.jit(lambda x: hexir.exp(x.astype(np.float64)) - 1.0)
    np.testing.assert_array_equal(f(x), np.exp(x.astype(np.float64)) - 1.0)
    g = hexir.jit(lambda x, y: hexir.exp(x.astype(np.float32)) * y)
    text = _tir(g, hexir.TensorSpec((3,), "bf16"), hexir.TensorSpec((3,), "f32"))
    assert text.count("hexir.call") == 1


def test_mixing_dtypes_without_a_cast_is_a_trace_error_naming_both():
    f = hexir.jit(lambda x, y: x + y)
    with pytest.raises(hexir.TraceError, match=r"add: mixed dtypes \(bfloat16\[2\] and float32\[2\]\)") as error:
        f(np.ones(2, BF16), np.ones(2, np.float32))
    assert error.value.where.startswith(__file__)
    with pytest.raises(hexir.TraceError, match=r"mixed dtypes \(float16\[2\] and bfloat16\[2\]\)"):
        f(np.ones(2, np.float16), np.ones(2, BF16))
    w = np.ones((2, 2), np.float32)
    with pytest.raises(hexir.TraceError, match="linear: mixed dtypes: x is float16 but w is float32"):
        hexir.jit(lambda x: hexir.linear(x, w))(np.ones((1, 2), np.float16))
    with pytest.raises(hexir.TraceError, match="matmul"):
        hexir.jit(lambda x: x @ w)(np.ones((1, 2), BF16))


def test_numbers_are_weak_and_16_bit_constants_are_taken():
    c = np.float16([0.5, 2.0])
    k = np.ones(2, BF16) * 3
    f = hexir.jit(lambda x, y: (x * 1.1 + c, y / 3 + k))
    a, b = f(np.ones(2, np.float16), np.ones(2, BF16))
    assert a.dtype == np.float16 and b.dtype == BF16
    np.testing.assert_array_equal(a, (np.float32(1.1) + c.astype(np.float32)).astype(np.float16))
    np.testing.assert_array_equal(b, np.float32(3 + 1 / 3).astype(BF16).repeat(2))


def test_bad_casts_are_trace_errors_at_the_users_line():
    x = np.ones(2, np.float32)
    for dtype, message in (("int32", "cast: dtype must be float32, float64, bfloat16 or float16, got int32"),
                           ("c8", "cast: dtype must be .*got complex64"),
                           ("nonsense", "cast: 'nonsense' is not a dtype")):
        with pytest.raises(hexir.TraceError, match=message) as error:
            hexir.jit(lambda x: x.astype(dtype))(x)  # noqa: B023 - called at once
        assert error.value.where.startswith(__file__)
    with pytest.raises(hexir.TraceError, match="cast: x is a int64.*tensor"):
        hexir.jit(lambda x: hexir.argmax(x).astype("float32"))(np.ones((2, 2), np.float32))


def test_a_float32_array_for_a_bfloat16_input_is_an_input_error(tmp_path):
    path = hexir.export(lambda x: x * 2, tmp_path / "m.hxb", hexir.TensorSpec((2,), "bf16"))
    import hexir_runtime

    module = hexir_runtime.load(path, "cpu")
    with pytest.raises(InputError, match="bfloat16"):
        module.main(np.ones(2, np.float32))
    np.testing.assert_array_equal(module.main(np.ones(2, BF16)), np.full(2, 2, BF16))


def test_matmul_precision_reaches_the_options_and_the_cache_key(tmp_path):
    w = np.ones((4, 3), np.float32)
    f = hexir.jit(lambda x: hexir.linear(x, w), matmul_precision="tf32")
    assert f.options.matmul_precision == "tf32" and f.options != Options()
    np.testing.assert_array_equal(f(np.ones((2, 4), np.float32)), np.full((2, 3), 4, np.float32))  # cpu: float32
    with pytest.raises(hexir.ArgumentError, match="matmul_precision must be one of 'highest', 'tf32', got 'fast'") \
            as error:
        hexir.jit(lambda x: x, matmul_precision="fast")
    assert error.value.where.startswith(__file__)
    with pytest.raises(hexir.ArgumentError, match="got 'TF32'"):
        hexir.export(f, tmp_path / "m.hxb", np.ones((2, 4), np.float32), matmul_precision="TF32")
    assert hexir.export(f, tmp_path / "m.hxb", np.ones((2, 4), np.float32), matmul_precision="highest").exists()


def test_the_command_line_takes_16_bit_specs_and_matmul_precision(tmp_path):
    source = tmp_path / "model.py"
    source.write_text("import hexir\ndef f(x, w):\n    return hexir.gelu(x @ w)\n")
    result = subprocess.run([sys.executable, "-m", "hexir.cli", f"{source}:f", "-spec=x=batchx8xbf16",
                             "-spec=w=8x4xbf16", "-emit=mlir", "-matmul-precision=tf32"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "tensor<?x8xbf16" in result.stdout and "-> tensor<?x4xbf16" in result.stdout
    result = subprocess.run([sys.executable, "-m", "hexir.cli", f"{source}:f", "-spec=x=2x8xf16", "-spec=w=8x4xf16",
                             "-emit=mlir", "-matmul-precision=fast"], capture_output=True, text=True)
    assert result.returncode == 2 and "invalid choice: 'fast'" in result.stderr


@pytest.mark.parametrize("native", ["cpu", "cuda-matmul"])
@pytest.mark.parametrize("half", HALVES, ids=lambda d: d.name)
def test_16_bit_contract_kernels_compute_in_float32(half, native, monkeypatch):
    """Where schedules/cuda.py's native_16bit lets a cuda contract take 16-bit operands, its cpu
    twin takes them too (cpu_matmul's micro-kernel: products and sums in float32, the bias and
    epilogue, a residual, in float32, stored in 16 bits), and so does the cuda matmul (built
    here, run on the H200). "cpu": the widening turned off (the twins' kernels); "cuda-matmul":
    native_16bit for matmul only. w and the residual are inputs, so that nothing packs them."""
    from hexir import driver
    from hexir.schedules import cuda

    if native == "cpu":
        monkeypatch.setattr(driver, "widen", lambda *args: None)
    else:
        monkeypatch.setattr(cuda, "native_16bit", lambda request: request.op == "matmul")
    rng = np.random.default_rng(3)
    x, w, r = (rng.standard_normal(s).astype(half) for s in ((5, 37), (37, 19), (5, 19)))
    b = rng.standard_normal(19).astype(half)
    f = hexir.jit(lambda x, w, r: (hexir.gelu(hexir.linear(x, w, b)) + r, x @ w), cache=False,
                  placement=None if native == "cpu" else "*=cuda")
    calls = {line.split("@")[1].split("_")[0]: line for line in _tir(f, *map(hexir.TensorSpec.of, (x, w, r)))
             .splitlines() if "hexir.call" in line}
    short = "bf16" if half == BF16 else "f16"
    assert f"(tensor<5x37x{short}>, tensor<37x19x{short}>) -> tensor<5x19x{short}>" in calls["matmul"]
    assert ("cast" in calls) == (native != "cpu") and ("xf32" in calls["linear"]) == (native != "cpu")
    lin, mm = f(x, w, r)
    wide = [a.astype(np.float64) for a in (x, w, b, r)]
    s = wide[0] @ wide[1] + wide[2]
    from math import erf, sqrt
    want = np.vectorize(lambda v: 0.5 * v * (1 + erf(v / sqrt(2))))(s) + wide[3]
    one_rounding = 2.0 ** -(8 if half == BF16 else 11)
    assert lin.dtype == mm.dtype == half
    np.testing.assert_allclose(lin.astype(np.float64), want, rtol=2 * one_rounding, atol=1e-3)
    np.testing.assert_allclose(mm.astype(np.float64), wide[0] @ wide[1], rtol=2 * one_rounding, atol=1e-3)


def test_a_mlir_input_may_convert_with_the_identity_tree_only(tmp_path):
    """A pointwise op's result has its operands' dtype, except a conversion's (hexir.cast: the
    tree ["arg", 0]); the runtime computes it in float32 and stores it as bfloat16."""
    path = tmp_path / "cast.mlir"
    op = '"hexir.{}"(%arg0) {{device = "cpu", expr = "{}", operandSegmentSizes = array<i32: 1, 0, 0, 0, 0, 0, 0, 0>}}'
    body = ('func.func @main(%arg0: tensor<2xf32>) -> tensor<2xbf16> attributes {{hexir.arg_names = ["x"], '
            'hexir.result_form = "single"}} {{\n  %0 = ' + op + ' : (tensor<2xf32>) -> tensor<2xbf16>\n'
            '  return %0 : tensor<2xbf16>\n}}\n')
    path.write_text(body.format("cast", '[\\"arg\\",0]'))
    result = subprocess.run([sys.executable, "-m", "hexir.cli", str(path), "-emit=mlir-tir"], capture_output=True,
                            text=True)
    assert result.returncode == 0 and "memref<2xbf16>" in result.stdout, result.stderr
    path.write_text(body.format("relu", '[\\"max\\",[\\"arg\\",0],[\\"const\\",0]]'))
    result = subprocess.run([sys.executable, "-m", "hexir.cli", str(path), "-emit=mlir"], capture_output=True,
                            text=True)
    assert result.returncode == 1 and "relu: result type is bfloat16[2], expected float32[2]" in result.stderr


def test_a_tf32_cuda_linear_stores_its_constant_w_k_major_rounded_and_the_reference_agrees_with_numpy(tmp_path):
    """matmul_precision="tf32", w a constant, on cuda: pack-weights stores w^T [N, K] rounded to
    TF32 to nearest, ties away (cvt.rna), for wgmma (the default sm_90 target gains sm_90a); the
    kernel is a `linear_t`, which the numpy reference runs (within TF32's rounding of numpy's
    float64 product), and so does the cpu device where there is no GPU (it has no cpu twin: the
    cpu kernels read no w^T), batch after batch, empty batches included."""
    import hexir_runtime
    from hexir_runtime.format import read

    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 40)).astype(np.float32)
    w[0, :3] = [1 + 2**-11, 1 + 2**-12, -(1 + 2**-11)]  # a tie (away from 0), below one, a negative tie
    path = hexir.export(lambda x: hexir.linear(x, w), tmp_path / "tf32.hxb", hexir.TensorSpec(("batch", 64), "float32"),
                        placement={"hexir.linear": "cuda"}, matmul_precision="tf32")
    kernel = read(path).manifest.kernels[0]
    assert kernel.op == "linear_t" and kernel.args[1].shape == (40, 64) and kernel.cpu_code is None
    assert set(kernel.gpu_code.images) == {"sm_90", "sm_90a", "compute_90"}
    assert [v.symbol.endswith("wgmma_sm_90a") for v in kernel.gpu_code.variants] == [True]
    module = hexir_runtime.load(path, device="reference")
    first = module.main(np.eye(1, 64, dtype=np.float32))[0]  # row 0 of w as stored
    np.testing.assert_array_equal(first[:3], np.array([1 + 2**-10, 1, -(1 + 2**-10)], np.float32))
    assert np.abs(first - w[0]).max() <= 2**-11 * np.abs(w[0]).max()
    x = rng.standard_normal((7, 64)).astype(np.float32)
    exact = x.astype(np.float64) @ w.astype(np.float64)
    assert np.abs(module.main(x) - exact).max() <= 2**-11 * np.sqrt(64) * np.abs(exact).max()
    on_cpu = hexir_runtime.load(path, device="cpu")
    for rows in (7, 0, 300, 7):
        x = rng.standard_normal((rows, 64)).astype(np.float32)
        np.testing.assert_array_equal(on_cpu.main(x), module.main(x))
