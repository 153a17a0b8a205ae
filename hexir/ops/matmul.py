"""matmul: numpy's `a @ b` between two tensors (activations, or a constant on either side).

Shapes as numpy's matmul: a[..., M, K] @ b[..., K, N] -> [..., M, N], the leading (batch)
dimensions broadcast; a 1-D a is a row [1, K] and a 1-D b a column [K, 1], the 1 dropped from
the result. The kernels (schedules/cpu_matmul.py, cuda_matmul.py) read each operand at its own
batch index (an axis of extent 1 read at 0), so no operand is ever copied or reshaped. Like
linear, a matmul takes an epilogue: a pointwise tree over its product and up to four more
tensors broadcast to its result (`(q @ kT) * scale + mask`, one kernel), fused in by fuse.py.

    %s = "hexir.matmul"(%q, %kt) : (tensor<2x4x7x16xf32>, tensor<2x4x16x7xf32>) -> tensor<2x4x7x7xf32>
"""

from __future__ import annotations

from hexir.dialects import hexir as hx
from hexir.errors import TraceError
from hexir.ops import Contract, broadcast, register
from hexir.schedules import cpu_matmul, cuda_matmul


def matmul_shape(a: tuple, b: tuple) -> hx.Shape:
    """Result shape of matmul; each operand is (shape, dtype). Raises TraceError."""
    (a_shape, a_dtype), (b_shape, b_dtype) = a, b
    both = f"a is {hx.describe(a_shape, a_dtype)} and b is {hx.describe(b_shape, b_dtype)}"
    for name, (shape, dtype) in (("a", a), ("b", b)):
        hx.check_dtype("matmul", name, dtype)
        if not shape:
            raise TraceError(f"matmul: argument '{name}' is a scalar ({hx.describe(shape, dtype)}); matmul takes "
                             "tensors of rank >= 1 (to scale by a number, use *)")
    if a_dtype != b_dtype:
        raise TraceError(f"matmul: mixed dtypes: {both}; cast one (numpy: .astype) so both are {a_dtype} or {b_dtype}")
    rows = a_shape if len(a_shape) > 1 else (1, *a_shape)      # numpy: a 1-D a is a row,
    columns = b_shape if len(b_shape) > 1 else (*b_shape, 1)   # a 1-D b a column
    if rows[-1] != columns[-2]:
        where = "its only axis" if len(b_shape) == 1 else "axis -2"
        raise TraceError(f"matmul: inner dimensions differ: {both}; a's last axis ({rows[-1]}) must equal b's "
                         f"{where} ({columns[-2]})")
    try:
        batch = broadcast("matmul", [rows[:-2], columns[:-2]])
    except TraceError:
        raise TraceError(f"matmul: the batch dimensions do not broadcast: {both} (numpy's rules on "
                         f"[{', '.join(map(str, rows[:-2]))}] and [{', '.join(map(str, columns[:-2]))}])") from None
    shape = (*batch, *a_shape[-2:-1], *(b_shape[-1:] if len(b_shape) > 1 else ()))
    if not shape:
        raise TraceError(f"matmul: {both}: the product of two vectors is a scalar, and hexir tensors have rank "
                         ">= 1; write hexir.sum(a * b, keepdims=True)")
    for name, (operand, dtype) in (("a", a), ("b", b)):
        hx.check_extents("matmul", name, operand, dtype)
    hx.check_extents("matmul", "result", shape, a_dtype)
    return shape


MATMUL = register(Contract("matmul", ("a", "b"), matmul_shape,
                           schedules={"cpu": cpu_matmul.matmul, "cuda": cuda_matmul.matmul}, epilogue_inputs=4))
