"""The tracer: @hexir.jit builds hexir IR whose ops point at the user's lines, and every bad
input is a HexirError naming the op or argument, expected vs actual, and the user's line."""

# IR lines are checked as printed: wrapping them would change what they check.
# ruff: noqa: E501

from __future__ import annotations

import linecache
import warnings

import numpy as np
import pytest
from hexir_runtime import format as hxb
from mlir import ir

import hexir
from hexir import HexirError, PlacementError, TensorSpec, TraceError
from hexir.dialects import hexir as hx
from hexir.driver import run_stage
from hexir.jit import JitFunction

from .conftest import filecheck, line_of

W1 = np.arange(8 * 4, dtype=np.float32).reshape(8, 4) / 32
B1 = np.linspace(-1, 1, 4, dtype=np.float32)
W64 = np.ones((8, 4), dtype=np.float64)
WINT = np.ones((8, 4), dtype=np.int64)
_HIDDEN = np.full((4, 3), 2.0, dtype=np.float32)

X = TensorSpec((2, 8), "float32")


def ops_of(module: ir.Module) -> list[ir.Operation]:
    return [op.operation for op in module.body.operations[0].regions[0].blocks[0].operations]


def assert_at(error: HexirError, tag: str) -> None:
    """The error's `where` is this file's line that ends in `# tag`, and `source` is its text."""
    line = line_of(__file__, tag)
    assert error.where == f"{__file__}:{line}"
    assert error.source == linecache.getline(__file__, line).strip()


# ---- what a trace builds -----------------------------------------------------------------

@hexir.jit
def mlp(x):
    h = hexir.relu(hexir.linear(x, W1, B1))  # mlp-linear
    hexir.print(h)  # mlp-print
    return h


def test_trace_builds_the_graph():
    filecheck(str(mlp.trace(X)), """
        CHECK-LABEL: func.func @main(%arg0: tensor<2x8xf32>) -> tensor<2x4xf32>
        CHECK-SAME:    attributes {hexir.arg_names = ["x"], hexir.result_form = "single"} {
        CHECK-NEXT:  %[[W:.+]] = "hexir.constant"() {device = "auto", name = "W1", value = {{.+}} : tensor<8x4xf32>}
        CHECK-NEXT:  %[[B:.+]] = "hexir.constant"() {device = "auto", name = "B1", value = {{.+}} : tensor<4xf32>}
        CHECK-NEXT:  %[[Y:.+]] = "hexir.linear"(%arg0, %[[W]], %[[B]]) {device = "auto", operandSegmentSizes = array<i32: 1, 1,
        CHECK-SAME: 0, 0, 0, 0>}
        CHECK-SAME:    : (tensor<2x8xf32>, tensor<8x4xf32>, tensor<4xf32>) -> tensor<2x4xf32>
        CHECK-NEXT:  %[[R:.+]] = "hexir.relu"(%[[Y]]) {device = "auto",
        CHECK-SAME:      expr = "[\\22max\\22,[\\22arg\\22,0],[\\22const\\22,0.0]]",
        CHECK-SAME:      operandSegmentSizes = array<i32: 1, 0, 0, 0, 0, 0, 0, 0>}
        CHECK-NEXT:  "hexir.print"(%[[R]])
        CHECK-NEXT:  return %[[R]] : tensor<2x4xf32>
    """)


def test_ops_are_located_at_the_users_lines():
    module = mlp.trace(X)
    locations = {op.name: str(op.location) for op in ops_of(module)}
    linear_line, print_line = line_of(__file__, "mlp-linear"), line_of(__file__, "mlp-print")
    assert locations["hexir.linear"] == f'loc("{__file__}":{linear_line}:1)'
    assert locations["hexir.relu"] == f'loc("{__file__}":{linear_line}:1)'
    assert locations["hexir.print"] == f'loc("{__file__}":{print_line}:1)'


def test_constants_are_named_after_the_python_variables():
    w_local = np.ones((4, 3), dtype=np.float32)

    @hexir.jit
    def f(x):
        return hexir.linear(hexir.linear(x, W1), w_local)

    filecheck(str(f.trace(X)), """
        CHECK: "hexir.constant"() {device = "auto", name = "W1",
        CHECK: "hexir.constant"() {device = "auto", name = "w_local",
    """)


def test_private_and_unnamed_arrays_get_generated_names():
    @hexir.jit
    def f(x):
        return hexir.linear(hexir.linear(x, W1), _HIDDEN)

    filecheck(str(f.trace(X)), """
        CHECK: name = "W1"
        CHECK: name = "const1"
    """)


def test_an_array_used_twice_is_one_constant():
    @hexir.jit
    def f(x):
        return hexir.linear(x, W1), hexir.linear(x, W1)

    constants = [op for op in ops_of(f.trace(X)) if op.name == "hexir.constant"]
    assert len(constants) == 1


def test_temporary_weights_are_distinct_constants():
    @hexir.jit
    def f(x):
        for value in range(1, 21):
            x = hexir.linear(x, np.full((8, 8), float(value), dtype=np.float32))
        return x

    module = f.trace(X)
    constants = [op for op in ops_of(module) if op.name == "hexir.constant"]
    with module.context:
        values = [float(hx.constant_array(op).flat[0]) for op in constants]
    assert values == [float(value) for value in range(1, 21)]


def test_closure_variable_assigned_later_does_not_break_tracing():
    use_bias = False

    @hexir.jit
    def f(x):
        h = hexir.linear(x, W1)
        return hexir.relu(hexir.linear(x, W1, bias) if use_bias else h)

    assert '"hexir.relu"' in str(f.trace(X))
    bias = np.zeros(4, np.float32)
    assert bias.shape == (4,)


def test_returned_numpy_array_becomes_a_constant_output():
    @hexir.jit
    def f(x):
        return hexir.relu(x), B1

    filecheck(str(f.trace(X)), """
        CHECK: %[[B:.+]] = "hexir.constant"() {device = "auto", name = "B1"
        CHECK: return %{{.+}}, %[[B]] : tensor<2x8xf32>, tensor<4xf32>
    """)


def test_on_blocks_place_the_ops_built_inside():
    @hexir.jit
    def f(x):
        with hexir.on("cuda"):
            h = hexir.linear(x, W1)
            with hexir.on("cpu"):
                h = hexir.relu(h)
            h = hexir.relu(h)
        return hexir.relu(h)

    filecheck(str(f.trace(X)), """
        CHECK: "hexir.linear"{{.+}} {device = "cuda", operandSegmentSizes = array<i32: 1, 1, 0, 0, 0, 0, 0>}
        CHECK: "hexir.relu"{{.+}} {device = "cpu", expr = "
        CHECK: "hexir.relu"{{.+}} {device = "cuda", expr = "
        CHECK: "hexir.relu"{{.+}} {device = "auto", expr = "
    """)


def test_jit_placement_reaches_the_partitioner():
    @hexir.jit(placement="hexir.linear=cuda")
    def f(x):
        return hexir.relu(hexir.linear(x, W1))

    filecheck(str(run_stage(f.trace(X), "mlir-hetero", f.options)), """
        CHECK: "hexir.transfer"(%arg0) {source = "cpu", target = "cuda"}
        CHECK: "hexir.linear"{{.+}} {device = "cuda", operandSegmentSizes = array<i32: 1, 1, 0, 0, 0, 0, 0>}
        CHECK: "hexir.transfer"{{.+}} {source = "cuda", target = "cpu"}
        CHECK: "hexir.relu"{{.+}} {device = "cpu", expr = "
    """)


def test_float64_traces_with_float64_weights():
    @hexir.jit
    def f(x):
        return hexir.linear(x, W64)

    assert "-> tensor<2x4xf64>" in str(f.trace(TensorSpec((2, 8), "float64")))


# ---- errors at the user's line ------------------------------------------------------------

def test_linear_of_wrong_rank():
    @hexir.jit
    def f(x):
        return hexir.linear(x, W1)  # rank

    with pytest.raises(TraceError, match=r"linear: argument 'x' must have rank >= 1, got rank 0 "
                                         r"\(float32\[\]\)") as caught:
        f.trace(TensorSpec((), "float32"))
    assert_at(caught.value, "rank")
    assert caught.value.source == "return hexir.linear(x, W1)  # rank"


def test_error_text_reads_file_line_message_then_source():
    @hexir.jit
    def f(x):
        return hexir.linear(x, W1)  # text-format

    with pytest.raises(TraceError) as caught:
        f.trace(TensorSpec((2, 5), "float32"))
    first, *rest = str(caught.value).splitlines()
    assert first == f"{__file__}:{line_of(__file__, 'text-format')}: {caught.value.message}"
    assert [line.strip() for line in rest] == ["return hexir.linear(x, W1)  # text-format"]


def test_linear_with_mismatched_inner_dimensions():
    @hexir.jit
    def f(x):
        return hexir.linear(x, W1)  # inner

    with pytest.raises(TraceError, match=r"linear: inner dimensions differ: x is float32\[2, 5\] and w is "
                                         r"float32\[8, 4\]; expected w to have 5 rows, got 8") as caught:
        f.trace(TensorSpec((2, 5), "float32"))
    assert_at(caught.value, "inner")


def test_linear_with_mixed_dtypes():
    @hexir.jit
    def f(x):
        return hexir.linear(x, W64)  # mixed

    with pytest.raises(TraceError, match=r"linear: mixed dtypes: x is float32 but w is float64") as caught:
        f.trace(X)
    assert_at(caught.value, "mixed")


def test_linear_with_a_bias_of_the_wrong_shape():
    @hexir.jit
    def f(x):
        return hexir.linear(x, W1, np.zeros(8, np.float32))  # bias

    with pytest.raises(TraceError, match=r"linear: argument 'bias' must be float32\[4\], got float32\[8\]") as caught:
        f.trace(X)
    assert_at(caught.value, "bias")


def test_integer_weights_are_rejected():
    @hexir.jit
    def f(x):
        return hexir.linear(x, WINT)  # int-weights

    with pytest.raises(TraceError, match=r"linear: argument 'w' is a int64 array; expected float32, float64, bfloat16 or float16") \
            as caught:
        f.trace(X)
    assert_at(caught.value, "int-weights")


def test_python_number_is_not_an_operand():
    @hexir.jit
    def f(x):
        return hexir.relu(2.0)  # number

    with pytest.raises(TraceError, match=r"relu: needs a tensor or a numpy array among its operands, "
                                         r"got only numbers") as caught:
        f.trace(X)
    assert_at(caught.value, "number")


def test_returning_a_non_tensor():
    """Blamed on the function's definition (its first line, the decorator), not on its caller."""
    @hexir.jit  # returns-str
    def f(x):
        return hexir.relu(x), "done"

    with pytest.raises(TraceError, match=r"a @hexir.jit function must return tensors \(or a tuple of them, or "
                                         r"None\); test_returning_a_non_tensor.<locals>.f's output 1 is a str") \
            as caught:
        f.trace(X)
    assert_at(caught.value, "returns-str")


def test_op_outside_jit():
    with pytest.raises(TraceError, match=r"hexir ops can only be called inside a function decorated with "
                                         r"@hexir.jit") as caught:
        hexir.linear(np.ones((2, 8), np.float32), W1)  # outside
    assert_at(caught.value, "outside")


def test_print_outside_jit():
    with pytest.raises(TraceError, match=r"inside a function decorated with @hexir.jit"):
        hexir.print(W1)


def test_on_an_unknown_device_is_a_placement_error():
    @hexir.jit
    def f(x):
        with hexir.on("tpu"):
            return hexir.relu(x)

    with pytest.raises(PlacementError, match=r"on\(\): unknown device 'tpu'; expected one of cpu, cuda"):
        f.trace(X)


def test_on_an_unknown_device_points_at_the_with_line():
    @hexir.jit
    def f(x):
        with hexir.on("tpu"):  # on-tpu
            return hexir.relu(x)

    with pytest.raises(PlacementError) as caught:
        f.trace(X)
    assert_at(caught.value, "on-tpu")


CONCRETE = {
    "if": (lambda x: 1 if x else 0, r"bool\(\) needs the values of a traced float32\[2, 8\] tensor, which exist "
           r"only when the compiled function runs; use hexir ops"),
    "float": (lambda x: float(x), r"float\(\) needs the values of a traced float32\[2, 8\] tensor"),
    "int": (lambda x: int(x), r"int\(\) needs the values of a traced float32\[2, 8\] tensor"),
    "np.asarray": (lambda x: np.asarray(x), r"conversion to a numpy array \(np.asarray of a tensor\) needs the values "
                   r"of a traced float32\[2, 8\] tensor"),
    "indexing": (lambda x: x[x], r"indexing with a tensor is not supported: hexir takes basic indexing"),
    "iteration": (lambda x: list(x), r"iteration needs the values"),
}


@pytest.mark.parametrize("use, message", CONCRETE.values(), ids=CONCRETE.keys())
def test_concrete_use_of_a_tensor_is_a_trace_error(use, message):
    with pytest.raises(TraceError, match=message):
        JitFunction(use, hexir.jit(lambda x: x).options).trace(X)


def test_concrete_use_of_a_tensor_names_the_line():
    @hexir.jit
    def f(x):
        if x:  # if-tensor
            return x
        return hexir.relu(x)

    with pytest.raises(TraceError) as caught:
        f.trace(X)
    assert_at(caught.value, "if-tensor")


# ---- errors in the arguments of a call ------------------------------------------------------

@hexir.jit
def one_arg(x):
    return hexir.relu(x)


@pytest.mark.parametrize("args, message", [
    (([1.0, 2.0],), r"one_arg\(\): argument 'x' must be a numpy array, got list"),
    ((np.ones((2, 2), np.int8),), r"one_arg\(\): argument 'x' has dtype int8; expected float32, float64, bfloat16 or float16"),
    ((), r"one_arg\(\) takes 1 argument\(s\) \(x\), got 0"),
    ((X, X), r"one_arg\(\) takes 1 argument\(s\) \(x\), got 2"),
], ids=["list", "int8 array", "no argument", "two arguments"])
def test_bad_call_arguments(args, message):
    with pytest.raises(TraceError, match=message):
        one_arg.trace(*args)


def test_bad_call_arguments_name_the_calling_line():
    with pytest.raises(TraceError) as caught:
        one_arg.trace([1.0, 2.0])  # list-argument
    assert_at(caught.value, "list-argument")


@pytest.mark.parametrize("shape, dtype, message", [
    ((2, -1), "float32",
     r"^TensorSpec: shape must be non-negative integers or names \(identifiers; the first may be None\), got \(2, -1\)$"),
    ((2, 8), "int16", r"TensorSpec: dtype must be float32, float64, bfloat16 or float16 \(or int32, int64\), got int16"),
    ((2, 8), "banana", r"TensorSpec: 'banana' is not a dtype"),
])
def test_bad_tensor_spec(shape, dtype, message):
    with pytest.raises(TraceError, match=message):
        TensorSpec(shape, dtype)


def test_wrong_argument_types_of_the_api_are_trace_errors():
    with pytest.raises(TraceError, match=r"hexir.jit\(\): argument 'placement' must be str \| dict \| None, "
                                         r"got int") as caught:
        hexir.jit(placement=3)  # jit-placement-type
    assert_at(caught.value, "jit-placement-type")
    with pytest.raises(TraceError, match=r"hexir.jit\(\): argument 'fn' must be Callable \| None, got str"):
        hexir.jit("mlp")
    with pytest.raises(TraceError, match=r"hexir.export\(\): argument 'path' must be str \| Path, got int"):
        hexir.export(mlp, 3, X)
    with pytest.raises(TraceError, match=r"hexir.jit\(\): too many positional arguments"):
        hexir.jit(mlp, "hexir.linear=cuda")


def test_keyword_only_parameters_are_refused_at_decoration():
    with pytest.raises(TraceError, match=r"@hexir.jit: .*only plain positional tensor arguments are supported"):
        @hexir.jit
        def f(x, *, scale):
            return x


# ---- the jit cache ----------------------------------------------------------------------------

class _FakeModule:
    def main(self, *args):
        return args


@pytest.fixture
def no_runtime(monkeypatch):
    """Keep the compiled module out of it: `load` records what it gets and runs nothing."""
    loaded = []
    monkeypatch.setattr("hexir_runtime.load", lambda data: loaded.append(data) or _FakeModule())
    return loaded


def test_same_signature_traces_once(no_runtime):
    @hexir.jit
    def f(x):
        return hexir.relu(x)

    a = np.ones((2, 3), np.float32)
    f(a)
    f(a * 2)
    with pytest.raises(TraceError, match=r"argument 'x' is a TensorSpec; a call needs arrays"):
        f(TensorSpec((2, 3), "float32"))  # specs are for .compile() and export, not for running
    assert f.trace_count == 1
    assert len(no_runtime) == 1


def test_new_shape_or_dtype_traces_again(no_runtime):
    @hexir.jit
    def f(x):
        return hexir.relu(x)

    f(np.ones((2, 3), np.float32))
    f(np.ones((3, 2), np.float32))
    f(np.ones((3, 2), np.float64))
    f(np.ones((3, 2), np.float64))
    f(np.ones((2, 3), np.float32))
    assert f.trace_count == 3
    assert len(no_runtime) == 3
    assert all(data.startswith(b"\x89HXB\r\n\x1a\n") for data in no_runtime)


def test_cache_key_holds_signature_placement_and_options():
    f = hexir.jit(lambda x: x)
    spec = (TensorSpec((2, 3), "float32"),)
    assert f.cache_key(spec) == f.cache_key((TensorSpec((2, 3), np.float32),))
    assert f.cache_key(spec) != f.cache_key((TensorSpec((3, 2), "float32"),))
    assert f.cache_key(spec) != f.cache_key((TensorSpec((2, 3), "float64"),))
    with hexir.on("cuda"):
        inside = f.cache_key(spec)
    assert inside != f.cache_key(spec)
    g = hexir.jit(lambda x: x, target="cpu:x86-64-v3")
    assert g.cache_key(spec) != f.cache_key(spec)
    h = hexir.jit(lambda x: x, placement="hexir.relu=cuda")
    assert h.cache_key(spec) != f.cache_key(spec)
    hash(f.cache_key(spec))


# ---- the jit's glue: its cache key, the runtime's warnings, the placement text ------------------

def test_a_call_inside_an_on_block_compiles_again(no_runtime):
    """The device of an enclosing `hexir.on()` is part of what a call compiles: the jit's key
    (its `cache_key`) holds it, so the same arrays under `on("cuda")` make a second module."""
    @hexir.jit
    def f(x):
        return hexir.relu(x)

    a = np.ones((2, 3), np.float32)
    f(a)
    with hexir.on("cuda"):
        f(a)
    assert f.trace_count == 2 and len(no_runtime) == 2
    devices = [[k["device"] for k in hxb.decode(data).json["kernels"]] for data in no_runtime]
    assert devices == [["cpu"], ["cuda"]]
    with hexir.on("cuda"):
        f(a)
    f(a)
    assert f.trace_count == 2 and len(no_runtime) == 2


@pytest.fixture
def no_gpu(monkeypatch):
    """This process sees no usable GPU, whatever the machine has."""
    import hexir_runtime.module
    from hexir_runtime.errors import DeviceError

    def refuse():
        raise DeviceError("no CUDA device (made unusable by the test)")
    monkeypatch.setattr(hexir_runtime.module, "_cuda_device", refuse)
    monkeypatch.setattr(hexir_runtime.module, "_notices", set())  # the notice is said once per process


def _gpu_calls() -> tuple[list[warnings.WarningMessage], list[np.ndarray]]:
    """Two calls of a GPU-placed function, the warnings they raise and their results."""
    f = hexir.jit(lambda x: hexir.relu(x), placement="hexir.relu=cuda")
    x = np.array([[-1.0, 2.0]], np.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [f(x)]  # gpu-call
        results.append(f(x))
    return caught, results


def test_a_gpu_function_without_a_gpu_warns_once(no_gpu):
    caught, results = _gpu_calls()
    assert [(w.category, str(w.message)) for w in caught] == [
        (RuntimeWarning, "no usable GPU (no CUDA device (made unusable by the test)); running the CUDA kernels on "
                         "the cpu")]
    for result in results:
        np.testing.assert_array_equal(result, [[0.0, 2.0]])


def test_a_gpu_function_without_a_gpu_warns_at_the_callers_line(no_gpu):
    caught, _ = _gpu_calls()
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, line_of(__file__, "gpu-call"))]


@pytest.mark.parametrize("text", ["hexir.linear= cuda", " hexir.linear = cuda ", "hexir.linear=cuda ,hexir.relu= cpu"])
def test_a_placement_with_spaces_works(text):
    x, w = np.ones((2, 3), np.float32), np.full((3, 4), -0.5, np.float32)
    f = hexir.jit(lambda x: hexir.relu(hexir.linear(x, w)), placement=text)
    assert ("hexir.linear", "cuda") in f.options.placement
    kernels = hxb.decode(f.compile(x)).json["kernels"]
    assert {k["op"]: k["device"] for k in kernels}["linear"] == "cuda"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "no usable GPU", where there is none
        np.testing.assert_array_equal(f(x), np.maximum(x @ w, 0))
