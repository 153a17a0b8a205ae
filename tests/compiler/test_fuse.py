"""fuse (the first pass of -emit=mlir-tir): a relu that is the only user of a linear on the same
device becomes that linear's epilogue (`hexir.epilogue`, relu's tree max(a0, 0) over the sums,
the relu gone), and lower-to-tir makes one kernel of the pair, a `linear` whose `hextir.expr`
(the manifest's `expr`) is max(a0, 0), or max(a0 + a1, 0) with a bias a1 (written `linear_relu` /
`linear_bias_relu` here), whose last step is max(., 0). Anything else that uses the linear's
result (a print, the return, a second op), or a device change between the two, keeps them apart.
The other families' fusion (pointwise chains, reduce prologues) is tests/compiler/test_families.py.

Checked on the graph fuse leaves (fuse called on a parsed, partitioned module: what lower-to-tir
gets), on the tir kernels, and end to end against numpy."""

# IR lines are checked as printed: wrapping them would change what they check.
# ruff: noqa: E501

from __future__ import annotations

import json
import re

import hexir_runtime
import numpy as np
import pytest
from hexir_runtime import format as hxb
from hexir_runtime.cpu import CpuDevice

import hexir
from hexir.driver import Options, run_stage
from hexir.errors import TraceError
from hexir.passes.fuse import fuse

from .conftest import cpu_linear_tiles, cpu_tile_rows, family_attrs, filecheck, lower, parse

X, W, B, Y = "tensor<3x5xf32>", "tensor<5x7xf32>", "tensor<7xf32>", "tensor<3x7xf32>"
RELU = family_attrs("relu")
RELU_TREE = ["max", ["arg", 0], ["const", 0.0]]
BIAS_RELU_TREE = ["max", ["add", ["arg", 0], ["arg", 1]], ["const", 0.0]]  # a1: the bias


def program(*, linear: str = "cpu", relu: str | None = None, bias: bool = False,
            tail: str = f"return %2 : {Y}", results: str = Y, extra: str = "", rows: int = 3) -> str:
    """@main(x[3, 5]): %1 = linear(x, W[, b]) on `linear`, %2 = relu(%1) on `relu` (the linear's
    device unless given), then `extra` ops and the `tail` (by default: return %2); `rows`
    other than 3 makes x[rows, 5]."""
    if rows != 3:
        return program(linear=linear, relu=relu, bias=bias, tail=tail, results=results, extra=extra).replace(
            "tensor<3x", f"tensor<{rows}x")
    operands, types = ("%arg0, %w, %b", f"{X}, {W}, {B}") if bias else ("%arg0, %w", f"{X}, {W}")
    bias_constant = (f'  %b = "hexir.constant"() {{device = "auto", name = "b", value = dense<-1.0> : {B}}} : () -> {B}\n'
                     if bias else "")
    return f"""
func.func @main(%arg0: {X}) -> {results} {{
  %w = "hexir.constant"() {{device = "auto", name = "W", value = dense<0.5> : {W}}} : () -> {W}
{bias_constant}  %1 = "hexir.linear"({operands}) {{device = "{linear}", operandSegmentSizes = array<i32: 1, 1, {int(bias)}, 0, 0, 0, 0>}} : ({types}) -> {Y}
  %2 = "hexir.relu"(%1) {{device = "{relu or linear}", {RELU}}} : ({Y}) -> {Y}
{extra}  {tail}
}}
"""


def fused(text: str) -> str:
    """The printed graph after partition and fuse: what lower-to-tir starts from."""
    module = run_stage(parse(text), "mlir-hetero", Options())
    with module.context:
        fuse(module)
        assert module.operation.verify()
    return str(module)


def printed(tree: object) -> str:
    """A tree as the IR prints it in an attribute (`"[\\22max\\22,...]"`)."""
    return '"' + json.dumps(tree, separators=(",", ":")).replace('"', "\\22") + '"'


def named(kind: str, tree: object) -> str:
    """A kernel's op and what its tree applies, in order: `linear_bias_relu` for a linear whose
    tree is max(a0 + a1, 0) (a1 its bias), `pointwise_relu_relu` for max(max(a0, 0), 0); a cpu
    linear reading a constant w in panels, `linear_panels`, is a linear here: fusing is the same
    for both, and test_lowering.py checks the panels."""
    steps = []
    while tree not in (None, ["arg", 0]):
        if tree == ["add", ["arg", 0], ["arg", 1]] and kind.startswith("linear"):
            steps.append("bias")
            break
        assert tree[0] == "max" and tree[2] == ["const", 0.0], f"not a chain of relus: {tree}"
        steps.append("relu")
        tree = tree[1]
    return "_".join([kind.replace("linear_panels", "linear"), *reversed(steps)])


def kernel_ops(text: str) -> list[tuple[str, str, str]]:
    """(name, device, op) of each kernel of a printed mlir-tir module, in order (a cpu kernel's
    copies for the other x86-64 levels left out); the name with its number left out (`linear`,
    `linear_cpu`), the op with what its `hextir.expr` applies (`named`)."""
    found = []
    for line in text.splitlines():
        kernel = re.match(r'\s*func\.func public @(\w+)\(.*#hextir\.kernel<"(\w+)", "(\w+)">', line)
        if kernel:
            expr = re.search(r'hextir\.expr = "((?:[^"\\]|\\.)*)"', line)
            tree = json.loads(expr.group(1).replace("\\22", '"')) if expr else None
            found.append((re.sub(r"_[0-9]+", "", kernel.group(1)), kernel.group(2), named(kernel.group(3), tree)))
    return found


def manifest_op(kernel: dict) -> str:
    """A manifest kernel's op with what its `expr` applies: `linear_bias_relu` (see `named`)."""
    return named(kernel["op"], kernel.get("expr"))


# ---- fused: the relu is the linear's only user, on the linear's device ---------------------------

@pytest.mark.parametrize("bias", [False, True], ids=["linear", "linear_bias"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_relu_alone_on_its_linear_becomes_the_linears_epilogue(device, bias):
    text = fused(program(linear=device, bias=bias))
    types = f"{X}, {W}, {B}" if bias else f"{X}, {W}"
    back = ('CHECK-NEXT: %[[BACK:.+]] = "hexir.transfer"(%[[Y]]) {source = "cuda", target = "cpu"}\n'
            "        CHECK-NEXT: return %[[BACK]]") if device == "cuda" else "CHECK-NEXT: return %[[Y]]"
    filecheck(text, f"""
        CHECK-LABEL: func.func @main
        CHECK:       %[[Y:.+]] = "hexir.linear"(%{{{{.+}}}}) {{device = "{device}", hexir.epilogue = {printed(RELU_TREE)}, operandSegmentSizes = array<i32: 1, 1,
        CHECK-SAME: 0, 0, 0, 0>}} : ({types}) -> {Y}
        {back}
    """)
    assert text.count('"hexir.linear"') == 1 and "hexir.relu" not in text


def test_fuse_again_changes_nothing():
    module = run_stage(parse(program(bias=True)), "mlir-hetero", Options())
    with module.context:
        fuse(module)
        once = str(module)
        fuse(module)
    assert str(module) == once
    assert once.count(f"hexir.epilogue = {printed(RELU_TREE)}") == 1


@pytest.mark.parametrize("bias", [False, True], ids=["linear", "linear_bias"])
def test_the_cpu_kernel_applies_the_relu_to_the_sums_before_it_stores_them(bias):
    tree, out, buffers = (BIAS_RELU_TREE, "%arg3", "%arg0: memref<3x5xf32>, %arg1: memref<5x7xf32>, %arg2: memref<7xf32>, %arg3: memref<3x7xf32>") \
        if bias else (RELU_TREE, "%arg2", "%arg0: memref<3x5xf32>, %arg1: memref<5x7xf32>, %arg2: memref<3x7xf32>")
    # the sums start from the bias row, or from zeros
    start = "vector.load %arg2[%c0] : memref<7xf32>, vector<7xf32>" if bias else \
        "arith.constant dense<0.000000e+00> : vector<7xf32>"
    filecheck(lower(program(bias=bias), "mlir-tir"), f"""
        CHECK:       func.func public @[[LINEAR:linear_[0-9]+]]({buffers})
        CHECK-SAME:      hextir.expr = {printed(tree)}
        CHECK-SAME: hextir.kernel = #hextir.kernel<"cpu", "linear">, hextir.level = "x86-64-v4", hextir.sizes = [], hextir.work = {{extent = "{cpu_linear_tiles(3, 7, "float32")}", grain = 1 : i64, spans = true}}}}
        CHECK:       scf.if %{{{{[0-9]+}}}} {{
        CHECK:         %[[J0:[0-9]+]] = arith.addi %{{{{[0-9]+}}}}, %{{{{[0-9]+}}}} : index
        CHECK:         %[[START:[0-9a-z_]+]] = {start.replace("%c0]", "%[[J0]]]")}
        CHECK:         %[[U:[0-9]+]]:3 = scf.for %{{{{arg[0-9]+}}}} = %{{{{[0-9]+}}}} to %{{{{[0-9]+}}}} step %c4 iter_args(%{{{{arg[0-9]+}}}} = %[[START]], {{{{.+}}}}) -> (vector<7xf32>, vector<7xf32>, vector<7xf32>) {{
        CHECK-NOT:       arith.maximumf
        CHECK:         %[[S:[0-9]+]]:3 = scf.for %{{{{arg[0-9]+}}}} = %{{{{[0-9]+}}}} to %{{{{[0-9]+}}}} step %c1 iter_args(%{{{{arg[0-9]+}}}} = %[[U]]#0, {{{{.+}}}}) -> (vector<7xf32>, vector<7xf32>, vector<7xf32>) {{
        CHECK-NOT:       arith.maximumf
        CHECK:           scf.yield
        CHECK-NEXT:    }} {{hextir.schedule = #hextir.loop<"serial", "">}}
        CHECK-NOT:     vector.store
        CHECK:         %[[M:[0-9]+]] = arith.maximumf %[[S]]#0, %{{{{cst[_0-9]*}}}} : vector<7xf32>
        CHECK:         vector.store %[[M]], {out}[%c0, %[[J0]]] : memref<3x7xf32>, vector<7xf32>
        CHECK:       }} {{hextir.schedule = #hextir.loop<"parallel", "chunk">}}
        CHECK-NEXT:  return
        CHECK:       func.func public @"[[LINEAR]]@x86-64-v3"(
        CHECK:       func.func public @"[[LINEAR]]@x86-64"(
        CHECK-NOT:   func.func public
        CHECK-LABEL: func.func @main
        CHECK:       %[[Y:.+]] = "hexir.call"({{{{.+}}}}) {{callee = @[[LINEAR]], device = "cpu"
        CHECK-NEXT:  return %[[Y]]
    """)


@pytest.mark.parametrize("bias", [False, True], ids=["linear", "linear_bias"])
def test_the_cuda_kernel_applies_the_relu_as_it_stores_and_so_does_its_cpu_fallback(bias):
    op, out = ("linear_bias_relu", "%arg3") if bias else ("linear_relu", "%arg2")
    expr = printed(BIAS_RELU_TREE if bias else RELU_TREE)
    add_bias = """CHECK-NEXT:    %[[BIAS:.+]] = "hextir.load"(%arg2, %{{.+}}) : (memref<7xf32>, index) -> f32
        CHECK-NEXT:    %[[SB:.+]] = arith.addf %[[S]], %[[BIAS]] : f32
        CHECK-NEXT:    %[[M:.+]] = arith.maximumf %[[SB]], %{{.+}} : f32""" if bias else \
        "CHECK-NEXT:    %[[M:.+]] = arith.maximumf %[[S]], %{{.+}} : f32"
    text = lower(program(linear="cuda", bias=bias, rows=17), "mlir-tir")  # 17 rows: the SIMT kernel, one sum per thread
    filecheck(text, f"""
        CHECK:       func.func public @[[LINEAR:linear_[0-9]+]](
        CHECK-SAME:      hextir.expr = {expr}
        CHECK-SAME: hextir.kernel = #hextir.kernel<"cuda", "linear">
        CHECK-NOT:     arith.maximumf
        CHECK:         #hextir.loop<"serial", "">
        CHECK-NOT:     arith.maximumf
        CHECK:         scf.if
        CHECK-NEXT:    %[[S:.+]] = "hextir.load"(%{{{{.+}}}}) : (memref<1x1xf32>, index, index) -> f32
        {add_bias}
        CHECK-NEXT:    "hextir.store"(%[[M]], {out}, %{{{{.+}}}}, %{{{{.+}}}}) : (f32, memref<17x7xf32>, index, index) -> ()
        CHECK-NOT:     arith.maximumf
        CHECK:         #hextir.loop<"parallel", "blockIdx.y">
        CHECK-NEXT:    return

        CHECK:       func.func public @[[LINEAR]]_cpu(
        CHECK-SAME:      hextir.expr = {expr}, hextir.fallback_of = @[[LINEAR]]
        CHECK-SAME: hextir.kernel = #hextir.kernel<"cpu", "linear">
        CHECK:         arith.maximumf
        CHECK:         #hextir.loop<"parallel", "">
        CHECK-NEXT:    return

        CHECK-LABEL: func.func @main(
        CHECK:         %[[Y:.+]] = "hexir.call"({{{{.+}}}}) {{callee = @[[LINEAR]], device = "cuda"
        CHECK-NEXT:    %[[BACK:.+]] = "hexir.transfer"(%[[Y]]) {{source = "cuda", target = "cpu"}}
        CHECK-NEXT:    return %[[BACK]]
    """)
    assert kernel_ops(text) == [("linear", "cuda", op), ("linear_cpu", "cpu", op)]


# ---- not fused: the linear's result has another user, or the relu another device ----------------

OTHER_USERS = {
    "printed": ("CHECK-NEXT: \"hexir.print\"(%[[Y]])\n        CHECK-NEXT: return %[[R]]",
                dict(extra=f'  "hexir.print"(%1) : ({Y}) -> ()\n')),
    "returned": ("CHECK-NEXT: return %[[R]], %[[Y]]",
                 dict(tail=f"return %2, %1 : {Y}, {Y}", results=f"({Y}, {Y})")),
    "a second relu": (f"CHECK-NEXT: %[[R2:.+]] = \"hexir.relu\"(%[[Y]]) {{device = \"cpu\", {RELU}}}\n        CHECK-NEXT: return %[[R]], %[[R2]]",
                      dict(extra=f'  %3 = "hexir.relu"(%1) {{device = "cpu", {RELU}}} : ({Y}) -> {Y}\n',
                           tail=f"return %2, %3 : {Y}, {Y}", results=f"({Y}, {Y})")),
    "a second linear": ("CHECK-NEXT: %[[V:.+]] = \"hexir.constant\"()\n        CHECK-NEXT: %[[Z:.+]] = \"hexir.linear\"(%[[Y]], %[[V]]) {device = \"cpu\", operandSegmentSizes = array<i32: 1, 1, 0, 0, 0, 0, 0>}\n        CHECK-NEXT: return %[[R]], %[[Z]]",
                        dict(extra='  %v = "hexir.constant"() {device = "auto", name = "V", value = dense<1.0> : tensor<7x2xf32>} : () -> tensor<7x2xf32>\n'
                                   f'  %3 = "hexir.linear"(%1, %v) {{device = "cpu", operandSegmentSizes = array<i32: 1, 1, 0, 0, 0, 0, 0>}} : ({Y}, tensor<7x2xf32>) -> tensor<3x2xf32>\n',
                             tail=f"return %2, %3 : {Y}, tensor<3x2xf32>", results=f"({Y}, tensor<3x2xf32>)")),
}


@pytest.mark.parametrize("user", OTHER_USERS)
def test_a_linear_with_another_user_keeps_its_relu(user):
    checks, parts = OTHER_USERS[user]
    text = fused(program(**parts))
    filecheck(text, f"""
        CHECK-LABEL: func.func @main
        CHECK:       %[[Y:.+]] = "hexir.linear"(%arg0, %{{{{.+}}}}) {{device = "cpu", operandSegmentSizes = array<i32: 1, 1,
        CHECK-SAME: 0, 0, 0, 0>}} : ({X}, {W}) -> {Y}
        CHECK-NEXT:  %[[R:.+]] = "hexir.relu"(%[[Y]]) {{device = "cpu", {RELU}}} : ({Y}) -> {Y}
        {checks}
    """)
    assert "hexir.epilogue" not in text
    ops = [op for _, _, op in kernel_ops(lower(program(**parts), "mlir-tir"))]
    assert ops[:2] == ["linear", "pointwise_relu"] and "linear_relu" not in ops


@pytest.mark.parametrize(("linear", "relu"), [("cuda", "cpu"), ("cpu", "cuda")])
def test_a_relu_on_another_device_than_its_linear_stays_apart(linear, relu):
    text = fused(program(linear=linear, relu=relu))
    filecheck(text, f"""
        CHECK-LABEL: func.func @main
        CHECK:       %[[Y:.+]] = "hexir.linear"(%{{{{.+}}}}) {{device = "{linear}", operandSegmentSizes = array<i32: 1, 1,
        CHECK-SAME: 0, 0, 0, 0>}} : ({X}, {W}) -> {Y}
        CHECK-NEXT:  %[[MOVED:.+]] = "hexir.transfer"(%[[Y]]) {{source = "{linear}", target = "{relu}"}}
        CHECK-NEXT:  %[[R:.+]] = "hexir.relu"(%[[MOVED]]) {{device = "{relu}", {RELU}}} : ({Y}) -> {Y}
    """)
    assert "hexir.epilogue" not in text
    kernels = [(device, op) for name, device, op in kernel_ops(lower(program(linear=linear, relu=relu), "mlir-tir"))
               if not name.endswith("_cpu")]
    assert kernels == [(linear, "linear"), (relu, "pointwise_relu")]


RELU_OF_RELU_OF_INPUT = f"""
func.func @main(%arg0: {Y}) -> {Y} {{
  %1 = "hexir.relu"(%arg0) {{device = "cpu", {RELU}}} : ({Y}) -> {Y}
  %2 = "hexir.relu"(%1) {{device = "cpu", {RELU}}} : ({Y}) -> {Y}
  return %2 : {Y}
}}
"""


def test_a_relu_of_an_input_stays_a_kernel_and_a_relu_of_it_joins_that_kernel():
    """No linear to fuse into: the first relu is a pointwise kernel of its own, and the second,
    its only user, absorbs it (one kernel, the trees composed; test_families.py has longer chains)."""
    text = fused(RELU_OF_RELU_OF_INPUT)
    filecheck(text, f"""
        CHECK-LABEL: func.func @main
        CHECK-NEXT:  %[[R:.+]] = "hexir.relu"(%arg0) {{device = "cpu", expr = {printed(["max", RELU_TREE, ["const", 0.0]])}, operandSegmentSizes = array<i32: 1, 0, 0, 0, 0, 0, 0, 0>}} : ({Y}) -> {Y}
        CHECK-NEXT:  return %[[R]]
    """)
    assert "hexir.epilogue" not in text
    assert kernel_ops(lower(RELU_OF_RELU_OF_INPUT, "mlir-tir")) == [("relu", "cpu", "pointwise_relu_relu")]


def test_a_chain_of_relus_after_a_linear_fuses_in_order():
    """Each relu is the only user of the linear (with the relus already fused) before it: the
    chain becomes one kernel whose epilogues apply in program order."""
    source = program(extra=f'  %3 = "hexir.relu"(%2) {{device = "cpu", {RELU}}} : ({Y}) -> {Y}\n', tail=f"return %3 : {Y}")
    text = fused(source)
    filecheck(text, f"""
        CHECK-LABEL: func.func @main
        CHECK:       %[[Y:.+]] = "hexir.linear"(%arg0, %{{{{.+}}}}) {{device = "cpu", hexir.epilogue = {printed(["max", RELU_TREE, ["const", 0.0]])}, operandSegmentSizes = array<i32: 1, 1,
        CHECK-SAME: 0, 0, 0, 0>}}
        CHECK-NEXT:  return %[[Y]]
    """)
    assert "hexir.relu" not in text
    assert kernel_ops(lower(source, "mlir-tir")) == [("linear", "cpu", "linear_relu_relu")]


def test_a_linear_with_a_chain_of_relus_compiles_and_runs():
    source = program(extra=f'  %3 = "hexir.relu"(%2) {{device = "cpu", {RELU}}} : ({Y}) -> {Y}\n', tail=f"return %3 : {Y}")
    x = np.linspace(-2, 2, 15, dtype=np.float32).reshape(3, 5)
    w = np.full((5, 7), 0.5, np.float32)
    np.testing.assert_allclose(hexir_runtime.load(lower(source, "hxb"), "cpu").main(x), np.maximum(x @ w, 0),
                               rtol=1e-6)


# ---- end to end: the fused kernels compute what numpy does --------------------------------------

TOLERANCE = {"float32": {"rtol": 2e-5, "atol": 1e-5}, "float64": {"rtol": 1e-12, "atol": 1e-12}}
BOTH_ON_CUDA = {"hexir.linear": "cuda", "hexir.relu": "cuda"}


def layer_of(dtype: str, bias: bool, m: int = 53, k: int = 5, n: int = 7, seed: int = 0):
    """x, w, b, relu(linear(x, w[, b])) as a function, and its numpy value (some of it clipped
    to 0, some not). 53 rows: more than one cpu tile, the last one short; and enough rows for
    the cuda SIMT kernel."""
    assert m > cpu_tile_rows(m, n, dtype) and m % cpu_tile_rows(m, n, dtype)
    rng = np.random.default_rng(seed)
    x, w = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
    b = rng.standard_normal(n).astype(dtype) if bias else None

    def layer(x):
        return hexir.relu(hexir.linear(x, w, b))

    expected = np.maximum(x.astype(np.float64) @ w + (0 if b is None else b), 0)
    assert (expected == 0).any() and (expected > 0).any()  # the relu has something to do
    return x, w, b, layer, expected


def op_of(bias: bool) -> str:
    return "linear_bias_relu" if bias else "linear_relu"


@pytest.mark.parametrize("bias", [False, True], ids=["linear", "linear_bias"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_jit_of_a_fused_layer_matches_numpy_on_the_cpu(dtype, bias, tmp_path):
    x, _, _, layer, expected = layer_of(dtype, bias)
    jitted = hexir.jit(layer)
    y = jitted(x)
    assert y.dtype == np.dtype(dtype) and y.shape == expected.shape
    np.testing.assert_allclose(y, expected, **TOLERANCE[dtype])
    (kernel,) = hxb.decode(jitted.compile(x)).json["kernels"]
    assert (manifest_op(kernel), kernel["device"]) == (op_of(bias), "cpu")
    # the row blocks split over 4 threads: each block's epilogue covers its own rows, and only them
    path = hexir.export(layer, tmp_path / "layer.hxb", x)
    threaded = hexir_runtime.load(path, device=CpuDevice(threads=4, split_bytes=0)).main(x)
    np.testing.assert_array_equal(threaded, y)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fusing_changes_no_bit_of_the_cpu_result(dtype):
    x, w, b, layer, _ = layer_of(dtype, bias=True, seed=1)

    @hexir.jit
    def apart(x):
        y = hexir.linear(x, w, b)
        return y, hexir.relu(y)  # the linear's result returned too: its relu is not fused

    ops = [manifest_op(kernel) for kernel in hxb.decode(apart.compile(x)).json["kernels"]]
    assert ops == ["linear_bias", "pointwise_relu"]
    linear, relu = apart(x)
    np.testing.assert_array_equal(hexir.jit(layer)(x), relu)
    np.testing.assert_array_equal(relu, np.maximum(linear, 0))


@pytest.mark.parametrize("bias", [False, True], ids=["linear", "linear_bias"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_fused_cuda_layer_matches_numpy_on_the_cpu_fallback_and_the_reference(dtype, bias, tmp_path):
    x, _, _, layer, expected = layer_of(dtype, bias, seed=2)
    path = hexir.export(layer, tmp_path / "layer.hxb", x, placement=BOTH_ON_CUDA)
    (kernel,) = hxb.read(path).json["kernels"]
    assert (manifest_op(kernel), kernel["device"], kernel["cpu_fallback"]["symbol"]) == (op_of(bias), "cuda",
                                                                                          kernel["name"] + "_cpu")
    for device in ("cpu", "reference"):
        y = hexir_runtime.load(path, device=device).main(x)
        assert y.dtype == np.dtype(dtype) and y.shape == expected.shape
        np.testing.assert_allclose(y, expected, **TOLERANCE[dtype], err_msg=f"on {device}")


def test_a_bad_epilogue_in_an_mlir_file_is_refused():
    text = '''
    func.func @main(%x: tensor<2x3xf32>, %w: tensor<3x4xf32>) -> tensor<2x4xf32> {
      %0 = "hexir.linear"(%x, %w) {device = "cpu", operandSegmentSizes = array<i32: 1, 1, 0, 0, 0, 0, 0>, hexir.epilogue = EPILOGUE} : (tensor<2x3xf32>, tensor<3x4xf32>) -> tensor<2x4xf32>
      return %0 : tensor<2x4xf32>
    }'''
    # an op's name is not a tree: the tree is made of the scalar language's ops
    with pytest.raises(TraceError, match=r"^-:3:8: linear: hexir.epilogue: unknown op 'gelu'; expected one of arg, "):
        lower(text.replace("EPILOGUE", printed(["gelu", ["arg", 0]])), "mlir")
    # an epilogue sees one value, the sum (bias added)
    with pytest.raises(TraceError, match=r"^-:3:8: linear: hexir.epilogue\[1\]\[1\]: expected an arg index below 1, got 1$"):
        lower(text.replace("EPILOGUE", printed(["exp", ["arg", 1]])), "mlir")
    with pytest.raises(TraceError, match=r"^-:3:8: linear: hexir.epilogue is not JSON: "):
        lower(text.replace("EPILOGUE", '"relu"'), "mlir")
    # the compiler's own attribute for a packed weight is not an input's (its w would be 2-D here)
    with pytest.raises(TraceError, match=r"^-:3:8: linear: hexir.w_panels is set by the compiler \(pack-weights\), "
                                         r"not by its input$"):
        lower(text.replace("hexir.epilogue = EPILOGUE", "hexir.w_panels"), "hxb")
