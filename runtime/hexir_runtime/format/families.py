"""The family contracts of generated kernels: for each op the runtime knows, the args it takes
(their shapes, by numpy's broadcasting, and dtypes) and what its `expr` must be. A kernel is
checked by its family, never by its name: a gelu, a bias add and a softmax are `pointwise`,
`linear` and `reduce` kernels whose `expr` (scalars.py) says what they compute.

| op              | args (destination last)                    | expr |
|-----------------|--------------------------------------------|------|
| `linear`        | x[..., K], w[K, N], epilogue inputs, out[..., N] | a tree: a0 = x @ w, a1... the epilogue inputs |
| `linear_panels` | x[..., K], w[P, K, L], epilogue inputs, out[..., N] | as linear |
| `linear_t`      | x[..., K], w[N, K] (w transposed), epilogue inputs, out[..., N] | as linear |
| `matmul`        | a[..., M, K], b[..., K, N], epilogue inputs, out[..., M, N] (matmul.py) | as linear |
| `attention`     | q[..., Sq, D], k[..., Sk, D], v[..., Sk, Dv], mask?, out[..., Sq, Dv] | a0 = q . k, a1 the mask |
| `pack_panels`   | w[K, N], out[P, K, L]                      | none |
| `pointwise`     | n >= 1 inputs, out: their broadcast shape  | a tree over the n inputs |
| `reduce`        | x[S], inputs broadcasting to S, out        | a program (rows: S without its axis, or it as 1) |
| `layout`        | inputs, out (layouts.py)                   | a record: transpose, reshape, slice, concat, take |

Every input broadcasts to the output as numpy does (aligned right; a 1 stretches; a symbol
equals only the same symbol). Floats: float32, float64, bfloat16, float16. A contract's args
have one dtype; a pointwise or reduce kernel's may differ (a cast, fused casts): it computes
in `compute_dtype` of them all (float64 if one is, else float32) and converts its output (a
reduce's argmax output is int64). A layout kernel moves any dtype (and int32, int64; layouts.py).
"""

from __future__ import annotations

from typing import Any

from . import layouts, scalars
from .attention import check_attention
from .fields import _choice, _fail, _json, _tensor
from .matmul import check_matmul
from .types import Dim, TensorType

FAMILIES = ("linear", "linear_panels", "linear_t", "matmul", "attention", "pack_panels", "pointwise", "reduce",
            "layout")
FLOATS = ("float32", "float64", "bfloat16", "float16")


def compute_dtype(dtypes: Any) -> str:
    """What a pointwise or reduce kernel over args of `dtypes` computes in: float64 if any is,
    else float32 (16-bit floats are widened, then the output is converted to its own dtype)."""
    return "float64" if "float64" in dtypes else "float32"


def check_args(op: str, specs: list[Any], path: str) -> tuple[TensorType, ...]:
    """A kernel's args: their types and access (every one read but the last, written). `path` is
    the kernel's."""
    args = tuple(_tensor(arg, f"{path}.args[{j}]", ("access",)) for j, arg in enumerate(specs))
    for j, arg in enumerate(specs):
        _choice(arg["access"], f"{path}.args[{j}].access", ("write",) if j == len(args) - 1 else ("read",))
    if op == "custom":  # any shapes; float32 and float64 may mix
        if not 2 <= len(args) <= 5:
            _fail(f"{path}.args", f"custom takes 2 to 5 args (1 to 4 inputs, then out), got {len(args)}")
        for j, arg in enumerate(args):
            _choice(arg.dtype, f"{path}.args[{j}].dtype", FLOATS[:2])  # (float, double)
    return args


def check_family(op: str, args: tuple[TensorType, ...], kernel: dict[str, Any], path: str) -> Any:
    """Check a generated kernel's args and `expr` against its family's contract (`op` is one of
    FAMILIES); return its meaning: a tree, a `scalars.Program` (reduce) or None (pack_panels)."""
    if op == "pack_panels":
        if "expr" in kernel:
            _fail(f"{path}.expr", "pack_panels has none (it only lays w out as linear_panels reads it)")
    elif "expr" not in kernel:
        _fail(f"{path}.expr", f"missing (a {op} kernel says what it computes in it)")
    minimum = 3 if op.startswith("linear") or op == "matmul" else 4 if op == "attention" else 2
    if op == "layout":
        if len(args) < minimum:
            _fail(f"{path}.args", f"layout takes at least {minimum} args, got {len(args)}")
        return layouts.check(kernel["expr"], args, f"{path}.expr")
    if len(args) < minimum:
        _fail(f"{path}.args", f"{op} takes at least {minimum} args, got {len(args)}")
    program = scalars.check_program(kernel["expr"], f"{path}.expr", len(args) - 1, len(args[0].shape)) \
        if op == "reduce" else None
    argmax = program is not None and any(kind == "argmax" for kind, _ in program.reductions)
    for j, arg in enumerate(args):
        where = f"{path}.args[{j}].dtype"
        if argmax and j == len(args) - 1:
            if arg.dtype != "int64":
                _fail(where, f"an argmax's output is int64, got {arg.dtype!r}")
        elif arg.dtype not in FLOATS:
            _fail(where, f"expected one of {', '.join(FLOATS)} (int64 is only a reduce's argmax output), "
                         f"got {arg.dtype!r}")
        elif arg.dtype != args[0].dtype and op not in ("pointwise", "reduce"):  # (those: compute_dtype)
            _fail(where, f"expected {args[0].dtype} like args[0], got {arg.dtype!r}")
    shapes, out = [arg.shape for arg in args], args[-1].shape
    if op == "pack_panels":
        w, packed = shapes[0], out
        if len(args) != 2 or not (len(w) == 2 and len(packed) == 3 and all(type(d) is int for d in (*w, *packed))
                                  and packed[1] == w[0] and packed[2] > 0 and packed[0] == -(-w[1] // packed[2])):
            _fail(f"{path}.args", f"pack_panels expects w[K, N], out[P, K, L] (P = ceil(N / L)), all static; got "
                                  f"{', '.join(map(str, args))}")
        return None
    if op == "attention":
        check_attention(args, path, broadcasts)
        return scalars.check(kernel["expr"], f"{path}.expr", len(args) - 3)
    if op in ("linear", "linear_panels", "linear_t", "matmul"):
        _check_broadcasts(args, range(2, len(args) - 1), out, path)
        if op == "matmul":
            check_matmul(args, path)
        else:
            _check_linear(op, args, path)
        return scalars.check(kernel["expr"], f"{path}.expr", len(args) - 2)
    if op == "pointwise":
        _check_broadcasts(args, range(len(args) - 1), out, path)
        broadcast = _broadcast(shapes[:-1])
        if out != broadcast:
            _fail(f"{path}.args[{len(args) - 1}].shape", f"expected the inputs' broadcast shape "
                                                         f"{_json(list(broadcast))}, got {_json(list(out))}")
        return scalars.check(kernel["expr"], f"{path}.expr", len(args) - 1)
    full = shapes[0]  # reduce
    _check_broadcasts(args, range(1, len(args) - 1), full, path, "args[0]'s shape")
    axis = program.axis
    allowed = [full[:axis] + full[axis + 1:], full[:axis] + (1,) + full[axis + 1:]] if program.rows else [full]
    if out not in allowed:
        wanted = " or ".join(_json(list(shape)) for shape in allowed)
        what = f"one per row over axis {axis}" if program.rows else "one per element of args[0]"
        _fail(f"{path}.args[{len(args) - 1}].shape", f"the program's output is {what}: expected {wanted}, "
                                                     f"got {_json(list(out))}")
    return program


def _check_linear(op: str, args: tuple[TensorType, ...], path: str) -> None:
    """x[..., K], w[K, N] (or its panels [P, K, L], static, covering N with fewer than L to
    spare; or w^T [N, K]), out[..., N] (x's leading axes); an epilogue input's leading axes are
    out's or all 1 (the kernel reads it as rows of out)."""
    x, w, out = args[0].shape, args[1].shape, args[-1].shape
    n = out[-1] if out else None
    consistent = len(x) >= 1 and len(w) == (3 if op == "linear_panels" else 2) and x[-1] == w[op != "linear"] \
        and out == (*x[:-1], {"linear": w[1], "linear_t": w[0]}.get(op, n))
    if op == "linear_panels":
        consistent = consistent and all(type(d) is int for d in (*w, n)) and w[2] > 0 and w[0] == -(-n // w[2])
    consistent = consistent and all(len(a.shape) < 2 or all(d == 1 for d in a.shape[:-1]) or a.shape[:-1] == out[:-1]
                                    for a in args[2:-1])
    if not consistent:
        expected = ["x[..., K]", {"linear": "w[K, N]", "linear_t": "w[N, K]"}.get(op, "w[P, K, L] (P = ceil(N / L))"),
                    *(["epilogue inputs (leading axes out's, or 1)"] if len(args) > 3 else []), "out[..., N]"]
        _fail(f"{path}.args", f"{op} expects {', '.join(expected)}, got {', '.join(map(str, args))}")


def _check_broadcasts(args: tuple[TensorType, ...], inputs: range, target: tuple[Dim, ...], path: str,
                      what: str = "out's shape") -> None:
    """Each of the args at `inputs` broadcasts to `target`."""
    for j in inputs:
        shape = args[j].shape
        if not broadcasts(shape, target):
            _fail(f"{path}.args[{j}].shape", f"{_json(list(shape))} does not broadcast to {what} "
                                             f"{_json(list(target))}")


def broadcasts(shape: tuple[Dim, ...], target: tuple[Dim, ...]) -> bool:
    """Whether numpy broadcasts `shape` to `target` for every size its symbols may take."""
    return len(shape) <= len(target) and all(
        dim == 1 or dim == goal for dim, goal in zip(reversed(shape), reversed(target), strict=False))


def _broadcast(shapes: list[tuple[Dim, ...]]) -> tuple[Dim, ...]:
    """numpy's broadcast of `shapes` (whose dimensions agree: the caller checked each against the
    output's); a dimension is the first that is not 1 on its axis, else 1."""
    rank = max(map(len, shapes))
    padded = [(1,) * (rank - len(shape)) + shape for shape in shapes]
    return tuple(next((dim for dim in dims if dim != 1), 1) for dims in zip(*padded, strict=True))
