"""The layout ops (#24): reshape, transpose, .T, concat, basic indexing and take, end to end
against numpy on the cpu and on the cuda kernels' cpu twins (placement "*=cuda": the cuda
kernels themselves are compiled, CUBIN + PTX), and on the reference device (numpy running each
kernel's record); float32, float64, int32 and int64, ranks 1 to 5, random shapes, permutations,
slices and concat lists (hypothesis); the errors at the user's line; ids out of range; the IR
of one layout kernel through FileCheck."""

# ruff: noqa: E501 - IR lines are checked as printed

from __future__ import annotations

import inspect

import numpy as np
import pytest
from hexir_runtime import InputError, load
from hypothesis import given, settings
from hypothesis import strategies as st

import hexir
from hexir.driver import Options, parse_placement
from hexir.errors import TraceError
from hexir.jit import JitFunction
from hexir.target import parse_target

from .conftest import filecheck, lower

DEVICES = ["cpu", "cuda"]
DTYPES = ["float32", "float64", "int32", "int64"]


def _module(function, specs, device, runtime_device="cpu"):
    placement = "*=cuda" if device == "cuda" else None
    target = "cpu:host,cuda:sm_90" if device == "cuda" else "cpu:host"
    jitted = JitFunction(function, Options(placement=parse_placement(placement), target=parse_target(target)))
    return load(jitted.compile(*specs), runtime_device)


def _draw(rng, shape, dtype):
    if dtype.startswith("int"):
        return rng.integers(-1000, 1000, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


class NP:
    """numpy where hexir stands in a case: `function(F, *xs)`."""

    concat = staticmethod(np.concatenate)
    take = staticmethod(lambda table, ids: np.take(table, ids, axis=0))


def _run_both(function, arrays, device):
    """Compile `function(hexir, ...)` for the arrays' specs; its outputs on `device` (and on the
    reference device, both exactly) against `function(NP, ...)` on the numpy arrays."""
    specs = [hexir.TensorSpec.of(a) for a in arrays]
    want = function(NP, *arrays)
    want = want if isinstance(want, tuple) else (want,)
    def traced(*xs):
        return function(hexir, *xs)
    traced.__signature__ = inspect.Signature([inspect.Parameter(f"x{i}", inspect.Parameter.POSITIONAL_OR_KEYWORD)
                                              for i in range(len(arrays))])
    for runtime in ("cpu", "reference"):
        got = _module(traced, specs, device, runtime).main(*arrays)
        got = got if isinstance(got, tuple) else (got,)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, g.shape, w.dtype, w.shape)
            np.testing.assert_array_equal(g, w)


# ---- every op, every dtype, both devices -------------------------------------------------------

def _all_ops(F, x, y, table, ids):  # noqa: N803 - F stands where the module hexir stands
    return (x.T, x.transpose(), x.reshape(3, -1, 2), x.reshape((-1,)), x[1], x[-1, ::-2], x[None, :, 1:5:2],
            x[..., 3], F.concat([x, y, x], axis=1), F.take(table, ids))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_every_layout_op_matches_numpy(device, dtype):
    rng = np.random.default_rng(0)
    x, y = _draw(rng, (6, 8), dtype), _draw(rng, (6, 3), dtype)
    table = _draw(rng, (11, 5), dtype)
    ids = rng.integers(0, 11, (2, 3)).astype("int32" if dtype in ("float32", "int32") else "int64")
    _run_both(_all_ops, [x, y, table, ids], device)


@pytest.mark.parametrize("device", DEVICES)
def test_ranks_one_to_five(device):
    rng = np.random.default_rng(1)
    xs = [_draw(rng, shape, "float32") for shape in [(7,), (3, 5), (2, 3, 4), (2, 1, 3, 2), (2, 3, 1, 2, 3)]]

    def function(F, a, b, c, d, e):  # noqa: N803
        return (a[2:6], a.reshape(7, 1), b.transpose(1, 0), c.transpose(2, 0, 1), c[:, ::2, 1:],
                d.transpose(3, 1, 0, 2), d.reshape(2, 6), e.transpose(4, 2, 0, 3, 1), e[1, :, 0, ..., ::-1],
                e.reshape(6, 6))
    _run_both(function, xs, device)


def test_a_table_constant_and_ids_of_any_rank():
    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    rng = np.random.default_rng(2)
    for shape in [(5,), (2, 3), (2, 2, 3)]:
        ids = rng.integers(0, 10, shape).astype(np.int64)
        result = hexir.jit(lambda ids: hexir.take(table, ids))(ids)
        np.testing.assert_array_equal(result, np.take(table, ids, axis=0))
    words = np.array([3, 1, 4], np.int32)  # ids as a constant, the table an input
    np.testing.assert_array_equal(hexir.jit(lambda t: hexir.take(t, words))(table), table[words])


def test_ids_moved_by_layout_ops_and_an_argmax_reach_a_take():
    table = np.random.default_rng(3).standard_normal((6, 3))

    @hexir.jit
    def f(ids, scores):
        flat = hexir.concat([ids.reshape(-1), ids[:, 0]], axis=0)
        return hexir.take(table, flat), hexir.take(table, scores.argmax(axis=1))
    ids = np.array([[5, 0], [2, 4]], np.int64)
    scores = np.random.default_rng(4).standard_normal((3, 6))
    got_flat, got_best = f(ids, scores)
    np.testing.assert_array_equal(got_flat, table[np.concatenate([ids.reshape(-1), ids[:, 0]])])
    np.testing.assert_array_equal(got_best, table[scores.argmax(1)])


def test_layout_ops_mix_with_compute_ops():
    w = np.random.default_rng(5).standard_normal((4, 6)).astype(np.float32)

    @hexir.jit
    def heads(x):  # q/k/v split, heads, a softmax over keys
        qkv = hexir.linear(x, w)
        q, k = qkv[:, 0:2], qkv[:, 2:4]
        return hexir.softmax(hexir.concat([q, k], axis=1).reshape(2, -1).T * 0.5, axis=0)
    x = np.random.default_rng(6).standard_normal((3, 4)).astype(np.float32)
    qkv = x @ w
    scores = np.concatenate([qkv[:, 0:2], qkv[:, 2:4]], 1).reshape(2, -1).T * 0.5
    e = np.exp(scores - scores.max(0))
    np.testing.assert_allclose(heads(x), e / e.sum(0), rtol=1e-5)


def test_a_symbolic_batch_is_carried_through():
    @hexir.jit
    def f(x):
        return x.reshape(x.shape[0], 2, 6)[:, 1, ::3], x[:, 2:]
    for batch in (1, 5, 0, 3):  # (symbolic from the second size on: one trace for 5, 0 and 3)
        x = np.arange(batch * 12, dtype=np.float32).reshape(batch, 12)
        a, b = f(x)
        np.testing.assert_array_equal(a, x.reshape(batch, 2, 6)[:, 1, ::3])
        np.testing.assert_array_equal(b, x[:, 2:])
    assert f.trace_count == 2


# ---- property tests ---------------------------------------------------------------------------

SHAPES = st.lists(st.integers(1, 4), min_size=1, max_size=5).map(tuple)


@settings(max_examples=12, deadline=None, derandomize=True, database=None)
@given(shape=SHAPES, data=st.data())
def test_random_transposes_reshapes_and_slices(shape, data):
    perm = data.draw(st.permutations(range(len(shape))))
    slices = tuple(data.draw(st.builds(slice, st.integers(-5, 5) | st.none(), st.integers(-5, 5) | st.none(),
                                       st.sampled_from([None, 1, 2, -1, -2, 3]))) for _ in shape)
    x = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape)
    if 0 in x[slices].shape:
        slices = (slice(None),) * len(shape)
    split = data.draw(st.integers(0, len(shape)))
    target = (-1, *shape[split:]) if split else (*shape, 1)
    device = data.draw(st.sampled_from(DEVICES))
    _run_both(lambda F, x: (x.transpose(*perm), x[slices], x.reshape(target)), [x], device)


@settings(max_examples=8, deadline=None, derandomize=True, database=None)
@given(shape=SHAPES, data=st.data())
def test_random_concat_lists(shape, data):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    sizes = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=10))
    rng = np.random.default_rng(len(sizes))
    arrays = [_draw(rng, shape[:axis % len(shape)] + (n,) + shape[axis % len(shape) + 1:], "int32") for n in sizes]
    device = data.draw(st.sampled_from(DEVICES))
    _run_both(lambda F, *xs: F.concat(list(xs), axis=axis), arrays, device)


# ---- errors at the user's line ------------------------------------------------------------------

X = hexir.TensorSpec((2, 3, 4), "float32")


@pytest.mark.parametrize("function, message", [
    (lambda x: x.reshape(5, -1), r"reshape: cannot reshape float32\[2, 3, 4\] to \[5, -1\]: the sizes cannot match"),
    (lambda x: x.reshape(2, 3, 5), r"reshape: cannot reshape float32\[2, 3, 4\] to \[2, 3, 5\]: the sizes cannot match"),
    (lambda x: x.reshape(-1, -1), r"reshape: at most one -1"),
    (lambda x: x.reshape(2.5, 4), r"reshape: the shape holds ints >= 0, symbol names and one -1"),
    (lambda x: x.T, r"\.T of rank 3 on a traced float32\[2, 3, 4\] tensor is not a hexir op; x\.T is for 2-D tensors; "
                    r"use x\.transpose\(\*axes\)"),
    (lambda x: x.transpose(0, 0, 1), r"transpose: axes \[0, 0, 1\] are not a permutation of the 3 axes"),
    (lambda x: x.transpose(0, 3, 1), r"transpose: axis 3 is out of range for a tensor of rank 3"),
    (lambda x: hexir.concat([x, x[:, :2, :2]], axis=1), r"concat: .*cannot concatenate \[2, 3, 4\], \[2, 2, 2\] along axis 1"),
    (lambda x: hexir.concat([x, x.reshape(2, 12)], axis=0), r"concat: cannot concatenate float32\[2, 3, 4\], float32\[2, 12\] along axis 0: one rank"),
    (lambda x: hexir.concat(x, axis=0), r"concat: expected a list or tuple of tensors, got Tensor"),
    (lambda x: x[x], r"indexing with a tensor is not supported: hexir takes basic indexing"),
    (lambda x: x[[0, 1]], r"indexing with a list is not supported"),
    (lambda x: x[2], r"index 2 is out of range for axis 0 of float32\[2, 3, 4\]"),
    (lambda x: x[0, 0, 0, 0], r"too many indices for float32\[2, 3, 4\]: 4 for its 3 axes"),
    (lambda x: x[..., ...], r"an index can only have a single ellipsis"),
    (lambda x: x[:, 3:], r"slice: argument 'result' is float32\[2, 0, 4\]; only the first axis of a tensor may be empty"),
    (lambda x: hexir.take(x, x), r"take: ids is float32\[2, 3, 4\]; ids are int32 or int64"),
    (lambda x: hexir.take(np.ones((3, 2), np.float32), np.array([0, 3])), r"take: the constant ids hold 3 at \[1\], out of range for a table of 3 rows"),
    (lambda x: hexir.take(np.ones((3, 2), np.float32), x.argmax(axis=2)), r"take: the ids are an argmax over 4 values, which may not be below the table's 3 rows"),
    (lambda x: hexir.relu(x.argmax(axis=1)), r"relu: operand 0 is a int64\[2, 4\] tensor; relu computes on float32, float64, bfloat16 or float16"),
], ids=["reshape -1", "reshape size", "two -1", "reshape float", ".T rank 3", "perm", "axis range", "concat dims",
        "concat ranks", "concat one tensor", "tensor index", "list index", "int index range", "too many", "two ellipses",
        "empty inner axis", "take float ids", "constant ids", "argmax ids", "float op on ints"])
def test_layout_errors_are_trace_errors_at_the_users_line(function, message):
    @hexir.jit
    def f(x):
        return function(x)
    with pytest.raises(TraceError, match=message) as caught:
        f.trace(X)
    assert caught.value.where and caught.value.where.endswith(f":{function.__code__.co_firstlineno}")


def test_symbolic_dims_may_only_map_to_themselves():
    spec = hexir.TensorSpec(("batch", 6), "float32")
    ok = hexir.jit(lambda x: x.reshape("batch", 2, 3).reshape(x.shape[0], -1))
    assert str(ok.trace(spec)).count("\"hexir.reshape\"") == 2
    with pytest.raises(TraceError, match=r"reshape: cannot reshape float32\[batch, 6\] to \[-1\]: a symbolic dimension "
                                         r"may only map to itself \(the same names in the same order"):
        hexir.jit(lambda x: x.reshape(-1)).trace(spec)
    with pytest.raises(TraceError, match=r"axis 0 of float32\[batch, 6\] is symbolic \(batch\): it can only be taken "
                                         r"whole"):
        hexir.jit(lambda x: x[1:]).trace(spec)
    with pytest.raises(TraceError, match=r"slice bounds must be static ints or None"):
        hexir.jit(lambda x: x[:, x:]).trace(spec)


@pytest.mark.parametrize("device", DEVICES)
def test_an_id_out_of_range_is_an_input_error_naming_the_input(device):
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    module = _module(lambda tokens: hexir.take(table, tokens.reshape(-1)),
                     [hexir.TensorSpec((2, 2), "int32")], device)
    np.testing.assert_array_equal(module.main(np.array([[3, 0], [1, 2]], np.int32)), table[[3, 0, 1, 2]])
    for bad in (4, -1, 2**31 - 1):
        with pytest.raises(InputError, match=rf"main\(\): input 'tokens' holds the id {bad} at \[1, 1\], out of "
                                             r"range for take_\d+'s table of 4 rows"):
            module.main(np.array([[3, 0], [1, bad]], np.int32))


# ---- the IR ---------------------------------------------------------------------------------------

def test_a_transpose_kernel_reads_the_input_at_the_permuted_index():
    text = """func.func @main(%x: tensor<2x3xf32>) -> tensor<3x2xf32> {
  %0 = "hexir.transpose"(%x) {device = "auto", expr = "{\\22kind\\22:\\22transpose\\22,\\22perm\\22:[1,0]}", operandSegmentSizes = array<i32: 1, 0, 0, 0, 0, 0, 0, 0>} : (tensor<2x3xf32>) -> tensor<3x2xf32>
  return %0 : tensor<3x2xf32>
}"""
    filecheck(lower(text, "mlir-tir", target=parse_target("cpu:x86-64-v4")), """
        CHECK:      func.func public @transpose_0(%[[X:.+]]: memref<2x3xf32>, %[[OUT:.+]]: memref<3x2xf32>)
        CHECK-SAME:   hextir.expr = "{\\22kind\\22:\\22transpose\\22,\\22perm\\22:[1,0]}"
        CHECK-SAME:   hextir.kernel = #hextir.kernel<"cpu", "layout">
        CHECK-SAME:   hextir.work = {extent = "3", grain = 8192 : i64}
        CHECK:        scf.for %[[I:.+]] = %{{.+}} to %{{.+}} step
        CHECK:          scf.for %[[J:.+]] = %{{.+}} to %{{.+}} step
        CHECK:            %[[V:.+]] = "hextir.load"(%[[X]], %[[J]], %[[I]])
        CHECK:            "hextir.store"(%[[V]], %[[OUT]], %[[I]], %[[J]])
        CHECK:          hextir.schedule = #hextir.loop<"serial", "">
        CHECK:        hextir.schedule = #hextir.loop<"parallel", "">
        CHECK:      "hexir.call"(%{{.+}}) {callee = @transpose_0, device = "cpu"
    """)


# ---- symbolic dims (h24-core: several symbols, anywhere) ----------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_symbolic_batch_and_seq_through_every_layout_op(device):
    table = np.random.default_rng(7).standard_normal((13, 16)).astype(np.float32)

    def heads(x, ids):  # one module for every size: heads split and merged, slices, concat, take
        batch, seq, _ = x.shape
        split = x.reshape(batch, seq, 4, 16).transpose(0, 2, 1, 3)              # [batch, 4, seq, 16]
        merged = split.transpose(0, 2, 1, 3).reshape(batch, seq, 64)
        return (split, merged, x.transpose(1, 0, 2), x[:, :, 8:24:2], x[..., -1], x[:, :, None, ::-1],
                hexir.concat([x, merged.reshape(batch, seq, -1)], axis=2), hexir.take(table, ids),
                ids.transpose(), x.reshape(batch, seq, 2, -1))
    module = _module(heads, [hexir.TensorSpec(("batch", "seq", 64), "float32"),
                             hexir.TensorSpec(("batch", "seq"), "int32")], device)
    reference = _module(heads, [hexir.TensorSpec(("batch", "seq", 64), "float32"),
                                hexir.TensorSpec(("batch", "seq"), "int32")], device, "reference")
    rng = np.random.default_rng(8)
    for batch, seq in [(2, 7), (1, 1), (3, 129), (0, 5), (2, 0)]:
        x = rng.standard_normal((batch, seq, 64)).astype(np.float32)
        ids = rng.integers(0, 13, (batch, seq)).astype(np.int32)
        split = x.reshape(batch, seq, 4, 16).transpose(0, 2, 1, 3)
        want = (split, x, x.transpose(1, 0, 2), x[:, :, 8:24:2], x[..., -1], x[:, :, None, ::-1],
                np.concatenate([x, x], axis=2), table[ids], ids.T, x.reshape(batch, seq, 2, 32))
        for got in (module.main(x, ids), reference.main(x, ids)):
            for g, w in zip(got, want, strict=True):
                assert g.shape == w.shape and g.dtype == w.dtype
                np.testing.assert_array_equal(g, w)
    bad = np.zeros((2, 3), np.int32)
    bad[1, 2] = 13
    with pytest.raises(InputError, match=r"input 'ids' holds the id 13 at \[1, 2\]"):
        module.main(np.zeros((2, 3, 64), np.float32), bad)


@pytest.mark.parametrize("function, message", [
    (lambda x: x.reshape(-1, 64), r"reshape: cannot reshape float32\[batch, seq, 64\] to \[-1, 64\]: a symbolic "
                                  r"dimension may only map to itself \(the same names in the same order; the static "
                                  r"dimensions between them regroup, and one -1 resolves inside such a group\); "
                                  r"merging or splitting symbols is not supported"),
    (lambda x: x.reshape(x.shape[1], x.shape[0], 64), r"cannot reshape float32\[batch, seq, 64\] to \[seq, batch, 64\]"),
    (lambda x: x.reshape(x.shape[0], x.shape[1], 3, -1), r"cannot reshape float32\[batch, seq, 64\] to "
                                                         r"\[batch, seq, 3, -1\]: the sizes cannot match"),
    (lambda x: hexir.concat([x, x], axis=1), r"concat: cannot concatenate float32\[batch, seq, 64\], "
                                             r"float32\[batch, seq, 64\] along axis 1: one rank, the other dimensions "
                                             r"equal, this one static"),
    (lambda x: x[:, 0], r"axis 1 of float32\[batch, seq, 64\] is symbolic \(seq\): it can only be taken whole"),
    (lambda x: hexir.take(x, x.argmax(axis=2)), r"take: table is float32\[batch, seq, 64\]; its first axis"),
], ids=["merge symbols", "swap symbols", "sizes", "concat symbolic axis", "index symbolic axis", "symbolic table"])
def test_symbolic_layout_errors(function, message):
    with pytest.raises(TraceError, match=message):
        hexir.jit(function).trace(hexir.TensorSpec(("batch", "seq", 64), "float32"))
