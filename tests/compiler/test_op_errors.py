"""Bad input to the ops of #23 (item 8): each is a TraceError at the line the user wrote (the
`# tag` comment ends it), whose message names what is wrong; never a traceback from inside hexir,
numpy or MLIR. Also what looks wrong but is not: numpy's ufuncs on a Tensor are hexir ops."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import hexir
from hexir import TensorSpec, TraceError
from hexir import scalar as s

from .conftest import line_of

F32 = TensorSpec((2, 3), "float32")
F64 = TensorSpec((2, 3), "float64")
BATCH = TensorSpec(("batch", 3), "float32")
ONES3 = np.ones(3, np.float32)


def _assert_at(error: TraceError, tag: str, *needles: str) -> None:
    """`error` points at the line of this file tagged `tag` and its message holds every needle."""
    assert error.where is not None, f"no location: {error.message}"
    path, line = error.where.rsplit(":", 1)
    assert (Path(path).resolve(), int(line)) == (Path(__file__).resolve(), line_of(__file__, tag)), error
    assert error.source and error.source.endswith(f"# {tag}")
    for needle in needles:
        assert needle in error.message, f"{needle!r} not in {error.message!r}"


# (tag, function, argument specs, what the message must name); each lambda's line is the user's line
TRACE_CASES = [
    ("bcast", lambda x, y: x + y, (F32, TensorSpec((4, 3), "float32")),  # bcast
     ["add", "[2, 3]", "[4, 3]", "do not broadcast"]),
    ("bcast-batch", lambda x, y: x * y, (BATCH, F32),  # bcast-batch
     ["mul", "[batch, 3]", "[2, 3]", "do not broadcast"]),
    ("axis", lambda x: hexir.sum(x, axis=2), (F32,), ["sum", "axis 2 is out of range", "rank 2"]),  # axis
    ("axis-method", lambda x: x.mean(axis=-3), (F32,), ["mean", "axis -3 is out of range"]),  # axis-method
    ("axis-float", lambda x: hexir.softmax(x, axis=1.0), (F32,), ["softmax", "axis must be an int"]),  # axis-float
    ("keepdims", lambda x: hexir.max(x, keepdims=1), (F32,),  # keepdims
     ["max", "keepdims must be True or False, got 1"]),
    ("keepdims-method", lambda x: x.argmax(keepdims="yes"), (F32,), ["keepdims", "'yes'"]),  # keepdims-method
    ("ln-weight", lambda x: hexir.layer_norm(x, np.ones(4, np.float32)), (F32,),  # ln-weight
     ["layer_norm", "weight is float32[4]", "expected float32[3]", "last axis"]),
    ("ln-bias", lambda x: hexir.layer_norm(x, ONES3, np.ones((1, 3), np.float32)), (F32,),  # ln-bias
     ["bias is float32[1, 3]", "expected float32[3]"]),
    ("ln-eps", lambda x: hexir.layer_norm(x, eps=0.0), (F32,), ["eps must be a positive number"]),  # ln-eps
    ("exp-int", lambda x: hexir.exp(hexir.argmax(x)), (F32,), ["exp", "int64[2]", "bfloat16 or float16"]),  # exp-int
    ("add-int", lambda x: hexir.argmax(x) + 1, (F32,), ["add", "int64[2]", "index"]),  # add-int
    ("sum-int", lambda x: x.argmax().sum(), (F32,), ["sum", "int64[2]"]),  # sum-int
    ("linear-int", lambda x: hexir.linear(hexir.argmax(x, keepdims=True), np.ones((1, 2), np.float32)),  # linear-int
     (F32,), ["linear", "int64"]),
    ("f64-array", lambda x: x + np.ones(3), (F32,),  # f64-array
     ["add", "mixed dtypes", "float32[2, 3]", "float64[3]"]),
    ("f64-tensor", lambda x, y: hexir.maximum(x, y), (F32, F64),  # f64-tensor
     ["maximum", "float32[2, 3] and float64[2, 3]"]),
    ("int-array", lambda x: x - np.ones(3, np.int64), (F32,), ["sub", "int64 array"]),  # int-array
    ("nan", lambda x: x * float("nan"), (F32,), ["mul", "nan", "finite"]),  # nan
    ("inf", lambda x: hexir.minimum(np.float64("-inf"), x), (F32,), ["minimum", "-inf", "finite"]),  # inf
    ("nan-0d", lambda x: x / np.array(np.nan), (F32,), ["div", "nan", "finite"]),  # nan-0d
    ("pow-tensor", lambda x: x ** x, (F32,), ["**", "exponent must be a finite number"]),  # pow-tensor
    ("pow-inf", lambda x: x ** float("inf"), (F32,), ["exponent must be a finite number"]),  # pow-inf
    ("rpow", lambda x: 2 ** x, (F32,), ["number ** tensor", "hexir.exp"]),  # rpow
    ("np-sum", lambda x: np.sum(x), (F32,), ["np.sum", "hexir.sum"]),  # np-sum
    ("np-mean", lambda x: np.mean(x, axis=0), (F32,), ["np.mean", "hexir.mean"]),  # np-mean
    ("np-sin", lambda x: np.sin(x), (F32,), ["np.sin", "not a hexir op"]),  # np-sin
    ("np-out", lambda x: np.exp(x, out=x), (F32,), ["np.exp with out"]),  # np-out
    ("np-reduce", lambda x: np.add.reduce(x), (F32,), ["np.add.reduce"]),  # np-reduce
    ("0d-weight", lambda x: hexir.layer_norm(x, np.zeros((), np.float32)), (F32,),  # 0d-weight
     ["weight", "0-d array", "rank >= 1"]),
    ("0d-linear", lambda x: hexir.linear(x, np.array(2.0, np.float32)), (F32,), ["'w' is a 0-d array"]),  # 0d-linear
    ("0d-output", lambda x: (x, np.array(1.0, np.float32)), (F32,), ["output 1 is a 0-d float32 array"]),  # 0d-output
    ("only-numbers", lambda x: hexir.exp(np.array(1.0)), (F32,), ["exp", "got only numbers"]),  # only-numbers
    ("gelu", lambda x: hexir.gelu(x, approximate="x"), (F32,), ["approximate must be 'none' or 'tanh'", "'x'"]),  # gelu
    ("max-two", lambda x: hexir.max(x, x), (F32,), ["hexir.maximum(a, b)"]),  # max-two
    ("list", lambda x: x + [1.0, 2.0, 3.0], (F32,), ["must be a tensor or a numpy array, got list"]),  # list
    ("bool", lambda x: x * True, (F32,), ["got bool"]),  # bool
]


@pytest.mark.parametrize(("tag", "function", "specs", "needles"), TRACE_CASES, ids=[c[0] for c in TRACE_CASES])
def test_bad_operands_are_trace_errors_at_the_users_line(tag, function, specs, needles):
    with pytest.raises(TraceError) as caught:
        hexir.jit(function).trace(*specs)
    _assert_at(caught.value, tag, *needles)


def test_an_op_outside_a_traced_function_is_refused_at_its_line():
    with pytest.raises(TraceError) as caught:
        hexir.softmax(np.ones((2, 3), np.float32))  # outside
    _assert_at(caught.value, "outside", "only be called inside a function decorated with @hexir.jit")


def test_numpy_ufuncs_on_a_tensor_are_hexir_ops():
    """np.exp(x) is hexir.exp(x), and numpy arrays or scalars on the left of an operator reach
    the Tensor's own operators (through __array_ufunc__) rather than numpy's loops."""
    x = np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4)
    row = np.arange(4, dtype=np.float32)

    @hexir.jit(cache=False)
    def both(x):
        return np.exp(x), hexir.exp(x), np.maximum(row, x), np.float64(2.0) * x, np.tanh(np.negative(x))

    via_numpy, via_hexir, biggest, doubled, tanh = both(x)
    np.testing.assert_array_equal(via_numpy, via_hexir)
    np.testing.assert_allclose(via_numpy, np.exp(x), rtol=2e-7)
    np.testing.assert_array_equal(biggest, np.maximum(row, x))
    assert doubled.dtype == np.float32  # a numpy scalar is a number: the tensor's dtype, as Python's are
    np.testing.assert_array_equal(doubled, 2 * x)
    np.testing.assert_allclose(tanh, np.tanh(-x), rtol=2e-6)


# ---- register_op: a bad definition fails when it is made or registered, at that line ------------

def _bad_function(x):
    return x[0]  # subscripting a Scalar: the definition's own error


REGISTER_CASES = [
    ("name-space", lambda: hexir.Pointwise("my op", lambda x: x),  # name-space
     ["name must be an identifier", "'my op'"]),
    ("name-int", lambda: hexir.Reduce(3, s.row_sum), ["name must be an identifier", "3"]),  # name-int
    ("not-callable", lambda: hexir.Pointwise("uncallable", 2.0), ["function must be callable"]),  # not-callable
    ("arity", lambda: hexir.Pointwise("nine", lambda a, b, c, d, e, f, g, h, i: a), ["1 to 8 operands"]),  # arity
    ("operands", lambda: hexir.Reduce("pair", s.row_sum, ("x", "y z")), ["operands must be", "'y z'"]),  # operands
    ("optional-first", lambda: hexir.Reduce("opt", s.row_sum, ("x?",)), ["not the first"]),  # optional-first
    ("taken", lambda: hexir.register_op(hexir.Pointwise("exp", s.exp)), ["'exp' is taken"]),  # taken
    ("not-a-definition", lambda: hexir.register_op(lambda x: x), ["expected a Pointwise, Reduce"]),  # not-a-definition
    ("returns-str", lambda: hexir.register_op(hexir.Pointwise("ret_str", lambda x: "x")),  # returns-str
     ["op ret_str", "returned str", "expected a hexir.scalar.Scalar"]),
    ("returns-number", lambda: hexir.register_op(hexir.Pointwise("ret_one", lambda x: 1.0)),  # returns-number
     ["returned float 1.0"]),
    ("numpy-inside", lambda: hexir.register_op(hexir.Pointwise("np_exp", lambda x: np.exp(x))),  # numpy-inside
     ["op np_exp", "raised TypeError", "not numpy's or math's"]),
    ("raises-inside", lambda: hexir.register_op(hexir.Pointwise("subscript", _bad_function)),  # raises-inside
     ["op subscript", "not subscriptable"]),
    ("scalar-pow", lambda: hexir.register_op(hexir.Pointwise("self_pow", lambda x: x ** x)),  # scalar-pow
     ["op self_pow", "** takes a number exponent"]),
    ("never-reduces", lambda: hexir.register_op(hexir.Reduce("twice", lambda x: x * 2)),  # never-reduces
     ["op twice", "must reduce", "row_sum"]),
    ("reduce-returns-none", lambda: hexir.register_op(hexir.Reduce("nothing", lambda x: None)),  # reduce-returns-none
     ["op nothing", "returned NoneType"]),
    ("argmax-plus", lambda: hexir.register_op(hexir.Reduce("shifted", lambda x: s.row_argmax(x) + 1)),  # argmax-plus
     ["op shifted", "an argmax program's output is its argmax"]),
]


@pytest.mark.parametrize(("tag", "define", "needles"), REGISTER_CASES, ids=[c[0] for c in REGISTER_CASES])
def test_a_bad_op_definition_is_a_trace_error_at_its_line(tag, define, needles):
    before = set(hexir.ops.REGISTRY)
    with pytest.raises(TraceError) as caught:
        define()
    _assert_at(caught.value, tag, *needles)
    assert set(hexir.ops.REGISTRY) == before  # nothing half-registered


def test_a_parameter_error_in_a_registered_op_is_at_the_calling_line():
    """A pointwise op whose function takes a parameter is checked when called with it."""
    scaled = hexir.register_op(hexir.Pointwise("scaled_by", lambda x, factor: x * factor, arity=1))
    with pytest.raises(TraceError) as caught:
        hexir.jit(lambda x: scaled(x, facter=2.0)).trace(F32)  # misspelt
    _assert_at(caught.value, "misspelt", "op scaled_by", "unexpected keyword argument 'facter'")
    with pytest.raises(TraceError) as caught:
        hexir.jit(lambda x: scaled(x, x, factor=2.0)).trace(F32)  # two-operands
    _assert_at(caught.value, "two-operands", "scaled_by takes 1 operand(s), got 2")
