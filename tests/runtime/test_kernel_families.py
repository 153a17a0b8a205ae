"""Kernels as families (format version 4, issue #23): each generated kernel checked by its
family's contract and computed by the reference device from its `expr`; the scalar-expression
language's refusals; the upgrade of versions 1-3; int64 (an argmax) through every user-facing
path. Modules are built by hand (conftest.Builder), as the compiler's packager builds them."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
from hexir_runtime import HxbFormatError, InputError, KernelError, load
from hexir_runtime import format as hxb
from hexir_runtime.cli import main as hexir_run
from hexir_runtime.dlpack import CPU, DLPackArray, unpack
from hexir_runtime.format import scalars

A0, A1, A2 = ["arg", 0], ["arg", 1], ["arg", 2]
RELU = ["max", A0, ["const", 0]]
SOFTMAX = {"axis": 1, "reductions": [["max", A0], ["sum", ["exp", ["sub", A0, ["red", 0]]]]],
           "out": ["div", ["exp", ["sub", A0, ["red", 0]]], ["red", 1]]}
ARGMAX = {"axis": 1, "reductions": [["argmax", A0]], "out": ["red", 0]}
MEAN = {"axis": 1, "reductions": [["sum", A0]], "out": ["div", ["red", 0], ["len"]]}
MEAN_OF = ["div", ["red", 0], ["len"]]
LAYER_NORM = {"axis": 1, "reductions": [["sum", A0], ["sum", ["pow", ["sub", A0, MEAN_OF], ["const", 2]]]],
              "out": ["add", ["mul", ["mul", ["sub", A0, MEAN_OF],
                                      ["rsqrt", ["add", ["div", ["red", 1], ["len"]], ["const", 1e-5]]]], A1], A2]}


def generated(builder, op: str, expr, specs: list[tuple[list, str]]) -> int:
    """A generated cpu kernel `op` computing `expr` over args of (shape, dtype), the last written."""
    args = [{"shape": list(shape), "dtype": dtype, "access": "read"} for shape, dtype in specs]
    args[-1]["access"] = "write"
    index = len(builder.kernels)
    kernel = {"name": f"k{index}_{op}", "op": op, "device": "cpu", "symbol": f"k{index}", "args": args,
              "sizes": list(dict.fromkeys(d for shape, _ in specs for d in shape if isinstance(d, str))),
              "work": {"extent": 1, "grain": 1}}
    if expr is not None:
        kernel["expr"] = expr
    builder.kernels.append(kernel)
    return index


def one_kernel(modules, op: str, expr, inputs: list[tuple[list, str]], out: tuple[list, str]):
    """`main(a0, a1, ...) -> out`: one kernel over the entry's inputs."""
    builder = modules.Builder()
    kernel = generated(builder, op, expr, [*inputs, out])
    entry = builder.entry()
    entry.ret(entry.call(kernel, *(entry.input(f"a{i}", shape, dtype) for i, (shape, dtype) in enumerate(inputs))))
    return builder.build()


def reference(modules, op, expr, inputs, out):
    return load(hxb.encode(*one_kernel(modules, op, expr, inputs, out)), "reference")


# --- the reference device computes each family from its expr ----------------------------------


def test_pointwise_broadcasts_its_inputs_as_numpy(modules):
    rng = np.random.default_rng(0)
    x, row, column = rng.standard_normal((3, 4)), rng.standard_normal(4), rng.standard_normal((3, 1))
    tree = ["add", ["mul", A0, A1], ["tanh", A2]]
    module = reference(modules, "pointwise", tree, [(["batch", 4], "float64"), ([4], "float64"),
                                                    (["batch", 1], "float64")], (["batch", 4], "float64"))
    np.testing.assert_allclose(module.main(x, row, column), x * row + np.tanh(column), rtol=1e-15)
    gelu = ["mul", ["mul", ["const", 0.5], A0], ["add", ["const", 1], ["erf", ["mul", A0, ["const", 2 ** -0.5]]]]]
    module = reference(modules, "pointwise", gelu, [([5], "float32")], ([5], "float32"))
    values = np.float32([-2, -0.5, 0, 0.5, 3])
    expected = [0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in values.tolist()]
    result = module.main(values)
    assert result.dtype == np.float32
    np.testing.assert_allclose(result, expected, rtol=1e-6, atol=1e-7)
    outer = reference(modules, "pointwise", ["sub", A0, A1], [([3, 1], "float32"), ([4], "float32")],
                      ([3, 4], "float32"))  # out is the broadcast of both
    np.testing.assert_array_equal(outer.main(np.float32([[1], [2], [3]]), np.float32([0, 1, 2, 3])),
                                  np.float32([[1], [2], [3]]) - np.float32([0, 1, 2, 3]))


def test_a_linear_applies_its_tree_to_the_product_and_its_epilogue_inputs(modules):
    rng = np.random.default_rng(1)
    x, w, residual, scale = (rng.standard_normal(s).astype(np.float32) for s in ((3, 5), (5, 4), (3, 4), (1, 4)))
    tree = ["add", ["mul", A0, A2], A1]  # x @ w * scale + residual
    module = reference(modules, "linear", tree, [([3, 5], "float32"), ([5, 4], "float32"), ([3, 4], "float32"),
                                                 ([1, 4], "float32")], ([3, 4], "float32"))
    np.testing.assert_allclose(module.main(x, w, residual, scale), x @ w * scale + residual, rtol=1e-5, atol=1e-6)


def test_reductions_over_rows_and_columns(modules):
    rng = np.random.default_rng(2)
    x, weight, bias = rng.standard_normal((3, 5)), rng.standard_normal(5), rng.standard_normal(5)
    inputs = [(["n", 5], "float64")]
    softmax = reference(modules, "reduce", SOFTMAX, inputs, (["n", 5], "float64")).main(x)
    np.testing.assert_allclose(softmax, np.exp(x) / np.exp(x).sum(axis=1, keepdims=True), rtol=1e-14)
    np.testing.assert_allclose(reference(modules, "reduce", MEAN, inputs, (["n"], "float64")).main(x), x.mean(axis=1),
                               rtol=1e-14)
    kept = reference(modules, "reduce", MEAN, inputs, (["n", 1], "float64")).main(x)
    np.testing.assert_allclose(kept, x.mean(axis=1, keepdims=True), rtol=1e-14)
    columns = {**MEAN, "axis": 0}
    np.testing.assert_allclose(reference(modules, "reduce", columns, inputs, ([5], "float64")).main(x), x.mean(axis=0),
                               rtol=1e-14)
    norm = reference(modules, "reduce", LAYER_NORM, [*inputs, ([5], "float64"), ([5], "float64")],
                     (["n", 5], "float64")).main(x, weight, bias)
    centred = x - x.mean(axis=1, keepdims=True)
    expected = centred / np.sqrt((centred ** 2).mean(axis=1, keepdims=True) + 1e-5) * weight + bias
    np.testing.assert_allclose(norm, expected, rtol=1e-12)


def test_an_argmax_is_int64_and_the_first_maximum(modules):
    module = reference(modules, "reduce", ARGMAX, [(["n", 4], "float32")], (["n"], "int64"))
    x = np.float32([[1, 5, 5, 0], [-1, -2, -3, -4], [0, 0, 0, 7]])
    result = module.main(x)
    assert result.dtype == np.int64 and result.tolist() == [1, 0, 3]
    assert module.main(np.zeros((0, 4), np.float32)).shape == (0,)  # no rows: nothing runs
    empty = reference(modules, "reduce", ARGMAX, [([2, "m"], "float32")], ([2], "int64"))
    with pytest.raises(KernelError, match=r"^kernels\[0\] \(k0_reduce\): the max or argmax of an empty axis "
                                          r"\(axis 1 of \[2, 0\]\) has no value"):
        empty.main(np.zeros((2, 0), np.float32))


# --- each family's contract, each refusal naming its field -------------------------------------


def bases(modules) -> dict[str, tuple[dict, list]]:
    """One valid module (manifest, blobs) per family: a bias-add linear, a 2-input pointwise, an
    argmax (keepdims), a pack_panels."""
    return {
        "linear": one_kernel(modules, "linear", ["add", A0, A1], [([2, 3], "float32"), ([3, 4], "float32"),
                                                                   ([4], "float32")], ([2, 4], "float32")),
        "pointwise": one_kernel(modules, "pointwise", ["mul", A0, A1], [(["b", 4], "float32"), ([4], "float32")],
                                (["b", 4], "float32")),
        "reduce": one_kernel(modules, "reduce", ARGMAX, [(["b", 4], "float64")], (["b", 1], "int64")),
        "pack": one_kernel(modules, "pack_panels", None, [([8, 40], "float32")], ([2, 8, 32], "float32")),
    }


def _shape(kernel: dict, arg: int, shape: list) -> None:
    kernel["args"][arg]["shape"] = shape


CONTRACTS = {  # base -> mutation of its kernel -> (field, part of the message)
    "unknown op": ("pointwise", lambda k: k.update(op="relu"), "kernels[0].op", "unknown op 'relu'"),
    "no expr": ("pointwise", lambda k: k.pop("expr"), "kernels[0].expr", "missing (a pointwise kernel"),
    "expr on pack_panels": ("pack", lambda k: k.update(expr=A0), "kernels[0].expr", "pack_panels has none"),
    "epilogues": ("linear", lambda k: k.update(epilogues=["bias"]), "kernels[0].epilogues", "unknown key"),
    "bad tree": ("pointwise", lambda k: k.update(expr=["relu", A0]), "kernels[0].expr", "unknown op 'relu'"),
    "not a tree": ("pointwise", lambda k: k.update(expr="a0 * a1"), "kernels[0].expr", "expected [op, ...]"),
    "arg out of range": ("pointwise", lambda k: k.update(expr=["mul", A0, A2]), "kernels[0].expr[2][1]",
                         "expected an arg index below 2, got 2"),
    "linear arg out of range": ("linear", lambda k: k.update(expr=["add", A0, A2]), "kernels[0].expr[2][1]",
                                "expected an arg index below 2, got 2"),
    "pointwise not broadcasting": ("pointwise", lambda k: _shape(k, 1, [3]), "kernels[0].args[1].shape",
                                   "[3] does not broadcast to out's shape [\"b\", 4]"),
    "symbol is not a number": ("pointwise", lambda k: _shape(k, 1, ["b"]), "kernels[0].args[1].shape",
                               "[\"b\"] does not broadcast"),
    "pointwise extra extent": ("pointwise", lambda k: _shape(k, 2, [3, "b", 4]), "kernels[0].args[2].shape",
                               "expected the inputs' broadcast shape [\"b\", 4], got [3, \"b\", 4]"),
    "pointwise stretched out": ("pointwise", lambda k: [_shape(k, 0, [1, 4]), _shape(k, 2, ["b", 4])],
                                "kernels[0].args[2].shape", "expected the inputs' broadcast shape [1, 4]"),
    "epilogue not broadcasting": ("linear", lambda k: _shape(k, 2, [2]), "kernels[0].args[2].shape",
                                  "[2] does not broadcast to out's shape [2, 4]"),
    "epilogue too big": ("linear", lambda k: _shape(k, 2, [1, 2, 4]), "kernels[0].args[2].shape", "does not broadcast"),
    "linear shapes": ("linear", lambda k: _shape(k, 1, [2, 4]), "kernels[0].args", "linear expects x[..., K], w[K, N]"),
    "linear mixed dtypes": ("linear", lambda k: k["args"][2].update(dtype="float64"), "kernels[0].args[2].dtype",
                            "expected float32 like args[0]"),
    "int64 in a pointwise": ("pointwise", lambda k: [a.update(dtype="int64") for a in k["args"]],
                             "kernels[0].args[0].dtype", "int64 is only a reduce's argmax output"),
    "argmax into a float": ("reduce", lambda k: k["args"][1].update(dtype="float64"), "kernels[0].args[1].dtype",
                            "an argmax's output is int64, got 'float64'"),
    "argmax of int64": ("reduce", lambda k: k["args"][0].update(dtype="int64"), "kernels[0].args[0].dtype",
                        "int64 is only a reduce's argmax output"),
    "sum into int64": ("reduce", lambda k: k.update(expr=MEAN), "kernels[0].args[1].dtype",
                       "expected one of float32, float64, bfloat16, float16 (int64 is only a reduce's argmax "
                       "output), got 'int64'"),
    "rows out full": ("reduce", lambda k: _shape(k, 1, ["b", 4]), "kernels[0].args[1].shape",
                      "one per row over axis 1: expected [\"b\"] or [\"b\", 1], got [\"b\", 4]"),
    "rows out of another axis": ("reduce", lambda k: _shape(k, 1, [4]), "kernels[0].args[1].shape",
                                 "expected [\"b\"] or [\"b\", 1]"),
    "full out as rows": ("reduce", lambda k: [k.update(expr=SOFTMAX), k["args"][1].update(dtype="float64")],
                         "kernels[0].args[1].shape", "one per element of args[0]: expected [\"b\", 4], got [\"b\", 1]"),
    "reduce input not broadcasting": ("reduce", lambda k: k["args"].insert(1, {"shape": [5], "dtype": "float64",
                                                                               "access": "read"}),
                                      "kernels[0].args[1].shape", "[5] does not broadcast to args[0]'s shape"),
    "axis past the rank": ("reduce", lambda k: k["expr"].update(axis=2), "kernels[0].expr.axis",
                           "below the input's rank 2, got 2"),
    "argmax not the output": ("reduce", lambda k: k["expr"].update(out=["add", ["red", 0], ["const", 1]]),
                              "kernels[0].expr.out", "an argmax program's output is its argmax"),
    "red in a pointwise": ("pointwise", lambda k: k.update(expr=["red", 0]), "kernels[0].expr[1]",
                           "expected an red index below 0"),
    "len in a pointwise": ("pointwise", lambda k: k.update(expr=["len"]), "kernels[0].expr",
                           "exists only in a reduce kernel"),
    "pack shapes": ("pack", lambda k: _shape(k, 1, [1, 8, 32]), "kernels[0].args", "pack_panels expects w[K, N]"),
    "no inputs": ("pointwise", lambda k: [k.update(expr=["const", 1]), k["args"].pop(0), k["args"].pop(0)],
                  "kernels[0].args", "pointwise takes at least 2 args, got 1"),
}


@pytest.mark.parametrize("name", CONTRACTS)
def test_a_family_contract_refusal_names_its_field(modules, name):
    base, mutate, field, text = CONTRACTS[name]
    manifest, blobs = copy.deepcopy(bases(modules)[base])
    mutate(manifest["kernels"][0])
    for arg, buffer in zip(manifest["kernels"][0]["args"], manifest["entries"][0]["buffers"], strict=False):
        buffer.update(shape=arg["shape"], dtype=arg["dtype"])  # (the entry agrees: only the kernel is wrong)
    with pytest.raises(HxbFormatError) as caught:
        hxb.encode(manifest, blobs)
    assert caught.value.field == field, str(caught.value)
    assert text in caught.value.reason, str(caught.value)


def test_the_bases_are_valid(modules):
    for manifest, blobs in bases(modules).values():
        hxb.encode(manifest, blobs)


def deep(depth: int) -> list:
    return A0 if depth == 1 else ["neg", deep(depth - 1)]


def wide(leaves: int) -> list:
    return A0 if leaves == 1 else ["add", wide(leaves // 2), wide(leaves - leaves // 2)]


@pytest.mark.parametrize("tree, field, text", [
    (deep(65), "e", "deeper than 64 or larger than 4096 nodes"),
    (wide(2049), "e", "deeper than 64 or larger than 4096 nodes"),
    (["add", A0, ["const", float("inf")]], "e[2]", "a finite number"),
    (["add", A0, ["const", 10 ** 400]], "e[2]", "a finite number"),
    (["add", A0, ["const", True]], "e[2]", "a finite number"),
    (["pow", A0, A0], "e[2]", "pow's exponent must be a const"),
    (["red", 0], "e[1]", "expected an red index below 0"),
    (["len"], "e", "exists only in a reduce kernel"),
    (["exp", A0, A0], "e", "exp takes 1 operand(s), got 2"),
    (["arg", -1], "e[1]", "expected an arg index below 1"),
    (["arg", True], "e[1]", "expected an arg index below 1"),
    ([], "e", "expected [op, ...]"),
])
def test_scalar_expressions_are_checked_as_untrusted_input(tree, field, text):
    assert scalars.check(deep(64), "e", 1) and scalars.check(wide(2048), "e", 1)  # the limits themselves pass
    with pytest.raises(HxbFormatError) as caught:
        scalars.check(tree, "e", 1)
    assert (caught.value.field, text in caught.value.reason) == (field, True), str(caught.value)


# --- versions 1 to 3 are upgraded -------------------------------------------------------------


def test_a_version_3_module_is_upgraded_and_runs_with_its_version_3_table(modules, compile_c):
    manifest, _ = modules.mlp()
    old = modules.older(manifest, 3)
    library = compile_c(modules.kernels_code + modules.table_c(old["kernels"]), "version3")
    manifest, blobs = modules.mlp(library)
    data = modules.encode_as(manifest, blobs, 3)
    module = hxb.decode(data)
    assert module.version == 3
    assert [(kernel.op, kernel.expr) for kernel in module.manifest.kernels] == [
        ("linear", ["add", A0, A1]), ("pointwise", RELU), ("linear", A0), ("linear", A0)]
    x = np.random.default_rng(3).standard_normal((2, 8)).astype(np.float32)
    expected = modules.mlp_numpy(x, modules.weights())
    np.testing.assert_allclose(load(data, "cpu").layers(x)[1], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(load(data, "reference").layers(x)[1], expected, rtol=1e-5, atol=1e-5)
    relabelled = copy.deepcopy(old)  # the table still says bias alone: relu added by the manifest is refused
    relabelled["kernels"][0]["epilogues"] = ["bias", "relu"]
    with pytest.raises(HxbFormatError, match=r"^kernels\[0\]\.expr: k0_linear_bias: the manifest says \["):
        load(_written(relabelled, blobs, 3), "cpu")


def _written(manifest: dict, blobs: list, version: int) -> bytes:
    """An older manifest (already spelled as `version` spells it) written unchecked as `version`."""
    original = hxb.container.decode
    hxb.container.decode = lambda data: None
    try:
        data = hxb.encode(manifest, blobs)
    finally:
        hxb.container.decode = original
    return data[:8] + version.to_bytes(4, "little") + data[12:]


@pytest.mark.parametrize("edit, field, text", [
    (lambda m: m["kernels"][0].update(epilogues=["bias", "gelu"]), "kernels[0].epilogues[1]",
     'a version-3 epilogue "gelu" has no meaning this runtime knows (only bias, first, and relu): rebuild the module'),
    (lambda m: m["kernels"][0].update(epilogues=["relu", "bias"]), "kernels[0].epilogues[1]", '"bias" has no meaning'),
    (lambda m: m["kernels"][1].update(epilogues=["relu"]), "kernels[1].epilogues",
     'a relu kernel has no epilogues, got ["relu"]'),
    (lambda m: m["kernels"][0].update(epilogues="bias"), "kernels[0].epilogues", "expected an array"),
    (lambda m: m["kernels"][1].update(expr=RELU), "kernels[1].expr", "unknown key in a version-3 file"),
    (lambda m: m["kernels"][1].update(op="sigmoid"), "kernels[1].op", "unknown op 'sigmoid'"),
])
def test_an_older_manifest_that_does_not_upgrade_is_refused_naming_the_field(modules, edit, field, text):
    manifest, blobs = modules.mlp()
    old = modules.older(manifest, 3)
    edit(old)
    with pytest.raises(HxbFormatError) as caught:
        hxb.decode(_written(old, blobs, 3))
    assert (caught.value.field, text in caught.value.reason) == (field, True), str(caught.value)


def test_pack_panels_of_version_3_has_no_expr(modules):
    manifest, blobs = copy.deepcopy(bases(modules)["pack"])
    manifest["kernels"][0]["epilogues"] = []
    kernel = hxb.decode(_written(manifest, blobs, 3)).manifest.kernels[0]
    assert (kernel.op, kernel.expr) == ("pack_panels", None)


# --- int64: an argmax returned to the user -----------------------------------------------------


def argmax_module(modules, library: bytes | None = None):
    """`main(x: float32[n, 4]) -> (int64[n], float32[n])`: each row's argmax (printed) and max."""
    builder = modules.Builder()
    argmax = generated(builder, "reduce", ARGMAX, [(["n", 4], "float32"), (["n"], "int64")])
    biggest = generated(builder, "reduce", {"axis": 1, "reductions": [["max", A0]], "out": ["red", 0]},
                        [(["n", 4], "float32"), (["n"], "float32")])
    for kernel, symbol in ((argmax, "argmax_rows"), (biggest, "max_rows")):
        builder.kernels[kernel].update(symbol=symbol, work={"extent": "n", "grain": 1})
    entry = builder.entry()
    x = entry.input("x", ["n", 4])
    indices = entry.call(argmax, x)
    entry.print(indices)
    entry.ret(indices, entry.call(biggest, x))
    return builder.build(library)


ARGMAX_C = """
void argmax_rows(const float *x, int64_t *out, int64_t n, int64_t first, int64_t last) {
  for (int64_t i = first; i < last; ++i) {
    int64_t best = 0;
    for (int64_t j = 1; j < 4; ++j) if (x[i * 4 + j] > x[i * 4 + best]) best = j;
    out[i] = best;
  }
}
void max_rows(const float *x, float *out, int64_t n, int64_t first, int64_t last) {
  for (int64_t i = first; i < last; ++i) {
    float best = x[i * 4];
    for (int64_t j = 1; j < 4; ++j) if (x[i * 4 + j] > best) best = x[i * 4 + j];
    out[i] = best;
  }
}
"""
X = np.float32([[1, 5, 5, 0], [-1, -2, -3, -4], [0, 0, 0, 7]])


@pytest.mark.parametrize("device", ["reference", "cpu"])
def test_an_int64_output_through_the_executor_out_and_print(modules, compile_c, capsys, device):
    manifest, _ = argmax_module(modules)
    library = compile_c(ARGMAX_C + modules.table_c(manifest["kernels"]), "argmax") if device == "cpu" else None
    module = load(hxb.encode(*argmax_module(modules, library)), device)
    assert str(module.signature("main")) == "main(x: float32[n, 4]) -> (int64[n], float32[n])"
    indices, maxima = module.main(X)
    assert indices.dtype == np.int64 and indices.tolist() == [1, 0, 3] and maxima.tolist() == [5, -1, 7]
    assert capsys.readouterr().out == "1 0 3 \n"  # an int64 prints as integers
    into = (np.empty(3, np.int64), np.empty(3, np.float32))
    assert module.main(X, out=into)[0] is into[0] and into[0].tolist() == [1, 0, 3]
    with pytest.raises(InputError, match=r"main\(\): out\[0\] expects int64\[n\], got float64\[3\]"):
        module.main(X, out=(np.empty(3), into[1]))


def test_hexir_run_prints_int64_outputs_as_integers_and_saves_every_output(modules, tmp_path, capsys):
    hxb.write(tmp_path / "argmax.hxb", *argmax_module(modules))
    np.save(tmp_path / "x.npy", X)
    saved = tmp_path / "out.npz"
    code = hexir_run([str(tmp_path / "argmax.hxb"), "--device=reference", "--input", f"x={tmp_path / 'x.npy'}",
                      "--output", str(saved)])
    out = capsys.readouterr().out
    assert code == 0 and "--\n1 0 3 \noutput0: int64[3]\n[1 0 3]\noutput1: float32[3]\n[ 5. -1.  7.]\n" in out
    with np.load(saved) as archive:
        assert archive.files == ["output0", "output1"]
        assert archive["output0"].dtype == np.int64 and archive["output0"].tolist() == [1, 0, 3]
        assert archive["output1"].dtype == np.float32
    assert hexir_run([str(tmp_path / "argmax.hxb"), "--info"]) == 0
    info = capsys.readouterr().out
    assert "[0] k0_reduce: cpu reduce(read float32[n, 4], write int64[n])\n" in info
    assert "      computes over axis 1: r0 = argmax(a0); out = r0\n" in info
    assert "entry main(x: float32[n, 4]) -> (int64[n], float32[n])" in info


def test_an_int64_input_is_taken_and_returned(modules):
    builder = modules.Builder()
    entry = builder.entry()
    entry.ret(entry.input("ids", [3], "int64"))
    module = load(hxb.encode(*builder.build()), "reference")
    assert module.main(np.int64([4, 5, 2**40])).tolist() == [4, 5, 2**40]
    with pytest.raises(InputError, match="int64"):
        module.main(np.float64([4, 5, 6]))


def test_int64_through_dlpack_both_ways():
    memory = np.arange(6, dtype=np.int64).reshape(2, 3)
    array = DLPackArray(memory.ctypes.data, (2, 3), np.int64, (CPU, 0))
    taken = np.from_dlpack(array)  # our export says kDLInt, 64 bits
    assert taken.dtype == np.int64 and taken.tolist() == memory.tolist()
    tensor = unpack(array.__dlpack__())
    assert tensor.dtype == np.int64 and tensor.shape == (2, 3)
    assert unpack(memory.__dlpack__()).dtype == np.int64  # numpy's int64 read as ours
