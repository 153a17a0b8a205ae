"""The `attention` family's contract: softmax(tree(q @ kᵀ, mask)) @ v (docs/hxb-format.md,
"attention").

args: q[..., Sq, D], k[..., Sk, D], v[..., Sk, Dv], an optional mask, out[..., Sq, Dv]: D and
Dv static, the leading (batch) axes of q, k and v broadcast to out's as numpy's (aligned right;
a 1 stretches; a symbol equals only the same symbol), the mask broadcast to [..., Sq, Sk]. expr:
the scores' tree over the product (arg 0) and the mask (arg 1), finite constants; the softmax is
over the keys. q, k, v and out may be strided views of their buffers (check_view).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .fields import _dim, _fail, _int, _json, _list, _object
from .types import DTYPES, Dim, TensorType


@dataclass(frozen=True)
class StridedView(TensorType):
    """A buffer read (or written) as `shape`: index i of axis a lands on the buffer's axis
    axes[a][0] at i * axes[a][1], that axis counted from start[axis] (q[b, h, s, d] of a
    qkv[b, s, 3 * h * d]: axes (0, 1), (2, d), (1, 1), (2, 1), start (0, 0, 0 | h * d | 2 h d))."""

    axes: tuple[tuple[int, int], ...] = ()
    start: tuple[int, ...] = ()


def check_view(spec: Any, buffer: TensorType, path: str, written: bool) -> StridedView:
    """Refuse (naming `path`) a view that could reach past its buffer's axes whatever the
    symbols' sizes (an axis of a symbol is read whole from 0, by one axis of that symbol), or,
    `written`, that does not write each element of the buffer once."""
    view = _object(spec, path, ("shape", "axes", "start"))
    shape = tuple(_dim(d, f"{path}.shape[{i}]", True) for i, d in enumerate(_list(view["shape"], f"{path}.shape")))
    axes = [tuple(_int(n, f"{path}.axes[{i}][{j}]") for j, n in enumerate(_list(pair, f"{path}.axes[{i}]")))
            for i, pair in enumerate(_list(view["axes"], f"{path}.axes"))]
    start = tuple(_int(n, f"{path}.start[{j}]") for j, n in enumerate(_list(view["start"], f"{path}.start")))
    if len(axes) != len(shape) or len(start) != len(buffer.shape) or not shape \
            or any(len(a) != 2 or a[0] >= len(buffer.shape) for a in axes) or axes[-1] != (len(start) - 1, 1):
        _fail(path, f"expected an [axis, step] per axis of the shape (the last [{len(buffer.shape) - 1}, 1]) and a "
                    f"start per axis of the buffer {buffer}, got {_json(view['axes'])} for {list(shape)}, "
                    f"{_json(view['start'])}")
    for j, extent in enumerate(buffer.shape):
        mine = sorted(((c, n) for n, (a, c) in zip(shape, axes, strict=True) if a == j and n != 1), key=lambda m: m[0])
        reach = start[j] + sum((n - 1) * c for c, n in mine) if all(type(n) is int for _, n in mine) else None
        inside = mine in ([], [(1, extent)]) and not start[j] if isinstance(extent, str) else \
            reach is not None and (reach < extent or not all(n for _, n in mine))
        nested = inside and all(c2 >= c * n for (c, n), (c2, _) in zip(mine, mine[1:], strict=False))
        if not inside or written and not (nested and all(c for c, _ in mine)):
            _fail(f"{path}.axes", f"the view {list(shape)} {'writes twice to' if inside else 'reaches past'} axis "
                                  f"{j} of its buffer {buffer} (from {start[j]}, [step, extent]: "
                                  f"{[list(m) for m in mine]})")
    def count(dims: tuple[Dim, ...]) -> tuple:
        return math.prod(d for d in dims if type(d) is int), sorted(d for d in dims if type(d) is str)
    if written and count(shape) != count(buffer.shape):  # (no element twice, so then each once)
        _fail(f"{path}.shape", f"the view {list(shape)} leaves elements of its buffer {buffer} unwritten")
    return StridedView(shape, buffer.dtype, tuple(axes), start)


def misaligned_view(args: tuple[TensorType, ...], views: tuple[TensorType | None, ...]) -> str | None:
    """What makes a cuda attention kernel's strided view unfit for its 16-byte row copies (a
    row's start, the buffer's row length or a step along the buffer's rows not a multiple of 16
    bytes: the compiler folds no such view; a crafted module may), or None."""
    for j, (arg, view) in enumerate(zip(args, views, strict=True)):
        if isinstance(view, StridedView):
            last = len(arg.shape) - 1
            steps = [view.start[-1], arg.shape[-1], *(c for a, c in view.axes[:-1] if a == last)]
            if not all(type(n) is int and n * DTYPES[arg.dtype] % 16 == 0 for n in steps):
                return (f"args[{j}]: its view's rows do not all start on 16 bytes (start {list(view.start)}, "
                        f"[axis, step]s {[list(a) for a in view.axes]} of {arg}); the cuda kernel copies 16 at a time")
    return None


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
