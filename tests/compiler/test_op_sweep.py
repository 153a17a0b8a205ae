"""Every registered op, on every device, alone and fused, f32, f64, bf16 and f16, on broadcast shapes,
against numpy: registering an op tests it (the cases are made from the registry).

Each op is compared with two meanings: its own tree evaluated by numpy (what the runtime's
reference device runs: `hexir_runtime.format.scalars`), and, for the built-in ops, an
independent numpy/math formula written here (torch's meanings: gelu, layer_norm, softmax).
"cuda" places every op on cuda (`placement="*=cuda"`): here, with no GPU, the module runs the
cuda kernels' cpu twins, and the cuda kernels themselves are compiled (CUBIN + PTX); on the
H200 the GPU suite (tests/gpu) runs them. The batch is symbolic, so one compile serves every
batch hypothesis draws."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hexir_runtime import load
from hexir_runtime.format import scalars
from hexir_runtime.format.families import compute_dtype
from hypothesis import given, settings
from hypothesis import strategies as st

import hexir
from hexir import ops
from hexir.driver import Options, parse_placement
from hexir.frontend.functions import pointwise, reduce
from hexir.jit import JitFunction
from hexir.target import parse_target

_erf = np.vectorize(math.erf, otypes=[np.float64])


def _softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _layer_norm(x, weight=None, bias=None, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    y = (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps)
    return y * (1 if weight is None else weight) + (0 if bias is None else bias)


#: What each built-in op means, written independently of its tree (numpy's and torch's meanings).
INDEPENDENT = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "maximum": np.maximum,
    "minimum": np.minimum, "neg": np.negative, "abs": np.abs, "relu": lambda x: np.maximum(x, 0), "exp": np.exp,
    "log": np.log, "tanh": np.tanh, "sqrt": np.sqrt, "rsqrt": lambda x: 1 / np.sqrt(x), "erf": _erf,
    "sigmoid": lambda x: 1 / (1 + np.exp(-x)), "silu": lambda x: x / (1 + np.exp(-x)),
    "gelu": lambda x: x * 0.5 * (1 + _erf(x / math.sqrt(2))),
    "gelu_tanh": lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))),
    "pow": lambda x, exponent: np.power(x, exponent),
    "sum": lambda x, axis: x.sum(axis), "mean": lambda x, axis: x.mean(axis), "max": lambda x, axis: x.max(axis),
    "argmax": lambda x, axis: x.argmax(axis), "softmax": _softmax,
    "log_softmax": lambda x, axis: np.log(_softmax(x.astype(np.float64), axis)),
    "layer_norm": lambda x, axis, weight=None, bias=None: _layer_norm(x, weight, bias),
}
POSITIVE = {"log", "sqrt", "rsqrt", "pow"}  # ops tested on positive inputs (their nan edges: test_ops.py)
PARAMS = {"pow": {"exponent": 3.0}}
# "B" is the symbolic batch: a row [6], a column [B, 1], equal shapes, an outer product
SHAPES = {1: [(("B", 6),)], 2: [(("B", 6), ("B", 6)), (("B", 6), (6,)), (("B", 6), ("B", 1)), (("B", 1), (1, 6))]}
#: 16-bit (#26): computed in float32 and rounded once to 16 bits: within one ulp (2^-7, 2^-10 relative)
TOLERANCE = {"float32": 2e-5, "float64": 1e-12, "bfloat16": 2**-7, "float16": 2**-10}
DTYPES = list(TOLERANCE)

POINTWISE = sorted(n for n, d in ops.REGISTRY.items() if d.family == "pointwise")
REDUCE = sorted(n for n, d in ops.REGISTRY.items() if d.family == "reduce")
DEVICES = ["cpu", "cuda"]


def _inputs(rng, shapes, dtype, positive, batch):
    arrays = []
    for shape in shapes:
        shape = tuple(batch if d == "B" else d for d in shape)
        value = rng.standard_normal(shape)
        arrays.append((np.abs(value) + 0.5 if positive else value).astype(dtype))
    return arrays


def _spec(shape, dtype):
    return hexir.TensorSpec(tuple("batch" if d == "B" else d for d in shape), dtype)


def _compile(function, specs, device):
    placement = "*=cuda" if device == "cuda" else None
    target = "cpu:host,cuda:sm_90" if device == "cuda" else "cpu:host"
    jitted = JitFunction(function, Options(placement=parse_placement(placement),
                                           target=parse_target(target)))
    return load(jitted.compile(*specs), "cpu")


def _check(got, expected, dtype):
    if np.asarray(expected).dtype.kind in "iu":
        np.testing.assert_array_equal(got, expected)
    else:
        np.testing.assert_allclose(got, np.asarray(expected, np.float64), rtol=TOLERANCE[dtype],
                                   atol=TOLERANCE[dtype])


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", POINTWISE)
def test_every_pointwise_op(name, device, dtype, fused):
    definition = ops.REGISTRY[name]
    params = PARAMS.get(name, {})

    def check(module, shapes):  # (a function of its own: it binds this iteration's module and shapes)
        @settings(max_examples=4, deadline=None, derandomize=True, database=None)
        @given(batch=st.integers(1, 9))
        def run(batch):
            rng = np.random.default_rng(batch)
            xs = _inputs(rng, shapes, dtype, name in POSITIVE, batch)
            ins = [(x.astype(np.float64) * 0.5 + 0.25) if fused else x.astype(np.float64) for x in xs]
            if fused and name in POSITIVE:
                ins = [np.abs(i) for i in ins]
            got = module.main(*xs)
            if name in INDEPENDENT:
                expected = INDEPENDENT[name](*ins, **params)
                _check(got, expected * 2.0 if fused else expected, dtype)
            tree = definition.tree(**params)
            wide = compute_dtype([dtype])  # (a 16-bit kernel's fused prologue stays in float32: not rounded)
            own = scalars.evaluate(tree, [i.astype(wide) for i in ins], wide)
            _check(got, own * 2.0 if fused else own, dtype)
        run()

    for shapes in SHAPES[definition.arity]:
        def body(*xs):
            xs = [x * 0.5 + 0.25 for x in xs] if fused else xs  # a pointwise prologue: one kernel with the op
            y = pointwise(name, xs, **params)
            return y * 2.0 if fused else y

        model = (lambda a: body(a)) if definition.arity == 1 else (lambda a, b: body(a, b))

        module = _compile(model, [_spec(s, dtype) for s in shapes], device)
        if fused and name in POSITIVE:
            continue  # (x * 0.5 + 0.25 may be negative: the positive ops are checked alone)
        check(module, shapes)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", REDUCE)
def test_every_reduce_op(name, device, dtype, fused):
    definition = ops.REGISTRY[name]
    rng = np.random.default_rng(7)
    extras = [rng.standard_normal(6).astype(dtype) for _ in definition.operands[1:]]
    def model_of(axis, keepdims):  # (a function of its own: the model binds this iteration's axis and keepdims)
        def model(x):
            x = x * 0.5 + 0.25 if fused else x  # a pointwise prologue, fused into the reduce kernel
            return reduce(name, x, extras, axis=axis, keepdims=keepdims)
        return model

    for axis in (-1, 1) if name != "layer_norm" else (-1,):
        for rank, keepdims in ((2, False), (3, True)):
            shape = (4, 6) if rank == 2 else (4, 5, 6)
            module = _compile(model_of(axis, keepdims), [_spec(("B", *shape[1:]), dtype)], device)
            for batch in (1, 3, 8):
                x = rng.standard_normal((batch, *shape[1:])).astype(dtype)
                x[0, ..., 0] = x[0, ..., 1]  # a tie: argmax takes the first
                got = module.main(x)
                inner = x.astype(compute_dtype([dtype])) * 0.5 + 0.25 if fused else x  # (as the kernel computes)
                expected = INDEPENDENT[name](inner.astype(np.float64), axis, *extras) \
                    if name in INDEPENDENT else None
                if expected is not None:
                    if keepdims and np.ndim(expected) < rank:
                        expected = np.expand_dims(expected, axis)
                    _check(got, expected, dtype)
