"""verify: the shape and dtype rules, checked on IR text, each failure at the bad op's line."""

# IR lines are checked as printed: wrapping them would change what they check.
# ruff: noqa: E501

from __future__ import annotations

import pytest

from hexir.errors import CompileError, TraceError

from .conftest import family_attrs, filecheck, lower


def graph(body: str, args: str = "%arg0: tensor<2x8xf32>, %w: tensor<8x4xf32>", results: str = "") -> str:
    """A @main whose body starts on line 3 of the text (line 1 is empty)."""
    return f"""
func.func @main({args}){' -> ' + results if results else ''} {{
{body}
}}
"""


VALID = graph("""  %0 = "hexir.constant"() {device = "auto", name = "b", value = dense<0.5> : tensor<4xf32>} : () -> tensor<4xf32>
  %1 = "hexir.linear"(%arg0, %w, %0) {device = "auto", operandSegmentSizes = array<i32: 1, 1, 1, 0, 0, 0, 0>} : (tensor<2x8xf32>, tensor<8x4xf32>, tensor<4xf32>) -> tensor<2x4xf32>
  %2 = "hexir.relu"(%1) {device = "auto", RELU_ATTRS} : (tensor<2x4xf32>) -> tensor<2x4xf32>
  "hexir.print"(%2) : (tensor<2x4xf32>) -> ()
  return %2 : tensor<2x4xf32>""".replace("RELU_ATTRS", family_attrs("relu")), results="tensor<2x4xf32>")


def test_filecheck_helper_fails_on_a_mismatch():
    filecheck('"hexir.relu"(%0)', 'CHECK: "hexir.relu"(%{{[0-9]+}})')
    with pytest.raises(pytest.fail.Exception, match=r"FileCheck failed:(.|\n)*expected string not found"):
        filecheck('"hexir.relu"(%0)', 'CHECK: "hexir.linear"')


def test_valid_graph_passes_unchanged():
    filecheck(lower(VALID, "mlir"), """
        CHECK-LABEL: func.func @main(%arg0: tensor<2x8xf32>, %arg1: tensor<8x4xf32>) -> tensor<2x4xf32>
        CHECK-NEXT:    %[[B:.+]] = "hexir.constant"() {device = "auto", name = "b", value = dense<5.000000e-01> : tensor<4xf32>}
        CHECK-NEXT:    %[[Y:.+]] = "hexir.linear"(%arg0, %arg1, %[[B]]) {device = "auto", operandSegmentSizes = array<i32: 1, 1,
        CHECK-SAME: 0, 0, 0, 0>}
        CHECK-NEXT:    %[[R:.+]] = "hexir.relu"(%[[Y]]) {device = "auto", expr = "[\\22max\\22,[\\22arg\\22,0],[\\22const\\22,0.0]]"
        CHECK-NEXT:    "hexir.print"(%[[R]])
        CHECK-NEXT:    return %[[R]] : tensor<2x4xf32>
    """)


def _linear(x: str, w: str, result: str, bias: str | None = None) -> str:
    operands = "%x, %w" + (", %b" if bias else "")
    types = f"{x}, {w}" + (f", {bias}" if bias else "")
    args = f"%x: {x}, %w: {w}" + (f", %b: {bias}" if bias else "")
    return graph(f'  %1 = "hexir.linear"({operands}) {{device = "auto", operandSegmentSizes = array<i32: 1, 1, {int(bool(bias))}, 0, 0, 0, 0>}} : ({types}) -> {result}\n'
                 f"  return %1 : {result}", args=args, results=result)


BAD_LINEAR = {
    "x of rank 1": (
        _linear("tensor<8xf32>", "tensor<8x4xf32>", "tensor<2x4xf32>"),
        r"linear: result type is float32\[2, 4\], expected float32\[4\]"),
    "w of rank 3": (
        _linear("tensor<2x8xf32>", "tensor<8x4x1xf32>", "tensor<2x4xf32>"),
        r"linear: argument 'w' must have rank 2, got rank 3 \(float32\[8, 4, 1\]\)"),
    "inner dimensions": (
        _linear("tensor<2x8xf32>", "tensor<4x4xf32>", "tensor<2x4xf32>"),
        r"linear: inner dimensions differ: x is float32\[2, 8\] and w is float32\[4, 4\]; "
        r"expected w to have 8 rows, got 4"),
    "mixed dtypes": (
        _linear("tensor<2x8xf32>", "tensor<8x4xf64>", "tensor<2x4xf32>"),
        r"linear: mixed dtypes: x is float32 but w is float64"),
    "bias dtype": (
        _linear("tensor<2x8xf64>", "tensor<8x4xf64>", "tensor<2x4xf64>", bias="tensor<4xf32>"),
        r"linear: mixed dtypes: x is float64 but bias is float32"),
    "bias shape": (
        _linear("tensor<2x8xf32>", "tensor<8x4xf32>", "tensor<2x4xf32>", bias="tensor<8xf32>"),
        r"linear: argument 'bias' must be float32\[4\], got float32\[8\]"),
    "result shape": (
        _linear("tensor<2x8xf32>", "tensor<8x4xf32>", "tensor<2x5xf32>"),
        r"linear: result type is float32\[2, 5\], expected float32\[2, 4\]"),
    "result dtype": (
        _linear("tensor<2x8xf32>", "tensor<8x4xf32>", "tensor<2x4xf64>"),
        r"linear: result type is float64\[2, 4\], expected float32\[2, 4\]"),
}


@pytest.mark.parametrize("text, message", BAD_LINEAR.values(), ids=BAD_LINEAR.keys())
def test_bad_linear_is_reported_at_its_line(text, message):
    with pytest.raises(TraceError, match=message) as caught:
        lower(text, "mlir")
    # the op is on line 3 of the text; its location is where its name starts
    assert caught.value.where == "-:3:8"
    assert str(caught.value) == f"-:3:8: {caught.value.message}"


def test_error_points_at_the_second_of_two_ops():
    text = graph("""  %1 = "hexir.linear"(%arg0, %w) {device = "auto", operandSegmentSizes = array<i32: 1, 1, 0, 0, 0, 0, 0>} : (tensor<2x8xf32>, tensor<8x4xf32>) -> tensor<2x4xf32>
  %2 = "hexir.linear"(%1, %w) {device = "auto", operandSegmentSizes = array<i32: 1, 1, 0, 0, 0, 0, 0>} : (tensor<2x4xf32>, tensor<8x4xf32>) -> tensor<2x4xf32>
  return %2 : tensor<2x4xf32>""", results="tensor<2x4xf32>")
    with pytest.raises(TraceError, match=r"inner dimensions differ: x is float32\[2, 4\]") as caught:
        lower(text, "mlir")
    assert caught.value.where == "-:4:8"


def test_relu_of_a_scalar_is_rejected():
    text = graph("""  %1 = "hexir.relu"(%s) {device = "auto", RELU_ATTRS} : (tensor<f32>) -> tensor<f32>
  return %1 : tensor<f32>""".replace("RELU_ATTRS", family_attrs("relu")), args="%s: tensor<f32>", results="tensor<f32>")
    with pytest.raises(TraceError, match=r"^-:3:8: relu: the result would be a scalar; hexir tensors have rank >= 1$"):
        lower(text, "mlir")


def test_print_of_a_scalar_is_rejected():
    text = graph("""  "hexir.print"(%s) : (tensor<f64>) -> ()
  return""", args="%s: tensor<f64>")
    with pytest.raises(TraceError, match=r"^-:3:3: print: argument 'x' must have rank >= 1, got a scalar$"):
        lower(text, "mlir")


def test_integer_constant_other_than_int32_or_int64_is_rejected():
    """int64 is what an argmax makes, int32 and int64 are ids (take); i16 is neither."""
    text = graph("""  %0 = "hexir.constant"() {device = "auto", name = "k", value = dense<1> : tensor<4xi16>} : () -> tensor<4xi16>
  return""", args="")
    with pytest.raises(TraceError, match=r"^-:3:8: element type i16 is not supported; "
                                         r"expected f32, f64, bf16, f16, i32 or i64$"):
        lower(text, "mlir")


def test_integer_argument_is_reported_at_main():
    text = _linear("tensor<2x8xi16>", "tensor<8x4xi16>", "tensor<2x4xi16>")
    with pytest.raises(TraceError, match=r"^-:2:1: main: argument 'arg0': element type i16 is not supported; "
                                         r"expected f32, f64, bf16, f16, i32 or i64$"):
        lower(text, "mlir")


def test_argument_is_named_by_its_traced_name():
    text = graph("  return", args="%x: tensor<2xi16>").replace(
        "{", 'attributes {hexir.arg_names = ["x"]} {', 1)
    with pytest.raises(TraceError, match=r"^-:2:1: main: argument 'x': element type i16 is not supported"):
        lower(text, "mlir")


def test_foreign_op_in_main_is_rejected_by_name():
    text = graph("""  %c = arith.constant 1.0 : f32
  return""", args="")
    with pytest.raises(TraceError, match=r"^-:3:8: 'arith.constant' is not a hexir graph op; expected one of "
                                         r"hexir.constant, hexir.print, hexir.transfer, hexir.call, "
                                         r"hexir.custom_call, func.return, hexir.linear"
                                         r"(, hexir\.\w+)*$") as caught:  # every registered op
        lower(text, "mlir")
    assert {"hexir.relu", "hexir.add", "hexir.softmax"} <= set(caught.value.message.split(", "))


def test_module_without_main_is_rejected():
    with pytest.raises(CompileError, match=r"the module has no func.func @main \(the host program\)"):
        lower("func.func @forward() { return }", "mlir")


@pytest.mark.parametrize("stage", ["mlir-hetero", "mlir-tir", "hxb"])
def test_every_stage_verifies_first(stage):
    with pytest.raises(TraceError, match=r"inner dimensions differ"):
        lower(BAD_LINEAR["inner dimensions"][0], stage)


# ---- inputs verify lets through, which later stages crash on --------------------------------

@pytest.mark.parametrize("stage", ["mlir", "llvm"])
def test_unnamed_dynamic_extent_is_rejected(stage):
    text = _linear("tensor<?x8xf32>", "tensor<8x4xf32>", "tensor<?x4xf32>")
    with pytest.raises(TraceError, match=r"^-:2:1: main: argument 'arg0': tensor<\?x8xf32>: each \? extent needs a "
                                         r"name in the type's encoding, e.g. tensor<\?x8xf32, \"batch\">$"):
        lower(text, stage)


def test_named_extents_are_accepted_anywhere_and_checked_by_the_shape_rules():
    text = _linear('tensor<?x8xf32, "batch">', "tensor<8x4xf32>", 'tensor<?x4xf32, "batch">')
    assert '-> tensor<?x4xf32, "batch">' in lower(text, "mlir")
    text = _linear('tensor<?x?x8xf32, "batch,seq">', "tensor<8x4xf32>", 'tensor<?x?x4xf32, "batch,seq">')
    assert '-> tensor<?x?x4xf32, "batch,seq">' in lower(text, "mlir")
    text = _linear('tensor<2x?xf32, "k">', "tensor<8x4xf32>", "tensor<2x4xf32>")
    with pytest.raises(TraceError, match=r"^-:3:8: linear: inner dimensions differ: x is float32\[2, k\] and w "
                                         r"is float32\[8, 4\]; expected w to have k rows, got 8$"):
        lower(text, "mlir")


def test_unnamed_dynamic_extent_inside_main_is_reported_at_its_op():
    text = graph("""  %1 = "hexir.linear"(%arg0, %w) {device = "auto", operandSegmentSizes = array<i32: 1, 1, 0, 0, 0, 0, 0>} : (tensor<2x8xf32>, tensor<8x4xf32>) -> tensor<?x4xf32>
  "hexir.print"(%1) : (tensor<?x4xf32>) -> ()
  return""")
    with pytest.raises(TraceError, match=r"^-:3:8: linear: result 0: tensor<\?x4xf32>: each \? extent needs a name "
                                         r"in the type's encoding, e.g. tensor<\?x8xf32, \"batch\">$"):
        lower(text, "mlir")


@pytest.mark.parametrize("body, results", [("  return %s : f32", "f32"), ("  return", "")],
                         ids=["returned", "unused"])
def test_scalar_argument_is_rejected(body, results):
    with pytest.raises(TraceError, match=r"^-:2:1: main: (argument 'arg0'|result 0): f32 is not a tensor; "
                                         r"expected a tensor of f32 or f64$"):
        lower(graph(body, args="%s: f32", results=results), "mlir")


@pytest.mark.parametrize("value, result", [("dense<[1.0, 2.0, 3.0]> : tensor<3xf32>", "tensor<2xf32>"),
                                           ("dense<[1.0, 2.0]> : tensor<2xf64>", "tensor<2xf32>")],
                         ids=["shape", "dtype"])
def test_constant_value_must_have_the_result_type(value, result):
    text = graph(f'  %0 = "hexir.constant"() {{device = "auto", name = "c", value = {value}}} : () -> {result}\n'
                 f"  return %0 : {result}", args="", results=result)
    with pytest.raises(TraceError, match=rf"^-:3:8: constant: value has type {value.split(' : ')[1]}, expected the "
                                         rf"result type {result}$"):
        lower(text, "mlir")


def test_call_of_an_unknown_kernel_is_rejected():
    text = graph('  %0 = "hexir.call"(%x) {callee = @nope, device = "cpu", operandSegmentSizes = array<i32: 1, 0, 0, 0, 0, 0, 0, 0>} '
                 ": (tensor<2xf32>) -> tensor<2xf32>\n  return %0 : tensor<2xf32>",
                 args="%x: tensor<2xf32>", results="tensor<2xf32>")
    with pytest.raises(TraceError, match=r"^-:3:8: call: @nope is not a kernel of this module; expected a "
                                         r"func.func with hextir.kernel or a gpu.func in a gpu.module$"):
        lower(text, "mlir")


def test_call_of_a_cpu_twin_is_rejected():
    """A cuda kernel's cpu twin runs only in its place; the manifest has no entry of its own for it."""
    twin = ('func.func public @relu_0_cpu(%arg0: memref<2xf32>, %arg1: memref<2xf32>) attributes '
            '{hextir.fallback_of = @relu_0, hextir.kernel = #hextir.kernel<"cpu", "relu">} {\n  return\n}\n')
    text = twin + graph('  %0 = "hexir.call"(%x) {callee = @relu_0_cpu, device = "cpu", '
                        'operandSegmentSizes = array<i32: 1, 0, 0, 0, 0, 0, 0, 0>} : (tensor<2xf32>) -> tensor<2xf32>\n'
                        '  return %0 : tensor<2xf32>', args="%x: tensor<2xf32>", results="tensor<2xf32>")
    with pytest.raises(TraceError, match=r"call: @relu_0_cpu is not a kernel of this module"):
        lower(text, "mlir")
