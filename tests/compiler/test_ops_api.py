"""The ops of #23 through every door: jit, export + hexir_runtime.load, the `hexir` command's
stages and placement, hexir.explain, hexir.print, and hexir-run, against numpy (the op sweep,
test_op_sweep.py, covers every op x device x dtype; this is the API a user meets)."""

from __future__ import annotations

import math
import re
import textwrap

import numpy as np
import pytest
from hexir_runtime import load
from hexir_runtime.cli import main as hexir_run

import hexir
from hexir.cli import main as hexir_command

from .conftest import REPO, manifest

_erf = np.vectorize(math.erf, otypes=[np.float64])
RNG = np.random.default_rng(23)
W = RNG.standard_normal((8, 6)).astype(np.float32)
B = RNG.standard_normal(6).astype(np.float32)
GAMMA = RNG.standard_normal(6).astype(np.float32)


def _softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _layer_norm(x, weight, bias, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps) * weight + bias


def _gelu(x):
    return 0.5 * x * (1 + _erf(x / math.sqrt(2)))


def test_operators_with_numbers_and_arrays_on_both_sides():
    row = np.linspace(0.5, 2.0, 4).astype(np.float32)
    column = np.array([[1.0], [-2.0], [3.0]], np.float32)

    @hexir.jit(cache=False)
    def arithmetic(x, y):
        return (2 - x, 1 / x, x / 2, -x + abs(y), x ** 2, y ** 0.5 * 3, row * x, x - column, column / row,
                (x - row) * np.float32(0.5) / y + 1, hexir.maximum(x, 1.5), hexir.minimum(row, y), +x)

    x = RNG.uniform(0.5, 3.0, (3, 4)).astype(np.float32)
    y = RNG.uniform(0.5, 3.0, (3, 4)).astype(np.float32)
    got = arithmetic(x, y)
    expected = (2 - x, 1 / x, x / 2, -x + abs(y), x ** 2, y ** 0.5 * 3, row * x, x - column, column / row,
                (x - row) * np.float32(0.5) / y + 1, np.maximum(x, 1.5), np.minimum(row, y), x)
    assert len(got) == len(expected)
    for position, (value, reference) in enumerate(zip(got, expected, strict=True)):
        assert value.dtype == np.float32 and value.shape == reference.shape, position
        np.testing.assert_allclose(value, reference, rtol=2e-6, err_msg=f"output {position}")


def test_a_python_number_takes_the_tensors_dtype():
    """Weak scalars: 0.1 is folded as a float64 in a float64 program and a float32 in a float32 one."""
    @hexir.jit(cache=False)
    def scaled(x):
        return x * 0.1 + 1e-3

    for dtype in (np.float32, np.float64):
        x = np.arange(1, 7, dtype=dtype).reshape(2, 3)
        y = scaled(x)
        assert y.dtype == dtype
        np.testing.assert_allclose(y, x * dtype(0.1) + dtype(1e-3), rtol=1e-15 if dtype == np.float64 else 1e-7)


def test_functions_reductions_and_methods():
    @hexir.jit(cache=False)
    def everything(x, p):
        return (hexir.exp(x), hexir.log(p), hexir.tanh(x), hexir.sigmoid(x), hexir.silu(x), hexir.sqrt(p),
                hexir.rsqrt(p), hexir.erf(x), hexir.abs(x), hexir.relu(x), hexir.gelu(x),
                hexir.gelu(x, approximate="tanh"),
                hexir.sum(x, axis=0), x.sum(keepdims=True), hexir.mean(x), x.mean(axis=0, keepdims=True),
                hexir.max(x, axis=-2), x.max(), hexir.argmax(x), x.argmax(axis=0, keepdims=True),
                hexir.softmax(x), hexir.softmax(x, axis=0), hexir.log_softmax(x, axis=-1),
                hexir.layer_norm(x), hexir.layer_norm(x, GAMMA[:4], B[:4], eps=1e-3),
                hexir.sum(hexir.sum(x)))

    x = RNG.standard_normal((3, 4)).astype(np.float64)
    p = np.abs(x) + 0.25
    t = np.tanh
    expected = (np.exp(x), np.log(p), t(x), 1 / (1 + np.exp(-x)), x / (1 + np.exp(-x)), np.sqrt(p), 1 / np.sqrt(p),
                _erf(x), np.abs(x), np.maximum(x, 0), _gelu(x),
                0.5 * x * (1 + t(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))),
                x.sum(0), x.sum(-1, keepdims=True), x.mean(-1), x.mean(0, keepdims=True),
                x.max(-2), x.max(-1), x.argmax(-1), x.argmax(0, keepdims=True),
                _softmax(x), _softmax(x, 0), np.log(_softmax(x)),
                _layer_norm(x, 1, 0), _layer_norm(x, GAMMA[:4].astype(np.float64), B[:4].astype(np.float64), 1e-3),
                np.array([x.sum()]))
    with pytest.raises(hexir.TraceError, match="mixed dtypes"):  # float32 weights with a float64 x
        everything(x, p)
    x32, p32 = x.astype(np.float32), p.astype(np.float32)
    got = everything(x32, p32)
    for position, (value, reference) in enumerate(zip(got, expected, strict=True)):
        assert value.shape == reference.shape, position
        if reference.dtype.kind == "i":
            assert value.dtype == np.int64
            np.testing.assert_array_equal(value, reference, err_msg=f"output {position}")
        else:
            assert value.dtype == np.float32, position
            np.testing.assert_allclose(value, reference, rtol=1e-5, atol=1e-6, err_msg=f"output {position}")


# ---- one classifier head, through every door ---------------------------------------------------

HEAD_SOURCE = """\
import numpy as np
import hexir

rng = np.random.default_rng(5)
W = rng.standard_normal((8, 6)).astype(np.float32)
b = rng.standard_normal(6).astype(np.float32)
g = rng.standard_normal(6).astype(np.float32)


def head(x):
    h = hexir.gelu(hexir.linear(x, W, b) * 0.5 + 1.0)
    probabilities = hexir.softmax(h)
    hexir.print(probabilities)
    label = hexir.argmax(h)
    hexir.print(label)
    return probabilities, label, hexir.layer_norm(h, g, b)
"""


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """The module of HEAD_SOURCE (a file, so the `hexir` command can load it too) and its path."""
    folder = tmp_path_factory.mktemp("head")
    path = folder / "head.py"
    path.write_text(HEAD_SOURCE)
    namespace = {"__name__": "head", "__file__": str(path)}
    exec(compile(HEAD_SOURCE, str(path), "exec"), namespace)  # noqa: S102 - the test's own source
    return namespace, path


def _head_reference(namespace, x):
    h = _gelu((x.astype(np.float64) @ namespace["W"] + namespace["b"]) * 0.5 + 1.0)
    return _softmax(h), h.argmax(-1), _layer_norm(h, namespace["g"], namespace["b"])


def _check_head(outputs, namespace, x):
    probabilities, label, normed = outputs
    expected = _head_reference(namespace, x)
    np.testing.assert_allclose(probabilities, expected[0], rtol=1e-5, atol=1e-7)
    assert label.dtype == np.int64
    np.testing.assert_array_equal(label, expected[1])
    np.testing.assert_allclose(normed, expected[2], rtol=1e-4, atol=1e-5)


def _printed(text):
    return [[float(v) for v in line.split()] for line in text.strip().splitlines()]


def test_jit_prints_floats_and_argmax_integers(head, capfd):
    namespace, _ = head
    x = RNG.standard_normal((3, 8)).astype(np.float32)
    outputs = hexir.jit(namespace["head"], cache=False)(x)
    _check_head(outputs, namespace, x)
    printed = capfd.readouterr().out.splitlines()
    assert len(printed) == 4
    np.testing.assert_allclose(_printed("\n".join(printed[:3])), outputs[0], atol=6e-7)  # %f: 6 decimals
    assert printed[3] == "".join(f"{int(v)} " for v in outputs[1])  # integers, not %f


def test_export_then_load_runs_every_batch(head, tmp_path):
    namespace, _ = head
    path = hexir.export(namespace["head"], tmp_path / "head.hxb", hexir.TensorSpec(("batch", 8), "float32"))
    for device in ("cpu", "reference"):  # the compiled kernels, and numpy on the manifest's trees
        with load(path, device=device, prints=False) as module:
            assert str(module.signature("main")) == \
                "main(x: float32[batch, 8]) -> (float32[batch, 6], int64[batch], float32[batch, 6])"
            for rows in (1, 5):
                x = RNG.standard_normal((rows, 8)).astype(np.float32)
                _check_head(module.main(x), namespace, x)


def test_hexir_run_prints_integers_and_saves_every_output(head, tmp_path, capsys):
    namespace, _ = head
    path = hexir.export(namespace["head"], tmp_path / "head.hxb", hexir.TensorSpec(("batch", 8), "float32"))
    x = RNG.standard_normal((4, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    saved = tmp_path / "out.npz"
    assert hexir_run([str(path), "--input", f"x={tmp_path / 'x.npy'}", "--output", str(saved)]) == 0
    text = capsys.readouterr().out
    expected = _head_reference(namespace, x)
    labels = "".join(f"{v} " for v in expected[1])
    assert f"\n{labels}\n" in text  # what the module prints: the argmax as %d
    assert "output1: int64[4]\n" in text and f"[{' '.join(map(str, expected[1]))}]" in text
    with np.load(saved) as outputs:
        assert sorted(outputs.files) == ["output0", "output1", "output2"]
        assert [outputs[k].dtype for k in sorted(outputs.files)] == [np.float32, np.int64, np.float32]
        _check_head([outputs[k] for k in sorted(outputs.files)], namespace, x)


def test_explain_shows_the_fused_epilogue(head):
    namespace, _ = head
    dot = hexir.explain(namespace["head"], hexir.TensorSpec(("batch", 8), "float32"))
    # the scale, the shift and the gelu are the linear's epilogue over a0 (its sums plus bias)
    assert "linear → 0.5 * (a0 * 0.5 + 1) * (1 + erf((a0 * 0.5 + 1) * 0.7071067811865" in dot
    assert '[label="softmax\\nfloat32[batch, 6]"' in dot
    assert '[label="argmax\\nint64[batch]"' in dot
    assert '[label="layer_norm (g, b)\\nfloat32[batch, 6]"' in dot
    assert "hexir.gelu" not in dot and "mul" not in dot  # no separate element-wise nodes


@pytest.mark.parametrize(("stage", "shows", "hides"), [
    ("mlir", ['"hexir.gelu"', '"hexir.softmax"', '"hexir.layer_norm"', '"hexir.argmax"', 'tensor<?xi64, "batch">',
              '"hexir.mul"'], []),
    ("mlir-tir", ["hextir.kernel", "hextir.expr", "erf"], ['"hexir.softmax"', '"hexir.gelu"']),
    # one function per kernel; the math is inline polynomials (vectorised), no libm calls
    ("llvm", ["define void @linear_", "define void @softmax_", "define void @argmax_", "define void @layer_norm_",
              "@llvm.fmuladd.v"], ["hexir.", "hextir.", "@expf", "@erff"]),
])
def test_the_hexir_command_emits_each_stage(head, stage, shows, hides, capsys):
    _, path = head
    assert hexir_command([f"{path}:head", "-spec=x=batchx8xf32", f"-emit={stage}"]) == 0
    text = capsys.readouterr().out
    for needle in shows:
        assert needle in text, f"-emit={stage} lacks {needle!r}"
    for needle in hides:
        assert needle not in text, f"-emit={stage} still has {needle!r}"


def test_the_hexir_command_places_every_op_on_cuda(head, tmp_path, capsys):
    _, path = head
    argv = [f"{path}:head", "-spec=x=batchx8xf32", "-placement=*=cuda"]
    assert hexir_command([*argv, "-emit=mlir-hetero"]) == 0
    text = capsys.readouterr().out
    compute = [line for line in text.splitlines() if '"hexir.' in line and "device" in line
               and not any(k in line for k in ('"hexir.print"', '"hexir.constant"', '"hexir.transfer"'))]
    assert compute and all('device = "cuda"' in line for line in compute), compute
    output = tmp_path / "head_cuda.hxb"
    assert hexir_command([*argv, "-emit=hxb", "-o", str(output)]) == 0
    kernels = manifest(output.read_bytes())["kernels"]
    assert kernels and {k["device"] for k in kernels} == {"cuda"}
    assert {k["op"] for k in kernels} >= {"linear", "reduce"}


def test_placement_star_keeps_a_named_op_on_the_cpu():
    @hexir.jit(placement="*=cuda,hexir.argmax=cpu", cache=False)
    def head(x):
        return hexir.softmax(x * 2.0), hexir.argmax(x)

    x = RNG.standard_normal((2, 5)).astype(np.float32)
    probabilities, label = head(x)  # without a GPU: the cuda kernels' cpu twins
    np.testing.assert_allclose(probabilities, _softmax(2 * x), rtol=1e-5)
    np.testing.assert_array_equal(label, x.argmax(-1))
    hetero = hexir.explain(head, x)  # the jit function's placement: softmax on cuda (green), argmax cpu (blue)
    assert re.search(r'softmax[^\n]*fillcolor="#c9e6b8"', hetero), hetero
    assert re.search(r'argmax[^\n]*fillcolor="#cfe2f3"', hetero), hetero


def test_a_user_defined_gelu_compiles_runs_and_fuses():
    from hexir import scalar as s

    my_gelu = hexir.register_op(hexir.Pointwise(
        "api_test_gelu", lambda x: 0.5 * x * (1 + s.erf(x * 0.7071067811865476))))

    @hexir.jit(cache=False)
    def layer(x):
        return my_gelu(hexir.linear(x, W, B))

    x = RNG.standard_normal((3, 8)).astype(np.float32)
    np.testing.assert_allclose(layer(x), _gelu(x.astype(np.float64) @ W + B), rtol=1e-5, atol=1e-6)
    assert "linear → 0.5 * a0 * (1 + erf(a0 * 0.7071067811865476))" in hexir.explain(layer, x)


def test_the_example_in_the_api_doc_is_what_runs(tmp_path):
    """docs/api.md's register_op example, run as written there (so it cannot drift)."""
    body = (REPO / "docs" / "api.md").read_text()
    start = body.index("from hexir import scalar as s\n\nmy_gelu")
    example = textwrap.dedent(body[start:body.index("```", start)])
    g = np.linspace(0.5, 1.5, 6).astype(np.float32)
    namespace = {"hexir": hexir, "W": W, "g": g}
    exec(compile(example.replace('"my_gelu"', '"doc_gelu"').replace('"rms_norm"', '"doc_rms_norm"'),
                 str(tmp_path / "example.py"), "exec"), namespace)  # noqa: S102 - the doc's own example
    x = RNG.standard_normal((2, 8)).astype(np.float32)
    h = _gelu(x.astype(np.float64) @ W)
    expected = h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-6) * g
    np.testing.assert_allclose(namespace["block"](x), expected, rtol=1e-5, atol=1e-6)
