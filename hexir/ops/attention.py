"""attention: softmax(tree(q @ kᵀ, mask)) @ v in one op, made by fuse (passes/attention.py) from
the user's `softmax(q @ k.transpose(..) * scale + mask) @ v`; there is no call that traces it.

q[..., Sq, D], k[..., Sk, D] (k's rows: the transpose the user wrote is not made), v[..., Sk, Dv]
-> out[..., Sq, Dv], the leading (batch) axes broadcast as matmul's, D and Dv static. Its
epilogue (`hexir.epilogue`, as a matmul's) is the scores' tree over the product (arg 0) and an
optional mask (arg 1, broadcast to [..., Sq, Sk]): `a0 * 0.125 + a1`. The kernels
(schedules/cpu_attention.py, cuda_attention.py) walk the keys once with a running max and sum
per query row (an online softmax): no [Sq, Sk] buffer.

    %o = "hexir.attention"(%q, %k, %v, %mask) {hexir.epilogue = "a0 * 0.125 + a1"}
           : (tensor<2x4x7x16xf32>, tensor<2x4x9x16xf32>, tensor<2x4x9x16xf32>, tensor<7x9xf32>) -> tensor<2x4x7x16xf32>
"""

from __future__ import annotations

from hexir.dialects import hexir as hx
from hexir.errors import TraceError
from hexir.ops import Contract, broadcast, register
from hexir.schedules import cpu_attention, cuda_attention


def attention_shape(q: tuple, k: tuple, v: tuple) -> hx.Shape:
    """The result of attention on (shape, dtype) operands q, k, v. Raises TraceError."""
    shown = ", ".join(f"{name} is {hx.describe(*spec)}" for name, spec in (("q", q), ("k", k), ("v", v)))
    (qs, dtype), (ks, _), (vs, _) = q, k, v
    if len({q[1], k[1], v[1]}) != 1 or dtype not in hx.DTYPES or min(len(qs), len(ks), len(vs)) < 2 \
            or qs[-1] != ks[-1] or ks[-2] != vs[-2] or not all(isinstance(d, int) for d in (qs[-1], vs[-1])):
        raise TraceError(f"attention: expected q[..., Sq, D], k[..., Sk, D], v[..., Sk, Dv] of one float dtype, "
                         f"D and Dv static; {shown}")
    return (*broadcast("attention", [qs[:-2], ks[:-2], vs[:-2]]), qs[-2], vs[-1])


ATTENTION = register(Contract("attention", ("q", "k", "v"), attention_shape,
                              schedules={"cpu": cpu_attention.attention, "cuda": cuda_attention.attention},
                              epilogue_inputs=1))
