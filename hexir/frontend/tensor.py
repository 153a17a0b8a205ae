"""Symbolic tensors: an abstract value (shape, dtype, device) plus the IR value it names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from mlir import ir

from hexir.errors import TraceError

#: Short dtype names, as `-spec` and MLIR spell them.
DTYPE_ALIASES = {"f32": "float32", "f64": "float64"}
#: What `None` in a shape stands for: the batch symbol.
BATCH = "batch"
#: The most bytes a tensor may have: its byte count must fit an int64.
MAX_BYTES = 2**63 - 1


@dataclass(frozen=True)
class TensorSpec:
    """The abstract value of a tensor: what a trace may depend on, and nothing else.

    `shape` holds non-negative ints; its leading extent may instead be symbolic: a name
    (`("batch", 784)`) or None (short for "batch"), a size known only when the module runs. The
    same name in two specs means the same size. `dtype` is float32 or float64 (or f32, f64).
    """

    shape: tuple[int | str, ...]
    dtype: str

    def __post_init__(self) -> None:
        if not isinstance(self.shape, (tuple, list)):
            raise TraceError(f"TensorSpec: shape must be a tuple of integers, got {self.shape!r}")
        shape = tuple(BATCH if d is None and i == 0 else d for i, d in enumerate(self.shape))
        for axis, d in enumerate(shape):
            symbolic = isinstance(d, str) and d.isidentifier() and d.isascii()
            if isinstance(d, str) and axis > 0:
                raise TraceError(f"TensorSpec: only the leading extent may be symbolic, got {self.shape!r}")
            if not symbolic and (isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0):
                raise TraceError(f"TensorSpec: shape must be non-negative integers (the first may be a name "
                                 f"or None), got {self.shape!r}")
        try:
            dtype = np.dtype(DTYPE_ALIASES.get(self.dtype, self.dtype)).name
        except TypeError as error:
            raise TraceError(f"TensorSpec: {self.dtype!r} is not a dtype") from error
        if dtype not in ("float32", "float64"):
            raise TraceError(f"TensorSpec: dtype must be float32 or float64, got {dtype}")
        static = [int(d) for d in shape if not isinstance(d, str)]
        count = np.dtype(dtype).itemsize
        for d in static:  # Python ints: no overflow while checking for it
            count *= d
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
            "compiled function runs; use hexir ops (hexir.linear, hexir.relu, hexir.print) instead",
            *user_where())

    def __bool__(self) -> bool:
        return self._concrete("bool()")

    def __float__(self) -> float:
        return self._concrete("float()")

    def __int__(self) -> int:
        return self._concrete("int()")

    def __index__(self) -> int:
        return self._concrete("indexing with a tensor")

    def __getitem__(self, key: Any) -> Any:
        return self._concrete("indexing")

    def __iter__(self) -> Any:
        return self._concrete("iteration")

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        return self._concrete("conversion to a numpy array (numpy functions on a tensor; use hexir.relu "
                              "for np.maximum(x, 0))")

    def _unsupported(self, what: str, hint: str) -> Any:
        from hexir.frontend.trace import user_where

        raise TraceError(f"{what} on a traced {self.spec} tensor is not a hexir op; {hint}", *user_where())

    def __matmul__(self, other: Any) -> Any:
        return self._unsupported("x @ w", "use hexir.linear(x, w)")

    __rmatmul__ = __matmul__

    def _arithmetic(self, other: Any) -> Any:
        return self._unsupported("arithmetic (+, -, *, /)", "hexir.linear(x, w, bias) adds a bias; other "
                                 "element-wise arithmetic is not supported (a custom kernel can do it)")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _arithmetic
    __neg__ = __abs__ = __pow__ = _arithmetic

    @property
    def T(self) -> Any:  # noqa: N802 - numpy's name
        return self._unsupported(".T", "hexir has no transpose: pass the weight already transposed")

    def reshape(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported(".reshape", "hexir has no reshape op")

    def transpose(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported(".transpose", "hexir has no transpose op")
