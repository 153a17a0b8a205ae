"""Shapes: any rank, several symbolic extents anywhere, linear on x[..., K], reductions over a
symbolic axis, jit's automatic dynamic extents, -spec with symbols; against numpy on the cpu
and on the cuda kernels' cpu twins."""

from __future__ import annotations

import math

import hexir_runtime
import numpy as np
import pytest
from hexir_runtime.errors import InputError

import hexir
from hexir import TensorSpec
from hexir.cli import main
from hexir.errors import TraceError

RNG = np.random.default_rng(24)
W = RNG.standard_normal((16, 8)).astype(np.float32)
B = RNG.standard_normal(8).astype(np.float32)
PLACEMENTS = [None, "*=cuda"]


def _gelu(v):
    return 0.5 * v * (1 + np.vectorize(math.erf, otypes=[v.dtype])(v / math.sqrt(2)))


def _softmax(v, axis):
    e = np.exp(v - v.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _load(fn, *specs, placement=None):
    return hexir_runtime.load(hexir.jit(fn, placement=placement).compile(*specs))


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_linear_on_rank_3_with_two_symbols_and_a_fused_residual(placement):
    def f(x, r):
        return hexir.gelu(hexir.linear(x, W, B)) + r

    module = _load(f, TensorSpec(("batch", "seq", 16), "float32"), TensorSpec(("batch", "seq", 8), "float32"),
                   placement=placement)
    for b, s in [(2, 3), (1, 1), (3, 7), (1, 33), (2, 0)]:
        x = RNG.standard_normal((b, s, 16)).astype(np.float32)
        r = RNG.standard_normal((b, s, 8)).astype(np.float32)
        np.testing.assert_allclose(module.main(x, r), _gelu(x @ W + B) + r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("shape", [(5, 16), (16,), (2, 3, 4, 16)])
def test_linear_keeps_leading_axes(placement, shape):
    x = RNG.standard_normal(shape).astype(np.float64)
    w = W.astype(np.float64)
    got = hexir.jit(lambda x: hexir.linear(x, w) * 2.0, placement=placement)(x)
    assert got.shape == (*shape[:-1], 8)
    np.testing.assert_allclose(got, (x @ w) * 2.0, rtol=1e-12)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("extra", [(8,), (1, 1, 8), (1, 1), ("seq", 8), ("batch", "seq", 1)])
def test_a_linear_epilogue_input_of_any_broadcast_shape(placement, extra):
    """Inputs the kernel can read as rows of the output are fused; the others ([seq, 8] against
    [batch, seq, 8]) are a kernel of their own: both give numpy's answer."""
    spec = TensorSpec(extra, "float32")

    def f(x, e):
        return hexir.linear(x, W) * e

    module = _load(f, TensorSpec(("batch", "seq", 16), "float32"), spec, placement=placement)
    b, s = 3, 5
    x = RNG.standard_normal((b, s, 16)).astype(np.float32)
    e = RNG.standard_normal(tuple({"batch": b, "seq": s}.get(d, d) for d in extra)).astype(np.float32)
    np.testing.assert_allclose(module.main(x, e), (x @ W) * e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_reductions_over_a_symbolic_axis(placement):
    def f(x, m):
        return hexir.softmax(x * 0.5 + m, axis=1), x.sum(axis=1), hexir.layer_norm(x), x.max(axis=-2, keepdims=True)

    module = _load(f, TensorSpec(("batch", "keys", 6), "float32"), TensorSpec((1, "keys", 1), "float32"),
                   placement=placement)
    for b, k in [(2, 1), (1, 9), (3, 300)]:
        x = RNG.standard_normal((b, k, 6)).astype(np.float32)
        m = RNG.standard_normal((1, k, 1)).astype(np.float32)
        soft, total, normed, top = module.main(x, m)
        np.testing.assert_allclose(soft, _softmax(x * 0.5 + m, 1), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(total, x.sum(axis=1), rtol=1e-5, atol=1e-5)
        mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        np.testing.assert_allclose(normed, (x - mean) / np.sqrt(var + 1e-5), rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(top, x.max(axis=-2, keepdims=True))


def test_a_symbol_that_is_zero_at_run_time():
    module = _load(lambda x: (x * 2.0).sum(axis=1), TensorSpec(("batch", "seq", 4), "float32"))
    np.testing.assert_array_equal(module.main(np.ones((2, 0, 4), np.float32)), np.zeros((2, 4), np.float32))
    assert module.main(np.ones((0, 3, 4), np.float32)).shape == (0, 4)


def test_a_symbol_bound_twice_with_different_sizes_names_both_inputs():
    module = _load(lambda x, y: x + y, TensorSpec(("batch", "seq", 4), "float32"),
                   TensorSpec(("batch", "seq", 4), "float32"))
    with pytest.raises(InputError, match=r"input 'y' has seq = 5 \(axis 1\), but input 'x' has seq = 3 \(axis 1\)"):
        module.main(np.ones((2, 3, 4), np.float32), np.ones((2, 5, 4), np.float32))


def test_symbols_must_match_at_trace_time():
    with pytest.raises(TraceError, match=r"do not broadcast .*seq vs time"):
        hexir.jit(lambda x, y: x + y).compile(TensorSpec(("seq", 4), "float32"), TensorSpec(("time", 4), "float32"))
    with pytest.raises(TraceError, match=r"a weight's extents must be static|inner dimensions differ"):
        hexir.jit(lambda x: hexir.linear(x, W)).compile(TensorSpec(("batch", "k"), "float32"))


def test_tensor_spec_takes_names_anywhere():
    assert TensorSpec(("batch", "seq", 64), "f32").shape == ("batch", "seq", 64)
    assert TensorSpec((None, "seq"), "f64").shape == ("batch", "seq")
    with pytest.raises(TraceError, match="non-negative integers or names"):
        TensorSpec((2, "not a name"), "f32")


def test_jit_makes_every_extent_that_changed_symbolic():
    compiled = []

    @hexir.jit
    def f(x, m):
        compiled.append(x.shape)
        return hexir.softmax(hexir.linear(x, W) + m, axis=-2)

    for b, s in [(2, 3), (2, 5), (1, 7), (4, 2)]:
        x = RNG.standard_normal((b, s, 16)).astype(np.float32)
        m = RNG.standard_normal((b, s, 8)).astype(np.float32)
        np.testing.assert_allclose(f(x, m), _softmax(x @ W + m, -2), rtol=1e-5, atol=1e-6)
    # the first shape, then one module with seq symbolic (batch was equal), then both symbolic
    assert compiled == [(2, 3, 16), (2, "seq", 16), ("batch", "seq", 16)]


def test_jit_compiles_a_shape_as_it_is_when_the_function_needs_the_extent_static():
    traced = []

    @hexir.jit
    def f(x):
        traced.append(x.shape)
        return hexir.linear(x, np.ones((x.shape[-1], 2), np.float32))

    for k in (3, 4):
        np.testing.assert_allclose(f(np.ones((2, k), np.float32)), np.full((2, 2), k, np.float32))
    assert traced[0] == (2, 3) and traced[-1] == (2, 4)


def test_spec_on_the_command_line_takes_several_symbols(tmp_path, capsys):
    source = tmp_path / "m.py"
    source.write_text("import hexir\nimport numpy as np\nW = np.ones((64, 8), np.float32)\n"
                      "def f(x):\n    return hexir.softmax(hexir.linear(x, W), axis=1)\n")
    assert main([f"{source}:f", "-spec=x=batchxseqx64xf32", "-emit=mlir"]) == 0
    assert 'tensor<?x?x64xf32, "batch,seq">' in capsys.readouterr().out
    assert main([f"{source}:f", "-spec=x=batchxseqx64", "-emit=mlir"]) == 2
    assert "names without an x" in capsys.readouterr().err


def test_a_cuda_linear_over_two_symbols_picks_its_tile_by_the_product_of_its_rows():
    from hexir_runtime.format import decode
    data = hexir.jit(lambda x: hexir.linear(x, W), placement="*=cuda").compile(
        TensorSpec(("batch", "seq", 16), "float32"))
    (code,) = [k.gpu_code for k in decode(data).manifest.kernels if k.gpu_code]
    assert code.variants and all(list(v.below) == [("mul", "batch", "seq")] for v in code.variants)
    bound = code.variants[0].below[("mul", "batch", "seq")]
    assert code.pick({"batch": 1, "seq": bound - 1})[0] == code.variants[0].symbol
    assert code.pick({"batch": bound, "seq": bound})[0] == code.symbol


def test_a_variant_bound_on_a_malformed_size_is_refused():
    import json

    from hexir_runtime import HxbFormatError
    from hexir_runtime.format import decode, encode
    read = decode(hexir.jit(lambda x: hexir.linear(x, W), placement="*=cuda").compile(
        TensorSpec(("batch", "seq", 16), "float32")))
    blobs = [(b["name"], bytes(read.blob(i))) for i, b in enumerate(read.json["blobs"])]
    for key, reason in [("mul(batch,", "expected a symbol or a size expression"),
                        ("mul(batch, time)", "symbol 'time' is no dimension")]:
        crafted = {k: v for k, v in json.loads(json.dumps(read.json)).items() if k != "blobs"}
        kernel = next(k for k in crafted["kernels"] if "variants" in k)
        kernel["variants"][0]["below"] = {key: 4}
        with pytest.raises(HxbFormatError, match=reason):
            encode(crafted, blobs)
