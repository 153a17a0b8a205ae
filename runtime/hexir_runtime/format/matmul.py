"""The `matmul` family's contract: numpy's a @ b between tensors (docs/hxb-format.md, "matmul").

args: a, b, the epilogue's inputs, out. a[..., M, K] @ b[..., K, N] -> out[..., M, N]: K the
same dimension in both, the leading (batch) dimensions broadcast as numpy's (aligned right; a 1
stretches; a symbol equals only the same symbol); a 1-D a is a row [1, K], a 1-D b a column
[K, 1], the 1 not in out. Each epilogue input broadcasts to out (families.py checks that).
"""

from __future__ import annotations

from .fields import _fail
from .types import Dim, TensorType


def check_matmul(args: tuple[TensorType, ...], path: str) -> None:
    """Refuse (naming `path`.args) a matmul whose a, b and out are not numpy's matmul shapes."""
    a, b, out = args[0].shape, args[1].shape, args[-1].shape
    expected = _result(a, b)
    if expected is None or out != expected:
        wanted = "" if expected is None else f" (here {list(expected)})"
        _fail(f"{path}.args", f"matmul expects a[..., M, K], b[..., K, N], the epilogue inputs, out[..., M, N]"
                              f"{wanted}: numpy's matmul shapes, got {', '.join(map(str, args))}")


def _result(a: tuple[Dim, ...], b: tuple[Dim, ...]) -> tuple[Dim, ...] | None:
    """numpy's matmul result of shapes a and b; None where it has none (or is a scalar)."""
    if not a or not b:
        return None
    rows = a if len(a) > 1 else (1, *a)
    columns = b if len(b) > 1 else (*b, 1)
    if rows[-1] != columns[-2]:
        return None
    left, right = rows[:-2], columns[:-2]
    rank = max(len(left), len(right))
    left, right = (1,) * (rank - len(left)) + left, (1,) * (rank - len(right)) + right
    batch = []
    for x, y in zip(left, right, strict=True):
        if x != y and 1 not in (x, y):
            return None
        batch.append(y if x == 1 else x)
    shape = (*batch, *a[-2:-1], *(b[-1:] if len(b) > 1 else ()))
    return shape or None
