"""Symbolic tensors: an abstract value (shape, dtype, device) plus the IR value it names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from mlir import ir

from hexir.errors import TraceError


@dataclass(frozen=True)
class TensorSpec:
    """The abstract value of a tensor: what a trace may depend on, and nothing else."""

    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if not isinstance(self.shape, (tuple, list)):
            raise TraceError(f"TensorSpec: shape must be a tuple of integers, got {self.shape!r}")
        shape = tuple(self.shape)
        if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise TraceError(f"TensorSpec: shape must be non-negative integers, got {self.shape!r}")
        try:
            dtype = np.dtype(self.dtype).name
        except TypeError as error:
            raise TraceError(f"TensorSpec: {self.dtype!r} is not a dtype") from error
        if dtype not in ("float32", "float64"):
            raise TraceError(f"TensorSpec: dtype must be float32 or float64, got {dtype}")
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))
        object.__setattr__(self, "dtype", dtype)

    @classmethod
    def of(cls, array: np.ndarray) -> TensorSpec:
        return cls(array.shape, array.dtype.name)

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"


@dataclass(frozen=True, eq=False)
class Tensor:
    """A value inside a traced function. It has a shape and a dtype but no numbers:
    anything that needs the numbers (bool, float, indexing, numpy) is an error."""

    spec: TensorSpec
    value: ir.Value

    @property
    def shape(self) -> tuple[int, ...]:
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
        return self._concrete("conversion to a numpy array")
