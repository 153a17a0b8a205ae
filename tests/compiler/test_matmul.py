"""matmul between tensors (#24 item 3): `a @ b` and `hexir.matmul(a, b)` as numpy's matmul
(2-D, batched, broadcast batch dimensions, 1-D operands), a constant on either side, against
np.matmul on the cpu and through the cuda kernels' cpu twins (placement "*=cuda"); its fused
epilogue (`(q @ kT) * scale + mask` is one kernel), checked on the IR fuse leaves and end to
end; a property test over random ranks and shapes; the bad input, at the user's line."""

# IR lines are checked as printed: wrapping them would change what they check.
# ruff: noqa: E501

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hexir_runtime import format as hxb
from hexir_runtime import load
from hypothesis import given, settings
from hypothesis import strategies as st

import hexir
from hexir import TensorSpec, TraceError
from hexir.driver import Options, parse_placement
from hexir.jit import JitFunction
from hexir.target import parse_target

from .conftest import filecheck, line_of, lower
from .test_families import CPU, CUDA, fused, pattern

RNG = np.random.default_rng(24)
TOLERANCE = {"float32": 2e-5, "float64": 1e-12}
_erf = np.vectorize(math.erf, otypes=[np.float64])


def _compile(function, specs, device):
    """The module of `function` on `specs` (all its ops on `device`) and its manifest's kernels;
    a cuda module runs its kernels' cpu twins here."""
    placement = "*=cuda" if device == "cuda" else None
    target = "cpu:host,cuda:sm_90" if device == "cuda" else "cpu:host"
    jitted = JitFunction(function, Options(placement=parse_placement(placement), target=parse_target(target)))
    data = jitted.compile(*specs)
    return load(data, "cpu"), hxb.decode(data).json["kernels"]


def _inputs(*shapes, dtype="float32"):
    return [RNG.standard_normal(shape).astype(dtype) for shape in shapes]


def _close(got, expected, dtype):
    assert got.dtype == np.dtype(dtype) and got.shape == np.shape(expected)
    np.testing.assert_allclose(got, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * 10)


SHAPES = [  # (a, b, dtype): numpy's cases, odd sizes, 1s, a batch broadcast each way
    ((3, 5), (5, 7), "float32"), ((37, 13), (13, 45), "float64"), ((1, 9), (9, 1), "float32"),
    ((6, 1), (1, 33), "float64"), ((4, 7, 19), (4, 19, 3), "float32"), ((2, 3, 5, 8), (2, 3, 8, 6), "float64"),
    ((2, 1, 5, 8), (3, 8, 65), "float32"), ((5, 8), (2, 3, 8, 6), "float64"), ((3, 1, 7, 4), (1, 2, 4, 7), "float32"),
    ((7,), (7, 5), "float64"), ((2, 7), (7,), "float32"), ((9,), (3, 9, 2), "float32"), ((2, 3, 9), (9,), "float64"),
    ((1,), (1, 1), "float32"), ((25, 70), (70, 40), "float32"),
]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("a_shape, b_shape, dtype", SHAPES)
def test_a_matmul_of_two_inputs_is_numpys(a_shape, b_shape, dtype, device):
    module, kernels = _compile(lambda a, b: a @ b, [TensorSpec(a_shape, dtype), TensorSpec(b_shape, dtype)], device)
    assert [(k["op"], k["device"]) for k in kernels if not k["name"].endswith("_cpu")] == [("matmul", device)]
    a, b = _inputs(a_shape, b_shape, dtype=dtype)
    _close(module.main(a, b), np.matmul(a.astype(np.float64), b), dtype)


def test_a_constant_on_either_side_and_the_function_form():
    w, left, stack = _inputs((8, 6), (5, 4), (3, 8, 6))

    def f(x, y, z):
        return x @ w, left @ y, hexir.matmul(y, x), x @ stack, np.matmul(left, y), z @ w

    specs = [TensorSpec((4, 8), "float32"), TensorSpec((4, 4), "float32"), TensorSpec((2, 3, 8), "float32")]
    module, kernels = _compile(f, specs, "cpu")
    # x @ w (a 2-D constant on the right of a tensor of rank >= 2) is a linear; the rest are matmuls
    # (left @ y and np.matmul(left, y) are one kernel, called twice: passes/share_kernels.py)
    assert sorted(k["op"] for k in kernels) == ["linear", "linear", "matmul", "matmul", "matmul"]
    x, y, z = _inputs((4, 8), (4, 4), (2, 3, 8))
    expected = (x @ w, left @ y, y @ x, x @ stack, left @ y, z @ w)
    for value, reference in zip(module.main(x, y, z), expected, strict=True):
        _close(value, reference.astype(np.float64), "float32")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_scale_and_mask_then_softmax_is_two_kernels(device, dtype):
    """(q @ kT) * scale + mask: the matmul's epilogue (the mask broadcast over batch and heads);
    the softmax reads the scores, then @ v."""
    def attention(q, kt, v, mask):
        return hexir.softmax(q @ kt * 0.25 + mask) @ v

    shapes = [(2, 3, 7, 16), (2, 3, 16, 7), (2, 3, 7, 16), (7, 7)]
    module, kernels = _compile(attention, [TensorSpec(s, dtype) for s in shapes], device)
    own = [k for k in kernels if not k["name"].endswith("_cpu")]
    assert [k["op"] for k in own] == ["matmul", "reduce", "matmul"]
    assert own[0]["expr"] == ["add", ["mul", ["arg", 0], ["const", 0.25]], ["arg", 1]]
    assert [a["shape"] for a in own[0]["args"]] == [[2, 3, 7, 16], [2, 3, 16, 7], [7, 7], [2, 3, 7, 7]]
    q, kt, v, mask = _inputs(*shapes, dtype=dtype)
    scores = q.astype(np.float64) @ kt * 0.25 + mask
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    _close(module.main(q, kt, v, mask), weights / weights.sum(-1, keepdims=True) @ v, dtype)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_gelu_and_a_residual_after_a_batched_matmul_are_its_epilogue(device):
    module, kernels = _compile(lambda a, b, r: hexir.gelu(a @ b) + r,
                               [TensorSpec(s, "float64") for s in ((3, 5, 9), (9, 11), (5, 11))], device)
    assert [k["op"] for k in kernels if not k["name"].endswith("_cpu")] == ["matmul"]
    a, b, r = _inputs((3, 5, 9), (9, 11), (5, 11), dtype="float64")
    y = a @ b
    _close(module.main(a, b, r), 0.5 * y * (1 + _erf(y / math.sqrt(2))) + r, "float64")


# ---- the IR: fuse makes the pointwise ops the matmul's epilogue ---------------------------------

Q, KT, S, MASK = "tensor<2x4x7x16xf32>", "tensor<2x4x16x7xf32>", "tensor<2x4x7x7xf32>", "tensor<7x7xf32>"
SCORES = f"""
func.func @main(%q: {Q}, %kt: {KT}, %mask: {MASK}) -> {S} {{
  %0 = "hexir.matmul"(%q, %kt) {{device = "auto", operandSegmentSizes = array<i32: 1, 1, 0, 0, 0, 0>}} : ({Q}, {KT}) -> {S}
  %1 = "hexir.mul"(%0) {{device = "auto", expr = "[\\22mul\\22,[\\22arg\\22,0],[\\22const\\22,0.25]]", operandSegmentSizes = array<i32: 1, 0, 0, 0, 0, 0, 0, 0>}} : ({S}) -> {S}
  %2 = "hexir.add"(%1, %mask) {{device = "auto", expr = "[\\22add\\22,[\\22arg\\22,0],[\\22arg\\22,1]]", operandSegmentSizes = array<i32: 1, 1, 0, 0, 0, 0, 0, 0>}} : ({S}, {MASK}) -> {S}
  return %2 : {S}
}}
"""
SCALED_MASKED = ["add", ["mul", ["arg", 0], ["const", 0.25]], ["arg", 1]]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fuse_absorbs_the_scale_and_the_mask_into_the_matmul(device):
    options = CUDA if device == "cuda" else CPU
    filecheck(fused(SCORES, **options), f"""
        CHECK:      %[[S:.+]] = "hexir.matmul"(%{{{{.+}}}}, %{{{{.+}}}}, %{{{{.+}}}}) {{device = "{device}", hexir.epilogue = {pattern(SCALED_MASKED)}, operandSegmentSizes = array<i32: 1, 1, 1, 0, 0, 0>}} : ({Q}, {KT}, {MASK}) -> {S}
        CHECK-NOT:  hexir.mul
        CHECK-NOT:  hexir.add
        CHECK-NOT:  hexir.matmul
    """)
    tir = lower(SCORES, "mlir-tir", **options)
    filecheck(tir, f"""
        CHECK:      func.func public @[[K:matmul_[0-9]+]](%arg0: memref<2x4x7x16xf32>, %arg1: memref<2x4x16x7xf32>, %arg2: memref<7x7xf32>, %arg3: memref<2x4x7x7xf32>)
        CHECK-SAME: hextir.expr = {pattern(SCALED_MASKED)}
        CHECK-SAME: hextir.kernel = #hextir.kernel<"{device}", "matmul">
        CHECK-NOT:  #hextir.kernel<"{device}", "pointwise">
        CHECK-LABEL: func.func @main
        CHECK:      "hexir.call"(%{{{{.+}}}}, %{{{{.+}}}}, %{{{{.+}}}}) {{callee = @[[K]], device = "{device}"
        CHECK-NOT:  "hexir.call"
    """)


def test_the_cpu_kernel_walks_batch_and_row_tiles_in_parallel_with_vector_fmas():
    tir = lower(SCORES, "mlir-tir", **CPU)
    filecheck(tir, """
        CHECK:      func.func public @matmul_0(
        CHECK-SAME: hextir.work = {extent = "8", grain = 25 : i64}
        CHECK:      scf.for {{.+}} {
        CHECK:      vector.fma
        CHECK:      } {hextir.schedule = #hextir.loop<"serial", "">}
        CHECK:      vector.store
        CHECK:      } {hextir.schedule = #hextir.loop<"parallel", "">}
    """)  # 2 x 4 batch indices x one tile of 24 rows (MR 6 x 4 groups on x86-64-v4); 25 items make 64K FMAs


def test_the_cuda_kernel_is_tiled_through_shared_memory_grid_x_the_batch_and_row_tiles():
    tir = lower(SCORES, "mlir-tir", **CUDA)
    kernel = tir[:tir.index("func.func public @matmul_0_cpu")]
    filecheck(kernel, """
        CHECK:      func.func public @matmul_0(
        CHECK-SAME: hextir.launch = {block = array<i64: 16, 16, 1>, grid = ["8", "1", "1"]
        CHECK:      "hextir.barrier"
        CHECK:      "hextir.barrier"
        CHECK:      #hextir.loop<"parallel", "threadIdx.x">
        CHECK:      } {hextir.schedule = #hextir.loop<"parallel", "blockIdx.x">}
        CHECK:      } {hextir.schedule = #hextir.loop<"parallel", "blockIdx.y">}
    """)  # 2 x 4 batch indices x one row tile of 64, one column tile
    assert kernel.count('"hextir.alloc_local"') == 3  # a's and b's tiles, a thread's sums


# ---- property: any ranks and shapes ---------------------------------------------------------------

@st.composite
def matmul_shapes(draw):
    """Shapes numpy's matmul takes, their extents named: ranks 1 to 4, K, M, N of 1 to 20, batch
    dims (b0, b1) of 1 to 3, each operand's either its own or 1 (broadcast); and the sizes."""
    sizes = {name: draw(st.integers(1, 20)) for name in ("m", "k", "n")}
    sizes.update({name: draw(st.integers(1, 3)) for name in ("b0", "b1")})
    ranks = draw(st.tuples(st.integers(1, 4), st.integers(1, 4)))
    shapes = []
    for rank, core in zip(ranks, (("m", "k"), ("k", "n")), strict=True):
        if rank == 1:
            shapes.append(("k",))
            continue
        own = [d if draw(st.booleans()) else 1 for d in ("b0", "b1")[4 - rank:]] if rank > 2 else []
        shapes.append((*own, *core))
    if len(shapes[0]) == len(shapes[1]) == 1:  # (a scalar: not a hexir tensor)
        shapes[1] = ("k", "n")
    return shapes[0], shapes[1], sizes, draw(st.sampled_from(["float32", "float64"]))


def _sized(shape, sizes, symbols=()):
    """`shape` with each name not among `symbols` replaced by its size."""
    return tuple(d if d in symbols or isinstance(d, int) else sizes[d] for d in shape)


@settings(max_examples=10, deadline=None)
@given(shapes=matmul_shapes())
def test_matmul_of_any_ranks_and_shapes_is_numpys(shapes):
    a_shape, b_shape, sizes, dtype = shapes
    a_shape, b_shape = _sized(a_shape, sizes), _sized(b_shape, sizes)
    module, _ = _compile(lambda a, b: hexir.matmul(a, b), [TensorSpec(a_shape, dtype), TensorSpec(b_shape, dtype)],
                         "cpu")
    a, b = _inputs(a_shape, b_shape, dtype=dtype)
    _close(module.main(a, b), np.matmul(a.astype(np.float64), b), dtype)


@settings(max_examples=8, deadline=None)
@given(shapes=matmul_shapes(), symbols=st.sets(st.sampled_from(["m", "k", "n", "b0", "b1"]), min_size=1),
       device=st.sampled_from(["cpu", "cuda"]))
def test_matmul_with_symbolic_extents_is_numpys_at_any_sizes(shapes, symbols, device):
    """Some extents named (one module), run at the drawn sizes and at others."""
    a_shape, b_shape, sizes, dtype = shapes
    specs = [TensorSpec(_sized(s, sizes, symbols), dtype) for s in (a_shape, b_shape)]
    module, _ = _compile(lambda a, b: a @ b, specs, device)
    for call in (sizes, {**sizes, **{name: sizes[name] + 3 for name in symbols}}, {**sizes, **dict.fromkeys(symbols, 1)}):
        a, b = _inputs(_sized(a_shape, call), _sized(b_shape, call), dtype=dtype)
        _close(module.main(a, b), np.matmul(a.astype(np.float64), b), dtype)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_symbolic_batch_is_a_size_of_the_kernel(device):
    module, kernels = _compile(lambda q, k: q @ k, [TensorSpec(("batch", 6, 8), "float32"),
                                                    TensorSpec((8, 9), "float32")], device)
    assert [k["sizes"] for k in kernels] == [["batch"]] * len(kernels)
    k = _inputs((8, 9))[0]
    for batch in (1, 5, 30):
        q = _inputs((batch, 6, 8))[0]
        _close(module.main(q, k), q.astype(np.float64) @ k, "float32")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_attention_with_a_symbolic_batch_and_sequence(device):
    """Every extent but the model's width symbolic: the scores' N, the second product's K and the
    mask's both axes are sizes of the call (the cpu kernel's columns then go NR at a time, then
    one by one)."""
    def attention(q, kt, v, mask):
        return hexir.softmax(q @ kt * 0.125 + mask) @ v

    shapes = [("batch", "seq", 64), ("batch", 64, "seq"), ("batch", "seq", 64), ("seq", "seq")]
    module, kernels = _compile(attention, [TensorSpec(s, "float32") for s in shapes], device)
    own = [k for k in kernels if not k["name"].endswith("_cpu")]
    assert [(k["op"], k["sizes"]) for k in own] == [("matmul", ["batch", "seq"]), ("reduce", ["batch", "seq"]),
                                                    ("matmul", ["batch", "seq"])]
    for batch, seq in ((1, 1), (2, 7), (3, 33), (1, 70)):
        q, kt, v, mask = _inputs(*(tuple({"batch": batch, "seq": seq}.get(d, d) for d in s) for s in shapes))
        scores = q.astype(np.float64) @ kt * 0.125 + mask
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        _close(module.main(q, kt, v, mask), weights / weights.sum(-1, keepdims=True) @ v, "float32")


@pytest.mark.parametrize("a_shape, b_shape", [
    (("n", "m", "k"), ("n", "k", 5)), (("m", "k"), ("k", "j")), (("k",), (2, "k", "j")), ((3, 1, "m", 4), ("h", 4, 9)),
])
def test_symbolic_extents_anywhere(a_shape, b_shape):
    module, kernels = _compile(hexir.matmul, [TensorSpec(a_shape, "float64"), TensorSpec(b_shape, "float64")], "cpu")
    (kernel,) = kernels
    assert kernel["sizes"] == list(dict.fromkeys(d for d in (*a_shape, *b_shape) if isinstance(d, str)))
    for sizes in ({"n": 2, "m": 3, "k": 5, "j": 7, "h": 2}, {"n": 1, "m": 1, "k": 1, "j": 1, "h": 1},
                  {"n": 3, "m": 19, "k": 40, "j": 33, "h": 4}):
        a, b = _inputs(*(tuple(sizes.get(d, d) for d in s) for s in (a_shape, b_shape)), dtype="float64")
        _close(module.main(a, b), a @ b, "float64")


# ---- bad input, at the user's line ----------------------------------------------------------------

def _assert_at(error: TraceError, tag: str, *needles: str) -> None:
    path, line = error.where.rsplit(":", 1)
    assert (Path(path).resolve(), int(line)) == (Path(__file__).resolve(), line_of(__file__, tag)), error
    for needle in needles:
        assert needle in error.message, f"{needle!r} not in {error.message!r}"


F32 = TensorSpec((2, 3), "float32")
ERRORS = [
    ("inner", lambda x, y: x @ y, (F32, TensorSpec((4, 5), "float32")),  # inner
     ["matmul: inner dimensions differ", "a is float32[2, 3]", "b is float32[4, 5]", "(3)", "(4)"]),
    ("inner-1d", lambda x, y: hexir.matmul(x, y), (F32, TensorSpec((2,), "float32")),  # inner-1d
     ["inner dimensions differ", "float32[2]", "its only axis"]),
    ("inner-const", lambda x: np.ones((4, 3), np.float32) @ x, (TensorSpec((2, 2, 3), "float32"),),  # inner-const
     ["inner dimensions differ", "a is float32[4, 3]", "b is float32[2, 2, 3]"]),
    ("mixed", lambda x, y: x @ y, (F32, TensorSpec((3, 2), "float64")),  # mixed
     ["matmul: mixed dtypes", "float32[2, 3]", "float64[3, 2]"]),
    ("batch", lambda x, y: x @ y, (TensorSpec((2, 2, 3), "float32"), TensorSpec((3, 3, 4), "float32")),  # batch
     ["batch dimensions do not broadcast", "float32[2, 2, 3]", "float32[3, 3, 4]"]),
    ("scalar-number", lambda x: x @ 2.0, (F32,), ["matmul", "'b'", "float"]),  # scalar-number
    ("scalar-array", lambda x: np.float32(2.0) @ x, (F32,), ["matmul", "'a'"]),  # scalar-array
    ("vectors", lambda x, y: x @ y, (TensorSpec((3,), "float32"),) * 2, ["a scalar", "hexir.sum(a * b"]),  # vectors
    ("argmax", lambda x: x.argmax(keepdims=True) @ x, (F32,), ["matmul", "int64"]),  # argmax
]


@pytest.mark.parametrize("tag, function, specs, needles", ERRORS, ids=[case[0] for case in ERRORS])
def test_bad_input_is_a_trace_error_at_the_users_line(tag, function, specs, needles):
    with pytest.raises(TraceError) as caught:
        hexir.jit(function, cache=False).trace(*specs)
    _assert_at(caught.value, tag, *needles)
