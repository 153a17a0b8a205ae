"""The traceable functions of the pointwise and reduce families, with numpy's and torch's
meanings: `pointwise(name, operands)` and `reduce(name, x, ...)` build any registered op, and
the public functions (`hexir.exp`, `hexir.softmax`, ...) and the Tensor operators call them.
Operands are tensors, numpy arrays (constants) and, for pointwise ops, Python numbers (folded
into the op's tree, in the tensor's dtype: numpy's "weak" scalars).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import numpy as np
from hexir_runtime.format import scalars

from hexir import ops
from hexir.dialects import hexir as hx
from hexir.errors import TraceError
from hexir.frontend.tensor import Tensor, TensorSpec, dtype_name
from hexir.frontend.trace import _build, _operand, current_device, user_where
from hexir.ops import scalar

Operand = Tensor | np.ndarray | float | int


def _number(value: object) -> float | None:
    """A Python or numpy number (or 0-d array) as a float; None for anything else."""
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "fiu":
        value = value.item()
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_)):
        return float(value)
    return None


def _float_tensor(op: str, name: str, value: object) -> Tensor:
    tensor = _operand(op, name, value)
    if tensor.dtype not in hx.DTYPES:
        raise TraceError(f"{op}: {name} is a {tensor.spec} tensor; {op} computes on "
                         "float32, float64, bfloat16 or float16 "
                         "(an argmax's int64 result is an index, not a value)")
    return tensor


def _emit(name: str, tensors: list[Tensor], shape: tuple, dtype: str, expr: object) -> Tensor:
    value = hx.compute(name, [t.value for t in tensors], hx.tensor_type(shape, dtype), current_device(),
                       json.dumps(expr, separators=(",", ":")))
    return Tensor(TensorSpec(shape, dtype), value)


def pointwise(name: str, operands: Sequence[object], **params: object) -> Tensor:
    """The registered pointwise op `name` on `operands` (broadcast as numpy does)."""
    definition = ops.REGISTRY[name]

    def build() -> Tensor:
        if len(operands) != definition.arity:
            raise TraceError(f"{name} takes {definition.arity} operand(s), got {len(operands)}")
        tensors: list[Tensor] = []
        args: list[scalars.Tree] = []
        for position, value in enumerate(operands):
            number = _number(value)
            if number is not None:
                if not math.isfinite(number):
                    raise TraceError(f"{name}: operand {position} is {number}; numbers in hexir ops must be finite")
                args.append(["const", number])
                continue
            tensor = _float_tensor(name, f"operand {position}", value)
            if tensor not in tensors:
                tensors.append(tensor)
            args.append(["arg", tensors.index(tensor)])
        if not tensors:
            raise TraceError(f"{name}: needs a tensor or a numpy array among its operands, got only numbers")
        shape = ops.pointwise_shape(name, [(t.shape, t.dtype) for t in tensors])
        return _emit(name, tensors, shape, tensors[0].dtype, scalars.substitute(definition.tree(**params), args))
    return _build(build)


def reduce(name: str, x: object, others: Sequence[object | None] = (), axis: int = -1, keepdims: bool = False,
           **params: object) -> Tensor:
    """The registered reduce op `name` over `axis` of `x` (`others`: its further operands, None
    for an absent optional one)."""
    definition = ops.REGISTRY[name]

    def build() -> Tensor:
        first = _float_tensor(name, "x", x)
        where = ops.normalize_axis(name, axis, first.ndim)
        if not isinstance(keepdims, bool):
            raise TraceError(f"{name}: keepdims must be True or False, got {keepdims!r}")
        tensors, args = [first], [scalar.Scalar.arg(0)]
        for operand_name, value in zip(definition.operands[1:], others, strict=False):
            if value is None:
                args.append(None)
                continue
            tensors.append(_float_tensor(name, operand_name.rstrip("?"), value))
            args.append(scalar.Scalar.arg(len(tensors) - 1))
        program = scalar.reduce_program(name, definition.function, args, where, **params)
        specs = [(t.shape, t.dtype) for t in tensors]
        shape = ops.reduce_shape(name, specs, program, keepdims)
        return _emit(name, tensors, shape, ops.result_dtype(program, first.dtype), program.to_json())
    return _build(build)


# ---- the public functions ---------------------------------------------------------------------

def _unary(name: str, doc: str):  # noqa: ANN202
    def function(x: Operand) -> Tensor:
        return pointwise(name, [x])
    function.__name__ = function.__qualname__ = name
    function.__doc__ = doc
    return function


exp = _unary("exp", "e ** x, element-wise.")
log = _unary("log", "The natural logarithm, element-wise (log(0) = -inf, log of a negative = nan).")
tanh = _unary("tanh", "The hyperbolic tangent, element-wise.")
sqrt = _unary("sqrt", "The square root, element-wise (nan below 0).")
rsqrt = _unary("rsqrt", "1 / sqrt(x), element-wise (torch.rsqrt).")
erf = _unary("erf", "The error function, element-wise.")
abs = _unary("abs", "|x|, element-wise.")  # noqa: A001 - numpy's and torch's name
sigmoid = _unary("sigmoid", "1 / (1 + exp(-x)), element-wise.")
silu = _unary("silu", "x * sigmoid(x), element-wise (torch.nn.functional.silu).")
relu = _unary("relu", "max(x, 0), element-wise.")


def cast(x: Operand, dtype: object) -> Tensor:
    """x as `dtype` (float32, float64, bfloat16, float16, their short names, or a numpy dtype),
    rounded to the nearest (even) as numpy's astype; a pointwise op, fused like the others (x's
    own dtype: x itself)."""
    def build() -> Tensor:
        tensor = _float_tensor("cast", "x", x)
        target = dtype_name("cast", dtype)
        if target not in hx.DTYPES:
            raise TraceError(f"cast: dtype must be float32, float64, bfloat16 or float16, got {target}")
        if target == tensor.dtype:
            return tensor
        return _emit("cast", [tensor], tensor.shape, target, ["arg", 0])
    return _build(build)


def maximum(a: Operand, b: Operand) -> Tensor:
    """The element-wise maximum of a and b, broadcast (numpy.maximum: nan if either is)."""
    return pointwise("maximum", [a, b])


def minimum(a: Operand, b: Operand) -> Tensor:
    """The element-wise minimum of a and b, broadcast (numpy.minimum: nan if either is)."""
    return pointwise("minimum", [a, b])


def gelu(x: Operand, approximate: str = "none") -> Tensor:
    """torch's gelu: x * Phi(x) (approximate="none"), or its tanh approximation ("tanh")."""
    if approximate not in ("none", "tanh"):
        raise TraceError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}", *user_where())
    return pointwise("gelu" if approximate == "none" else "gelu_tanh", [x])


def sum(x: Operand, axis: int = -1, keepdims: bool = False) -> Tensor:  # noqa: A001
    """The sum over `axis` (default: the last; numpy's and torch's meaning otherwise)."""
    return reduce("sum", x, axis=axis, keepdims=keepdims)


def mean(x: Operand, axis: int = -1, keepdims: bool = False) -> Tensor:
    """The mean over `axis`."""
    return reduce("mean", x, axis=axis, keepdims=keepdims)


def max(x: Operand, axis: int = -1, keepdims: bool = False) -> Tensor:  # noqa: A001
    """The largest element over `axis` (nan if any is: numpy's max). For two tensors: maximum."""
    if isinstance(axis, (Tensor, np.ndarray)):
        raise TraceError("max(x, axis) reduces one tensor over an axis; the element-wise maximum of two is "
                         "hexir.maximum(a, b)", *user_where())
    return reduce("max", x, axis=axis, keepdims=keepdims)


def argmax(x: Operand, axis: int = -1, keepdims: bool = False) -> Tensor:
    """The index of the first largest element over `axis`, as int64 (numpy's argmax)."""
    return reduce("argmax", x, axis=axis, keepdims=keepdims)


def softmax(x: Operand, axis: int = -1) -> Tensor:
    """exp(x - max) / sum(exp(x - max)) over `axis`, one kernel."""
    return reduce("softmax", x, axis=axis)


def log_softmax(x: Operand, axis: int = -1) -> Tensor:
    """x - max - log(sum(exp(x - max))) over `axis`, one kernel."""
    return reduce("log_softmax", x, axis=axis)


def layer_norm(x: Operand, weight: Operand | None = None, bias: Operand | None = None, eps: float = 1e-5) -> Tensor:
    """torch's layer_norm over the last axis: (x - mean) / sqrt(var + eps) * weight + bias,
    the variance biased; weight and bias (optional) have the last axis' length."""
    def check() -> None:
        first = _float_tensor("layer_norm", "x", x)
        for name, value in (("weight", weight), ("bias", bias)):
            if value is not None:
                spec = _operand("layer_norm", name, value).spec
                if spec.shape != (first.shape[-1],):
                    raise TraceError(f"layer_norm: {name} is {spec}, expected {first.dtype}[{first.shape[-1]}] "
                                     "(x's last axis)")
        if _number(eps) is None or not _number(eps) > 0 or not math.isfinite(_number(eps)):
            raise TraceError(f"layer_norm: eps must be a positive number, got {eps!r}")
        return first
    _build(check)
    return reduce("layer_norm", x, [weight, bias], axis=-1, eps=float(eps))
