"""The `attention` family's contract: softmax(tree(q @ kᵀ, mask)) @ v (docs/hxb-format.md,
"attention").

args: q[..., Sq, D], k[..., Sk, D], v[..., Sk, Dv], an optional mask, out[..., Sq, Dv]: D and
Dv static, the leading (batch) axes of q, k and v broadcast to out's as numpy's (aligned right;
a 1 stretches; a symbol equals only the same symbol), the mask broadcast to [..., Sq, Sk]. expr:
the scores' tree over the product (arg 0) and the mask (arg 1), finite constants; the softmax is
over the keys.
"""

from __future__ import annotations

from .fields import _fail
from .types import Dim, TensorType


def check_attention(args: tuple[TensorType, ...], path: str, broadcasts) -> tuple[Dim, ...]:
    """Refuse (naming `path`.args) attention args that are not q, k, v, mask?, out as above;
    return the scores' shape [..., Sq, Sk] (`broadcasts(shape, target)` is numpy's rule)."""
    if len(args) not in (4, 5):
        _fail(f"{path}.args", f"attention takes q, k, v, an optional mask, then out: 4 or 5 args, got {len(args)}")
    q, k, v, out = (a.shape for a in (*args[:3], args[-1]))
    ok = min(len(q), len(k), len(v), len(out)) >= 2 and q[-1] == k[-1] and k[-2] == v[-2] \
        and all(type(d) is int for d in (q[-1], v[-1])) and out[-2:] == (q[-2], v[-1])
    ok = ok and all(broadcasts(shape[:-2], out[:-2]) for shape in (q, k, v)) and len(out) == 2 + max(
        len(q), len(k), len(v)) - 2
    if not ok:
        _fail(f"{path}.args", "attention expects q[..., Sq, D], k[..., Sk, D], v[..., Sk, Dv] (D, Dv static, the "
                              "batch axes broadcast), the mask, out[..., Sq, Dv], got "
                              f"{', '.join(map(str, args))}")
    scores = (*out[:-2], q[-2], k[-2])
    if len(args) == 5 and not broadcasts(args[3].shape, scores):
        _fail(f"{path}.args[3].shape", f"the mask {list(args[3].shape)} does not broadcast to the scores' "
                                       f"{list(scores)}")
    return scores
