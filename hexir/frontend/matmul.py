"""`hexir.matmul(a, b)` and `a @ b`: numpy's matmul between tensors (ops/matmul.py).

A 2-D constant on the right (a weight) goes to `hexir.linear`, whose kernels read it packed in
panels: `x @ W` is `hexir.linear(x, W)` for x[..., K] of rank >= 2. Anything else is a
`matmul` op.
"""

from __future__ import annotations

import numpy as np

from hexir import ops
from hexir.errors import TraceError
from hexir.frontend.tensor import Tensor
from hexir.frontend.trace import _apply, _build, _operand


def matmul(a: Tensor | np.ndarray, b: Tensor | np.ndarray) -> Tensor:
    """numpy's `a @ b`: a[..., M, K] @ b[..., K, N] -> [..., M, N], the leading dimensions
    broadcast; a 1-D a is a row and a 1-D b a column (that axis is not in the result). Either
    operand may be a numpy array (a constant)."""
    def build() -> Tensor:
        for name, value in (("a", a), ("b", b)):
            if not isinstance(value, (Tensor, np.ndarray)):
                raise TraceError(f"matmul: argument '{name}' must be a tensor or a numpy array, got "
                                 f"{type(value).__name__} (numpy's matmul refuses scalars too; to scale, use *)")
            if isinstance(value, np.ndarray) and value.ndim == 0:
                raise TraceError(f"matmul: argument '{name}' is a 0-d array; matmul takes tensors of rank >= 1")
        left, right = _operand("matmul", "a", a), _operand("matmul", "b", b)
        ops.REGISTRY["matmul"].shape((left.shape, left.dtype), (right.shape, right.dtype))  # its errors, first
        if isinstance(b, np.ndarray) and b.ndim == 2 and left.ndim >= 2:
            return _apply(ops.REGISTRY["linear"], [left, right])
        return _apply(ops.REGISTRY["matmul"], [left, right])
    return _build(build)
