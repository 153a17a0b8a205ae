"""The hexir and hextir dialects: IRDL rejects malformed ops and attributes with a message
naming the bad value and where it is; the attribute helpers and constant reader round-trip."""

# IR lines are checked as printed: wrapping them would change what they check.
# ruff: noqa: E501

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
from mlir import ir
from mlir.dialects import func

from hexir import ops
from hexir.dialects import hexir as hx
from hexir.dialects import hextir as ht
from hexir.dialects import make_context
from hexir.errors import TraceError
from hexir.ops.library import linear_shape

from .conftest import family_attrs, lower, parse

LINEAR = """
func.func @main(%arg0: tensor<2x8xf32>, %w: tensor<8x4xf32>) -> tensor<2x4xf32> {{
  %1 = "hexir.linear"(%arg0, %w) {{{attrs}operandSegmentSizes = array<i32: 1, 1, 0, 0, 0, 0, 0>}} : (tensor<2x8xf32>, tensor<8x4xf32>) -> tensor<2x4xf32>
  return %1 : tensor<2x4xf32>
}}
"""

LOOP = """
func.func @f() {{
  %c0 = arith.constant 0 : index
  %c4 = arith.constant 4 : index
  %c1 = arith.constant 1 : index
  scf.for %i = %c0 to %c4 step %c1 {{
  }} {{hextir.schedule = {schedule}}}
  return
}}
"""


# ---- hexir: IRDL structure ------------------------------------------------------------

@pytest.mark.parametrize("device", ["auto", "cpu", "cuda"])
def test_linear_accepts_each_device(device):
    module = parse(LINEAR.format(attrs=f'device = "{device}", '))
    assert f'device = "{device}"' in str(module)


def test_linear_without_device_is_rejected_naming_the_attribute():
    with pytest.raises(ir.MLIRError, match=r'"-":3:8: \'hexir.linear\' op attribute "device" is expected '
                                           r"but not provided"):
        parse(LINEAR.format(attrs=""))


@pytest.mark.parametrize("device", ["gpu", "CPU", "", "tpu"])
def test_linear_with_unknown_device_is_rejected_naming_the_value(device):
    with pytest.raises(ir.MLIRError, match=rf'"-":3:8: \'"{device}"\' does not satisfy the constraint'):
        parse(LINEAR.format(attrs=f'device = "{device}", '))


def test_linear_device_must_be_a_string():
    with pytest.raises(ir.MLIRError, match=r"'1 : i64' does not satisfy the constraint"):
        parse(LINEAR.format(attrs="device = 1, "))


def test_relu_result_must_have_its_operand_type():
    """IRDL checks a compute op's structure only (tensors in, a tensor out); its registered shape
    rule, applied by the verifier, checks the result type."""
    text = f"""
    func.func @main(%arg0: tensor<2x8xf32>) -> tensor<2x8xf64> {{
      %1 = "hexir.relu"(%arg0) {{device = "cpu", {family_attrs("relu")}}} : (tensor<2x8xf32>) -> tensor<2x8xf64>
      return %1 : tensor<2x8xf64>
    }}
    """
    parse(text)
    with pytest.raises(TraceError, match=r"^-:3:8: relu: result type is float64\[2, 8\], expected float32\[2, 8\]$"):
        lower(text, "mlir")


def test_linear_operands_must_be_tensors():
    text = """
    func.func @main(%arg0: memref<2x8xf32>, %w: tensor<8x4xf32>) -> tensor<2x4xf32> {
      %1 = "hexir.linear"(%arg0, %w) {device = "cpu", operandSegmentSizes = array<i32: 1, 1, 0, 0, 0, 0, 0>} : (memref<2x8xf32>, tensor<8x4xf32>) -> tensor<2x4xf32>
      return %1 : tensor<2x4xf32>
    }
    """
    with pytest.raises(ir.MLIRError, match=r"expected base type 'builtin.tensor' but got 'builtin.memref'"):
        parse(text)


def test_transfer_endpoints_are_real_devices():
    text = """
    func.func @main(%arg0: tensor<4xf32>) -> tensor<4xf32> {
      %1 = "hexir.transfer"(%arg0) {source = "auto", target = "cuda"} : (tensor<4xf32>) -> tensor<4xf32>
      return %1 : tensor<4xf32>
    }
    """
    with pytest.raises(ir.MLIRError, match=r'\'"auto"\' does not satisfy the constraint'):
        parse(text)


def test_call_needs_a_callee():
    text = """
    func.func @main(%arg0: tensor<4xf32>) -> tensor<4xf32> {
      %1 = "hexir.call"(%arg0) {device = "cpu", operandSegmentSizes = array<i32: 1, 0, 0, 0, 0, 0, 0, 0>}
          : (tensor<4xf32>) -> tensor<4xf32>
      return %1 : tensor<4xf32>
    }
    """
    with pytest.raises(ir.MLIRError, match=r'\'hexir.call\' op attribute "callee" is expected but not provided'):
        parse(text)


@pytest.mark.parametrize("op", ["hexir.call", "hexir.custom_call"])
def test_call_operand_segments_have_one_entry_per_operand_group(op):
    """Calls have one required and MAX_CALL_ARGS - 1 optional operand groups; seven entries no longer do."""
    attributes = ('callee = @k, device = "cpu"' if op == "hexir.call" else
                  'kernel = "k", objects = {cpu = "k.c"}, grid = array<i64: 1, 1, 1>, block = array<i64: 1, 1, 1>, '
                  'device = "cpu"')
    text = """
    func.func @main(%arg0: tensor<4xf32>) -> tensor<4xf32> {{
      %1 = "{op}"(%arg0) {{{attributes}, operandSegmentSizes = array<i32: {segments}>}}
          : (tensor<4xf32>) -> tensor<4xf32>
      return %1 : tensor<4xf32>
    }}
    """
    assert hx.MAX_CALL_ARGS == 8
    parse(text.format(op=op, attributes=attributes, segments="1, 0, 0, 0, 0, 0, 0, 0"))
    with pytest.raises(ir.MLIRError, match=r"'operandSegmentSizes' attribute for specifying operand segments must "
                                           r"have 8 elements, but got 7"):
        parse(text.format(op=op, attributes=attributes, segments="1, 0, 0, 0, 0, 0, 0"))


# ---- hexir: typed builders --------------------------------------------------------------

def _in_function(build, *arg_types_text):
    """Run `build(*arguments)` inside a fresh function; return what it returns."""
    context = make_context()
    with context, ir.Location.unknown():
        module = ir.Module.create()
        arg_types = [ir.Type.parse(t) for t in arg_types_text]
        with ir.InsertionPoint(module.body):
            function = func.FuncOp("f", ir.FunctionType.get(arg_types, []))
            block = function.add_entry_block()
        with ir.InsertionPoint(block):
            result = build(*block.arguments)
            func.ReturnOp([])
        return result, module


def test_compute_builder_makes_the_registered_op():
    def build(x, w, b):
        result = hx.tensor_type(linear_shape(((3, 5), "float64"), ((5, 7), "float64"),
                                                 ((7,), "float64")), "float64")
        with_bias = hx.compute("linear", [x, w, b], result, device="cuda")
        without = hx.compute("linear", [x, w], result)
        return with_bias, without

    ((with_bias, without), module) = _in_function(build, "tensor<3x5xf64>", "tensor<5x7xf64>", "tensor<7xf64>")
    assert str(with_bias.type) == str(without.type) == "tensor<3x7xf64>"
    assert module.operation.verify()
    assert [len(list(v.owner.operands)) for v in (with_bias, without)] == [3, 2]
    text = str(module)
    assert '"hexir.linear"(%arg0, %arg1, %arg2) {device = "cuda", operandSegmentSizes = array<i32: 1, 1, 1, 0, 0, 0, 0>}' in text
    assert '"hexir.linear"(%arg0, %arg1) {device = "auto", operandSegmentSizes = array<i32: 1, 1, 0, 0, 0, 0, 0>}' in text


def test_linear_shape_rule_names_the_mismatch():
    with pytest.raises(TraceError, match=r"^linear: inner dimensions differ: x is float32\[3, 5\] and w is "
                                         r"float32\[4, 7\]; expected w to have 5 rows, got 4$"):
        linear_shape(((3, 5), "float32"), ((4, 7), "float32"))
    with pytest.raises(TraceError, match=r"^linear: argument 'bias' must be float32\[7\], got float32\[5\]$"):
        linear_shape(((3, 5), "float32"), ((5, 7), "float32"), ((5,), "float32"))
    assert linear_shape((("batch", 5), "float32"), ((5, 7), "float32")) == ("batch", 7)


@pytest.mark.parametrize("shape", [(2, 0), (2, 0, 4), (2, 3, 0), (1, 0, 3, 2), (2, 3, 4, 0), ("batch", 0, 4)])
def test_the_shape_rules_refuse_an_empty_axis_but_the_first(shape):
    """Only the first axis may be empty (a buffer whose inner axis is 0 has no stride the
    bare-pointer calling convention can express): the pointwise rule refuses an empty second
    or later axis in every rank, and takes an empty first one."""
    described = re.escape(f"float32[{', '.join(map(str, shape))}]")
    with pytest.raises(TraceError, match=rf"^relu: argument '\w+' is {described}; only the first axis of a tensor"):
        ops.pointwise_shape("relu", [(shape, "float32")])
    full = tuple(extent or 5 for extent in shape[1:])
    assert ops.pointwise_shape("relu", [((0, *full), "float32")]) == (0, *full)


def test_linear_and_the_verifier_refuse_an_empty_inner_axis():
    """linear's rule, for x and w; the verifier (the same rules) at the op's line."""
    with pytest.raises(TraceError, match=r"^linear: argument 'x' is float32\[3, 0\]; only the first axis"):
        linear_shape(((3, 0), "float32"), ((0, 4), "float32"))
    with pytest.raises(TraceError, match=r"^linear: argument 'w' is float32\[3, 0\]; only the first axis"):
        linear_shape(((2, 3), "float32"), ((3, 0), "float32"))
    assert linear_shape(((0, 3), "float32"), ((3, 4), "float32")) == (0, 4)
    text = f"""
func.func @main(%x: tensor<2x0x4xf32>) -> tensor<2x0x4xf32> {{
  %1 = "hexir.relu"(%x) {{device = "auto", {family_attrs("relu")}}} : (tensor<2x0x4xf32>) -> tensor<2x0x4xf32>
  return %1 : tensor<2x0x4xf32>
}}
"""
    with pytest.raises(TraceError, match=r"^-:3:8: relu: argument '\w+' is float32\[2, 0, 4\]; only the first axis"):
        lower(text, "mlir")


def _call(*args):
    return hx.call("k", list(args), ir.RankedTensorType.get([2], ir.F32Type.get()), "cpu")


def _custom_call(*args):
    return hx.custom_call("k", list(args), ir.RankedTensorType.get([2], ir.F32Type.get()), {"cpu": "k.c"},
                          grid=(1, 1, 1), block=(1, 1, 1))


@pytest.mark.parametrize("count", range(1, hx.MAX_CALL_ARGS + 1))
@pytest.mark.parametrize("build", [_call, _custom_call], ids=["call", "custom_call"])
def test_call_builders_take_one_to_eight_operands(build, count):
    # distinct operand types: each operand is a group of its own, whatever its type
    types = [f"tensor<{i + 1}xf32>" for i in range(count)]
    (value, module) = _in_function(build, *types)
    assert module.operation.verify()
    op = value.owner
    assert [str(v.type) for v in op.operands] == types
    segments = list(ir.DenseI32ArrayAttr(op.attributes["operandSegmentSizes"]))
    assert segments == [1] * count + [0] * (hx.MAX_CALL_ARGS - count)
    assert f"operandSegmentSizes = array<i32: {', '.join(map(str, segments))}>" in str(module)


@pytest.mark.parametrize("count", [0, hx.MAX_CALL_ARGS + 1, hx.MAX_CALL_ARGS + 2])
@pytest.mark.parametrize(("build", "what"), [(_call, "hexir.call"), (_custom_call, "custom kernel k")],
                         ids=["call", "custom_call"])
def test_call_builders_refuse_other_operand_counts(build, what, count):
    assert hx.MAX_CALL_ARGS == 8
    with pytest.raises(TraceError, match=rf"^{re.escape(what)} takes 1 to 8 tensors, got {count}$"):
        _in_function(build, *["tensor<2xf32>"] * count)


# ---- hexir.constant: the numpy value round-trips -----------------------------------------

CONSTANTS = {
    "f32 matrix": np.random.default_rng(1).standard_normal((3, 5)).astype(np.float32),
    "f64 matrix": np.random.default_rng(2).standard_normal((4, 2)),
    "f32 vector": np.array([0.5, -1.0, 3.25e-8], dtype=np.float32),
    "f64 rank 3": np.random.default_rng(3).random((2, 3, 4)),
    "f32 splat": np.full((4, 6), 2.5, dtype=np.float32),
    "f64 splat": np.full((7,), -1.0e-300, dtype=np.float64),
    "f32 zeros": np.zeros((2, 2), dtype=np.float32),
}


@pytest.mark.parametrize("array", CONSTANTS.values(), ids=CONSTANTS.keys())
def test_constant_array_round_trips(array):
    (value, module) = _in_function(lambda: hx.constant(array, "W"))
    with module.context:
        back = hx.constant_array(value.owner)
    assert back.dtype == array.dtype
    assert back.shape == array.shape
    np.testing.assert_array_equal(back, array)


@pytest.mark.parametrize("array", CONSTANTS.values(), ids=CONSTANTS.keys())
def test_constant_array_round_trips_through_text(array):
    (_, module) = _in_function(lambda: hx.constant(array, "W"))
    reparsed = parse(str(module))
    constant = next(op for op in reparsed.body.operations[0].regions[0].blocks[0].operations
                    if op.operation.name == "hexir.constant")
    with reparsed.context:
        back = hx.constant_array(constant.operation)
    assert back.dtype == array.dtype
    np.testing.assert_array_equal(back, array)


def test_splat_constant_from_text():
    module = parse("""
    func.func @main() -> tensor<2x3xf64> {
      %0 = "hexir.constant"() {device = "auto", name = "b", value = dense<1.5> : tensor<2x3xf64>}
          : () -> tensor<2x3xf64>
      return %0 : tensor<2x3xf64>
    }
    """)
    constant = module.body.operations[0].regions[0].blocks[0].operations[0].operation
    with module.context:
        back = hx.constant_array(constant)
    assert back.dtype == np.float64
    np.testing.assert_array_equal(back, np.full((2, 3), 1.5))


def test_constant_array_and_dtype_need_no_active_context():
    (value, _) = _in_function(lambda: hx.constant(np.full((2,), 0.25, np.float64), "W"))
    assert hx.dtype_of(value.type) == "float64"
    np.testing.assert_array_equal(hx.constant_array(value.owner), [0.25, 0.25])


# ---- hextir: schedules and kernel tags --------------------------------------------------

@pytest.mark.parametrize("kind", ht.LOOP_KINDS)
@pytest.mark.parametrize("bind", ht.BINDINGS)
def test_every_schedule_parses(kind, bind):
    module = parse(LOOP.format(schedule=f'#hextir.loop<"{kind}", "{bind}">'))
    loop = next(op.operation for op in module.body.operations[0].regions[0].blocks[0].operations
                if op.operation.name == "scf.for")
    assert ht.schedule_of(loop) == (kind, bind)
    assert f'{{hextir.schedule = #hextir.loop<"{kind}", "{bind}">}}' in str(module)


@pytest.mark.parametrize("schedule, bad", [
    ('#hextir.loop<"bogus", "">', "bogus"),
    ('#hextir.loop<"Parallel", "">', "Parallel"),
    ('#hextir.loop<"parallel", "warpIdx.x">', "warpIdx.x"),
    ('#hextir.loop<"serial", "blockIdx.w">', "blockIdx.w"),
])
def test_bad_schedule_is_rejected_naming_the_value(schedule, bad):
    with pytest.raises(ir.MLIRError, match=rf'"-":7:32: \'"{re.escape(bad)}"\' does not satisfy the constraint'):
        parse(LOOP.format(schedule=schedule))


def test_schedule_needs_both_parameters():
    with pytest.raises(ir.MLIRError, match=r'"-":7:32: expected 2 type arguments, but had 1'):
        parse(LOOP.format(schedule='#hextir.loop<"parallel">'))


def test_schedule_builder_refuses_an_unknown_kind():
    with make_context(), pytest.raises(ir.MLIRError, match=r'\'"bogus"\' does not satisfy the constraint'):
        ht.schedule("bogus")


def test_schedule_round_trips_on_a_loop():
    pairs = list(itertools.product(ht.LOOP_KINDS, ht.BINDINGS))

    def build():
        loops = []
        for kind, bind in pairs:
            with ht.loop(0, 4, kind, bind):
                pass
        for op in ir.InsertionPoint.current.block.operations:
            if op.operation.name == "scf.for":
                loops.append(op.operation)
        return loops

    (loops, module) = _in_function(build)
    assert [ht.schedule_of(op) for op in loops] == pairs
    assert module.operation.verify()


def test_schedule_of_an_unscheduled_loop_is_none():
    module = parse("""
    func.func @f() {
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      scf.for %i = %c0 to %c1 step %c1 {
      }
      return
    }
    """)
    loop = next(op for op in module.body.operations[0].regions[0].blocks[0].operations
                if op.operation.name == "scf.for")
    assert ht.schedule_of(loop.operation) is None


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("op", ["linear", "relu", "custom"])
def test_kernel_attr_round_trips(device, op):
    def build():
        function = ir.InsertionPoint.current.block.owner
        function.attributes[ht.KERNEL] = ht.kernel_attr(device, op)
        return function

    (function, _) = _in_function(build)
    assert ht.kernel_of(function) == (device, op)
    assert str(function.attributes[ht.KERNEL]) == f'#hextir.kernel<"{device}", "{op}">'


def test_kernel_of_a_plain_function_is_none():
    module = parse("func.func @f() { return }")
    assert ht.kernel_of(module.body.operations[0].operation) is None


@pytest.mark.parametrize("attr, bad", [('#hextir.kernel<"tpu", "linear">', "tpu"),
                                       ('#hextir.kernel<"gpu", "relu">', "gpu")])
def test_bad_kernel_tag_is_rejected(attr, bad):
    """The device is one of the two; the op is any name (a registered op or "custom")."""
    with pytest.raises(ir.MLIRError, match=rf'\'"{bad}"\' does not satisfy the constraint'):
        parse(f"func.func @f() attributes {{hextir.kernel = {attr}}} {{ return }}")


def test_alloc_local_space_is_checked():
    text = """
    func.func @f() {{
      %0 = "hextir.alloc_local"() {{space = "{space}"}} : () -> memref<4xf32>
      return
    }}
    """
    parse(text.format(space="shared"))
    parse(text.format(space="global"))
    with pytest.raises(ir.MLIRError, match=r'\'"device"\' does not satisfy the constraint'):
        parse(text.format(space="device"))


def test_hextir_load_indices_must_be_index():
    text = """
    func.func @f(%buffer: memref<4xf32>, %i: i32) -> f32 {
      %0 = "hextir.load"(%buffer, %i) : (memref<4xf32>, i32) -> f32
      return %0 : f32
    }
    """
    with pytest.raises(ir.MLIRError, match=r"expected 'index' but got 'i32'"):
        parse(text)
