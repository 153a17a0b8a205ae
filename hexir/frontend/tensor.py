"""Symbolic tensors: an abstract value (shape, dtype, device) plus the IR value it names."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ml_dtypes  # noqa: F401 - gives numpy the name "bfloat16"
import numpy as np
from mlir import ir

from hexir.errors import TraceError

#: Short dtype names, as `-spec` and MLIR spell them.
DTYPE_ALIASES = {"f32": "float32", "f64": "float64", "bf16": "bfloat16", "f16": "float16", "i32": "int32",
                 "i64": "int64"}
#: What a tensor may hold: floats, and int32/int64 (token ids, an argmax's result).
DTYPES = ("float32", "float64", "bfloat16", "float16", "int32", "int64")
#: What `None` in a shape stands for: the batch symbol.
BATCH = "batch"
#: The most bytes a tensor may have: its byte count must fit an int64.
MAX_BYTES = 2**63 - 1


def dtype_name(op: str, dtype: Any) -> str:
    """numpy's name of `dtype`: a name or short name ("bf16"), a numpy dtype or type."""
    try:
        return np.dtype(DTYPE_ALIASES.get(dtype, dtype) if isinstance(dtype, str) else dtype).name
    except TypeError:
        raise TraceError(f"{op}: {dtype!r} is not a dtype") from None


@dataclass(frozen=True)
class TensorSpec:
    """The abstract value of a tensor: what a trace may depend on, and nothing else.

    `shape` holds non-negative ints and names: a name (`("batch", "seq", 64)`) is a size known
    only when the module runs, any axis may have one, and the same name in two places means the
    same size (checked per call). None as the leading extent is short for "batch". `dtype` is
    float32, float64, bfloat16 or float16 (or f32, f64, bf16, f16: 16-bit ones are computed in
    float32 and stored in 16 bits, as torch does), or int32 / int64 (i32, i64: ids, which take and the layout
    ops use; int64 is also an argmax's result).
    """

    shape: tuple[int | str, ...]
    dtype: str

    def __post_init__(self) -> None:
        if not isinstance(self.shape, (tuple, list)):
            raise TraceError(f"TensorSpec: shape must be a tuple of integers, got {self.shape!r}")
        shape = tuple(BATCH if d is None and i == 0 else d for i, d in enumerate(self.shape))
        for d in shape:
            symbolic = isinstance(d, str) and d.isidentifier() and d.isascii()
            if not symbolic and (isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0):
                raise TraceError(f"TensorSpec: shape must be non-negative integers or names (identifiers; "
                                 f"the first may be None), got {self.shape!r}")
        dtype = dtype_name("TensorSpec", self.dtype)
        if dtype not in DTYPES:
            raise TraceError(f"TensorSpec: dtype must be float32, float64, bfloat16 or float16 (or int32, int64), "
                             f"got {dtype}")
        static = [int(d) for d in shape if not isinstance(d, str)]
        count = np.dtype(dtype).itemsize * math.prod(static)  # Python ints: no overflow while checking for it
        if count > MAX_BYTES or any(d >= 2**63 for d in static):
            raise TraceError(f"TensorSpec: a {dtype} tensor of shape {self.shape!r} has more than 2^63 bytes")
        object.__setattr__(self, "shape", tuple(d if isinstance(d, str) else int(d) for d in shape))
        object.__setattr__(self, "dtype", dtype)

    @classmethod
    def of(cls, array: np.ndarray) -> TensorSpec:
        return cls(array.shape, array.dtype.name)

    @property
    def symbolic(self) -> bool:
        return any(isinstance(d, str) for d in self.shape)

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"


def _operators(name: str) -> tuple[Callable[..., Tensor], Callable[..., Tensor]]:
    """A Tensor's `x <op> other` and reflected `other <op> x`: the pointwise op `name`."""
    def forward(self: Tensor, other: Any) -> Tensor:
        return self._op(name, self, other)

    def reflected(self: Tensor, other: Any) -> Tensor:
        return self._op(name, other, self)
    return forward, reflected


@dataclass(frozen=True, eq=False)
class Tensor:
    """A value inside a traced function. It has a shape and a dtype but no numbers:
    anything that needs the numbers (bool, float, indexing, numpy) is an error."""

    spec: TensorSpec
    value: ir.Value

    @property
    def shape(self) -> tuple[int | str, ...]:
        return self.spec.shape

    @property
    def dtype(self) -> str:
        return self.spec.dtype

    @property
    def ndim(self) -> int:
        return len(self.spec.shape)

    def __repr__(self) -> str:
        return f"Tensor({self.spec})"

    def _concrete(self, what: str) -> Any:
        from hexir.frontend.trace import user_where  # trace imports this module

        raise TraceError(
            f"{what} needs the values of a traced {self.spec} tensor, which exist only when the "
            "compiled function runs; use hexir ops (docs/api.md) instead",
            *user_where())

    def __bool__(self) -> bool:
        return self._concrete("bool()")

    def __float__(self) -> float:
        return self._concrete("float()")

    def __int__(self) -> int:
        return self._concrete("int()")

    def __index__(self) -> int:
        return self._concrete("indexing with a tensor")

    def __getitem__(self, key: Any) -> Tensor:
        """numpy's basic indexing: ints, slices of static bounds, `...`, None (hexir/frontend/layout.py)."""
        from hexir.frontend.layout import getitem

        return getitem(self, key)

    def __iter__(self) -> Any:
        return self._concrete("iteration")

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        return self._concrete("conversion to a numpy array (np.asarray of a tensor)")

    def _unsupported(self, what: str, hint: str) -> Any:
        from hexir.frontend.trace import user_where

        raise TraceError(f"{what} on a traced {self.spec} tensor is not a hexir op; {hint}", *user_where())

    def __matmul__(self, other: Any) -> Tensor:
        from hexir.frontend.matmul import matmul

        return matmul(self, other)

    def __rmatmul__(self, other: Any) -> Tensor:
        from hexir.frontend.matmul import matmul

        return matmul(other, self)

    # ---- arithmetic: pointwise ops, numpy's broadcasting, numbers in the tensor's dtype ----
    def _op(self, name: str, *operands: Any, **params: Any) -> Tensor:
        from hexir.frontend.functions import pointwise

        return pointwise(name, operands, **params)

    __add__, __radd__ = _operators("add")
    __sub__, __rsub__ = _operators("sub")
    __mul__, __rmul__ = _operators("mul")
    __truediv__, __rtruediv__ = _operators("div")

    def __neg__(self) -> Tensor:
        return self._op("neg", self)

    def __pos__(self) -> Tensor:
        return self

    def __abs__(self) -> Tensor:
        return self._op("abs", self)

    def __pow__(self, exponent: Any) -> Tensor:
        from hexir.frontend.functions import _number

        number = _number(exponent)
        if number is None or number != number or abs(number) == float("inf"):
            return self._unsupported("** with a non-number exponent", "the exponent must be a finite number")
        return self._op("pow", self, exponent=number)

    def __rpow__(self, base: Any) -> Any:
        return self._unsupported("number ** tensor", "write hexir.exp(x * math.log(base))")

    # ---- reductions as methods ----
    def sum(self, axis: int = -1, keepdims: bool = False) -> Tensor:
        """hexir.sum(self, axis, keepdims)."""
        from hexir.frontend.functions import reduce

        return reduce("sum", self, axis=axis, keepdims=keepdims)

    def mean(self, axis: int = -1, keepdims: bool = False) -> Tensor:
        """hexir.mean(self, axis, keepdims)."""
        from hexir.frontend.functions import reduce

        return reduce("mean", self, axis=axis, keepdims=keepdims)

    def max(self, axis: int = -1, keepdims: bool = False) -> Tensor:
        """hexir.max(self, axis, keepdims)."""
        from hexir.frontend.functions import reduce

        return reduce("max", self, axis=axis, keepdims=keepdims)

    def astype(self, dtype: Any) -> Tensor:
        """hexir.cast(self, dtype): numpy's astype between float dtypes."""
        from hexir.frontend.functions import cast

        return cast(self, dtype)

    def argmax(self, axis: int = -1, keepdims: bool = False) -> Tensor:
        """hexir.argmax(self, axis, keepdims): int64 indices."""
        from hexir.frontend.functions import reduce

        return reduce("argmax", self, axis=axis, keepdims=keepdims)

    # ---- numpy on a tensor: its element-wise ufuncs are hexir ops; the rest is an error here ----
    _UFUNCS = {"add": "add", "subtract": "sub", "multiply": "mul", "divide": "div", "true_divide": "div",
               "negative": "neg", "absolute": "abs", "exp": "exp", "log": "log", "tanh": "tanh", "sqrt": "sqrt",
               "maximum": "maximum", "minimum": "minimum"}

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if ufunc is np.matmul and method == "__call__" and not kwargs:  # array @ tensor
            from hexir.frontend.matmul import matmul

            return matmul(*inputs)
        name = self._UFUNCS.get(ufunc.__name__)
        if method != "__call__" or kwargs or name is None:
            hint = f"hexir.{name}(...)" if name else "use hexir ops (docs/api.md lists them)"
            return self._unsupported(f"np.{ufunc.__name__}{'.' + method if method != '__call__' else ''}"
                                     f"{' with ' + ', '.join(kwargs) if kwargs else ''}", hint)
        return self._op(name, *inputs)

    def __array_function__(self, function: Any, types: Any, args: Any, kwargs: Any) -> Any:
        name = function.__name__
        hint = f"use hexir.{name}(x, axis=...) or x.{name}(...)" if name in ("sum", "mean", "max", "argmax") \
            else "use hexir ops (docs/api.md lists them)"
        return self._unsupported(f"np.{name}", hint)

    @property
    def T(self) -> Tensor:  # noqa: N802 - numpy's name
        """The transpose of a 2-D tensor (x.transpose(...) for other ranks)."""
        if self.ndim != 2:
            return self._unsupported(f".T of rank {self.ndim}", "x.T is for 2-D tensors; use x.transpose(*axes)")
        return self.transpose()

    def reshape(self, *shape: Any) -> Tensor:
        """hexir.reshape(self, shape): ints, symbol names, one -1."""
        from hexir.frontend.layout import reshape

        return reshape(self, *shape)

    def transpose(self, *axes: Any) -> Tensor:
        """hexir.transpose(self, axes) (no axes: reversed)."""
        from hexir.frontend.layout import transpose

        return transpose(self, *axes)
