"""Every built-in op, one definition each (the families: `hexir/ops/__init__.py`).

To add an element-wise op: `register(Pointwise("name", lambda x: ...))`; a reduction over an
axis: `register(Reduce("name", lambda x: ... row_sum(...) ...))`. Each becomes `hexir.<name>`
in the dialect; `hexir/frontend/functions.py` gives it its public function.
"""

from __future__ import annotations

import math

from hexir.dialects import hexir as hx
from hexir.errors import TraceError
from hexir.ops import Contract, Layout, Pointwise, Reduce, register
from hexir.ops.scalar import (
    Scalar,
    erf,
    exp,
    log,
    maximum,
    minimum,
    row_argmax,
    row_length,
    row_max,
    row_sum,
    rsqrt,
    sqrt,
    tanh,
)
from hexir.schedules import cpu_matmul, cuda, cuda_tiles

SQRT1_2 = 1 / math.sqrt(2)
SQRT_2_PI = math.sqrt(2 / math.pi)


def linear_shape(x: tuple, w: tuple, bias: tuple | None = None) -> hx.Shape:
    """Result shape of linear; each operand is (shape, dtype). Raises TraceError."""
    (x_shape, x_dtype), (w_shape, w_dtype) = x, w
    for name, (shape, dtype) in (("x", x), ("w", w)):
        hx.check_dtype("linear", name, dtype)
        if len(shape) != 2 and (name == "w" or not shape):
            raise TraceError(f"linear: argument '{name}' must have rank {2 if name == 'w' else '>= 1'}, got rank "
                             f"{len(shape)} ({hx.describe(shape, dtype)})")
        hx.check_extents("linear", name, shape, dtype, static=name == "w")
    if w_dtype != x_dtype:
        raise TraceError(f"linear: mixed dtypes: x is {x_dtype} but w is {w_dtype}")
    if x_shape[-1] != w_shape[0]:
        raise TraceError(
            f"linear: inner dimensions differ: x is {hx.describe(x_shape, x_dtype)} and w is "
            f"{hx.describe(w_shape, w_dtype)}; expected w to have {x_shape[-1]} rows, got {w_shape[0]}")
    if bias is not None:
        b_shape, b_dtype = bias
        if b_dtype != x_dtype:
            raise TraceError(f"linear: mixed dtypes: x is {x_dtype} but bias is {b_dtype}")
        hx.check_extents("linear", "bias", b_shape, b_dtype, static=True)
        if tuple(b_shape) != (w_shape[1],):
            raise TraceError(f"linear: argument 'bias' must be {hx.describe((w_shape[1],), x_dtype)}, "
                             f"got {hx.describe(b_shape, b_dtype)}")
    return (*x_shape[:-1], w_shape[1])


register(Contract("linear", ("x", "w", "bias?"), linear_shape,
                  schedules={"cpu": cpu_matmul.linear, "cuda": cuda.linear},
                  variants={"cuda": cuda_tiles.linear_variants}, epilogue_inputs=4, weights=True, rows=True))

# ---- pointwise ------------------------------------------------------------------------------
for _name, _function in {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b, "div": lambda a, b: a / b,
    "maximum": maximum, "minimum": minimum, "neg": lambda x: -x, "abs": abs,
    "relu": lambda x: maximum(x, 0), "exp": exp, "log": log, "tanh": tanh, "sqrt": sqrt, "rsqrt": rsqrt,
    "erf": erf, "sigmoid": lambda x: 1 / (1 + exp(-x)), "silu": lambda x: x / (1 + exp(-x)),
    "gelu": lambda x: 0.5 * x * (1 + erf(x * SQRT1_2)),                                 # torch's exact gelu
    "gelu_tanh": lambda x: 0.5 * x * (1 + tanh(SQRT_2_PI * (x + 0.044715 * x * x * x))),  # approximate="tanh"
}.items():
    register(Pointwise(_name, _function))


register(Pointwise("pow", lambda x, exponent: x ** exponent, arity=1))  # x ** a number
register(Pointwise("cast", lambda x: x))  # its result's dtype is the call's (functions.cast): x converted


# ---- reductions over one axis -------------------------------------------------------------------

def _softmax(x: Scalar) -> Scalar:
    shifted = exp(x - row_max(x))
    return shifted / row_sum(shifted)


def _log_softmax(x: Scalar) -> Scalar:
    top = row_max(x)
    return x - top - log(row_sum(exp(x - top)))


def _layer_norm(x: Scalar, weight: Scalar | None = None, bias: Scalar | None = None, eps: float = 1e-5) -> Scalar:
    mean = row_sum(x) / row_length()
    centred = x - mean
    variance = row_sum(centred * centred) / row_length()  # torch's: biased, two passes
    y = centred * rsqrt(variance + eps)
    y = y if weight is None else y * weight
    return y if bias is None else y + bias


for _reduce in (Reduce("sum", row_sum), Reduce("mean", lambda x: row_sum(x) / row_length()),
                Reduce("max", row_max), Reduce("argmax", row_argmax), Reduce("softmax", _softmax),
                Reduce("log_softmax", _log_softmax), Reduce("layer_norm", _layer_norm, ("x", "weight?", "bias?"))):
    register(_reduce)


# ---- layout: moving elements (records and rules: hexir_runtime/format/layouts.py) ---------------
for _layout in (Layout("transpose"), Layout("reshape"), Layout("slice"), Layout("concat", ("x0", "x1")),
                Layout("take", ("table", "ids"))):
    register(_layout)
from hexir.ops import matmul  # noqa: E402,F401 - a @ b between tensors: its own file
