"""The traceable layout functions, with numpy's meanings: `reshape`, `transpose`, `concat`,
basic indexing (`x[..., a:b]`, `x[0]`, `x[:, None]`) and `take` (an embedding lookup). Each is
one op of the layout family whose `expr` is its record (hexir_runtime/format/layouts.py: the
same rules check the record here, in the verifier and in the runtime).

Symbols stay where they are: a reshape keeps its input's symbols in order (the static
dimensions between them regroup, one -1 resolving inside its group), a symbolic axis is sliced
whole, concat's axis is static. Ids reach a take from an entry's input (the runtime checks them
per call), a constant (checked here), an argmax over at most as many values as the table has
rows, or layout ops of those; any other ids cannot be shown in range and are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from hexir_runtime.format import HxbFormatError, TensorType, layouts
from mlir import ir

from hexir import ops
from hexir.dialects import hexir as hx
from hexir.errors import TraceError
from hexir.frontend.functions import _emit
from hexir.frontend.tensor import DTYPES, Tensor
from hexir.frontend.trace import _build, _current

IDS = ("int32", "int64")


def _tensor(op: str, name: str, value: object) -> Tensor:
    """A tensor, or a numpy array of any dtype a tensor may have as a constant."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, np.ndarray):
        if value.dtype.name not in DTYPES or value.ndim == 0:
            raise TraceError(f"{op}: {name} is a {value.ndim}-d {value.dtype} array; expected a tensor or an array "
                             f"of rank >= 1 of {', '.join(DTYPES)}")
        return _current().constant(value)
    raise TraceError(f"{op}: {name} must be a tensor or a numpy array, got {type(value).__name__}")


def _layout(kind: str, tensors: list[Tensor], shape: tuple, dtype: str, record: dict) -> Tensor:
    """The layout op `kind` of `tensors`, checked by the runtime's rule for its record."""
    args = tuple(TensorType(tuple(t.shape), t.dtype) for t in tensors) + (TensorType(tuple(shape), dtype),)
    try:
        layouts.check(record, args, kind)
    except HxbFormatError as error:
        raise TraceError(f"{kind}: {error.reason}") from None
    hx.check_extents(kind, "result", shape, dtype)
    return _emit(kind, tensors, tuple(shape), dtype, record)


def _dims(op: str, given: tuple) -> list:
    """`f(2, 3)` and `f((2, 3))` alike."""
    if len(given) == 1 and isinstance(given[0], (tuple, list)):
        return list(given[0])
    return list(given)


def reshape(x: Tensor | np.ndarray, *shape: Any) -> Tensor:
    """numpy's reshape: ints, symbol names (a dim of x.shape) and at most one -1."""
    def build() -> Tensor:
        tensor = _tensor("reshape", "x", x)
        target = _dims("reshape", shape)
        for dim in target:
            if not (isinstance(dim, str) or (isinstance(dim, (int, np.integer)) and not isinstance(dim, bool)
                                             and dim >= -1)):
                raise TraceError(f"reshape: the shape holds ints >= 0, symbol names and one -1, got {target}")
        target = [d if isinstance(d, str) else int(d) for d in target]
        if target.count(-1) > 1:
            raise TraceError(f"reshape: at most one -1 in the shape, got {target}")
        shown = f"cannot reshape {hx.describe(tensor.shape, tensor.dtype)} to [{', '.join(map(str, target))}]"
        have, want = layouts.groups(tensor.shape), layouts.groups(tuple(d for d in target if d != -1))
        if have[0] != want[0]:
            raise TraceError(f"reshape: {shown}: a symbolic dimension may only map to itself (the same names in "
                             "the same order; the static dimensions between them regroup, and one -1 resolves "
                             "inside such a group); merging or splitting symbols is not supported")
        if -1 in target:
            at = target.index(-1)
            group = sum(isinstance(d, str) for d in target[:at])
            if want[1][group] == 0 or have[1][group] % want[1][group]:
                raise TraceError(f"reshape: {shown}: the sizes cannot match")
            target[at] = have[1][group] // want[1][group]
        got = layouts.groups(tuple(target))[1]
        if got != have[1]:
            sizes = f"{have[1][0]} vs {got[0]} elements" if not have[0] else \
                f"the static dimensions before, between and after the symbols multiply to {have[1]} vs {got}"
            raise TraceError(f"reshape: {shown}: the sizes cannot match ({sizes})")
        if tuple(target) == tuple(tensor.shape):
            return tensor
        return _layout("reshape", [tensor], tuple(target), tensor.dtype, {"kind": "reshape"})
    return _build(build)


def transpose(x: Tensor | np.ndarray, *axes: Any) -> Tensor:
    """numpy's transpose: out.shape[k] = x.shape[axes[k]]; no axes: reversed."""
    def build() -> Tensor:
        tensor = _tensor("transpose", "x", x)
        rank = tensor.ndim
        given = _dims("transpose", axes) or list(range(rank))[::-1]
        perm = [ops.normalize_axis("transpose", axis, rank) for axis in given]
        if sorted(perm) != list(range(rank)):
            raise TraceError(f"transpose: axes {given} are not a permutation of the {rank} axes of "
                             f"{hx.describe(tensor.shape, tensor.dtype)}")
        if perm == list(range(rank)):
            return tensor
        shape = tuple(tensor.shape[p] for p in perm)
        return _layout("transpose", [tensor], shape, tensor.dtype, {"kind": "transpose", "perm": perm})
    return _build(build)


def concat(xs: Sequence[Tensor | np.ndarray], axis: int = 0) -> Tensor:
    """numpy's concatenate along `axis` (static) of tensors of one dtype, equal elsewhere."""
    def build() -> Tensor:
        if not isinstance(xs, (list, tuple)) or not xs:
            raise TraceError(f"concat: expected a list or tuple of tensors, got {type(xs).__name__}")
        tensors = [_tensor("concat", f"xs[{i}]", x) for i, x in enumerate(xs)]
        where = ops.normalize_axis("concat", axis, tensors[0].ndim)
        dtypes = sorted({t.dtype for t in tensors})
        if len(dtypes) > 1:
            raise TraceError(f"concat: mixed dtypes ({', '.join(str(t.spec) for t in tensors)})")
        result = tensors[0]
        while len(tensors) > 1:  # a kernel takes up to MAX_CALL_ARGS inputs: longer lists in rounds
            part, tensors = tensors[:hx.MAX_CALL_ARGS], tensors[hx.MAX_CALL_ARGS:]
            if any(len(t.shape) != len(part[0].shape) for t in part) or any(isinstance(t.shape[where], str)
                                                                             for t in part):
                raise TraceError(f"concat: cannot concatenate {', '.join(str(t.spec) for t in part)} along axis "
                                 f"{where}: one rank, the other dimensions equal, this one static")
            shape = (*part[0].shape[:where], sum(t.shape[where] for t in part), *part[0].shape[where + 1:])
            result = _layout("concat", part, shape, dtypes[0], {"kind": "concat", "axis": where})
            tensors = [result, *tensors] if tensors else []
        return result
    return _build(build)


concatenate = concat


def getitem(x: Tensor, key: Any) -> Tensor:
    """numpy's basic indexing: ints (an axis dropped), slices of static bounds, `...`, None."""
    def build() -> Tensor:
        items = list(key) if isinstance(key, tuple) else [key]
        for item in items:
            if not (item is None or item is Ellipsis or isinstance(item, slice) or _is_int(item)):
                what = "a tensor" if isinstance(item, Tensor) else f"a {type(item).__name__}"
                raise TraceError(f"indexing with {what} is not supported: hexir takes basic indexing (ints, "
                                 "slices of static bounds, ..., None); an embedding lookup is hexir.take(table, ids)")
        if items.count(Ellipsis) > 1:
            raise TraceError("an index can only have a single ellipsis ('...')")
        used = sum(item is not None and item is not Ellipsis for item in items)
        if used > x.ndim:
            raise TraceError(f"too many indices for {x.spec}: {used} for its {x.ndim} axes")
        at = items.index(Ellipsis) if Ellipsis in items else len(items)
        items[at:at + 1] = [slice(None)] * (x.ndim - used)
        picked, final, axis = [], [], 0  # per axis of x: (start, step, count)
        for item in items:
            if item is None:
                final.append(1)
                continue
            dim = x.shape[axis]
            if isinstance(dim, str):
                whole = isinstance(item, slice) and item.start is None and item.stop is None and item.step in (None, 1)
                if not whole:
                    raise TraceError(f"axis {axis} of {x.spec} is symbolic ({dim}): it can only be taken whole (:)")
                picked.append((0, 1, dim))
                final.append(dim)
            elif isinstance(item, slice):
                for bound in (item.start, item.stop, item.step):
                    if bound is not None and not _is_int(bound):
                        raise TraceError(f"slice bounds must be static ints or None, got {bound!r}")
                chosen = range(*slice(*(None if b is None else int(b) for b in (item.start, item.stop, item.step)))
                               .indices(dim))
                picked.append((chosen.start if len(chosen) else 0, chosen.step, len(chosen)))
                final.append(len(chosen))
            else:
                index = int(item)
                if not -dim <= index < dim:
                    raise TraceError(f"index {index} is out of range for axis {axis} of {x.spec}")
                picked.append((index % dim, 1, 1))
            axis += 1
        result = x
        start, step, counts = ([p[k] for p in picked] for k in range(3))
        if counts != list(x.shape) or any(start) or any(s != 1 for s in step):
            result = _layout("slice", [x], tuple(counts), x.dtype, {"kind": "slice", "start": start, "step": step})
        return result if tuple(final) == tuple(result.shape) else reshape(result, tuple(final))
    return _build(build)


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def take(table: Tensor | np.ndarray, ids: Tensor | np.ndarray) -> Tensor:
    """numpy's take(table, ids, axis=0): the rows of `table` (its first axis static) that int32
    or int64 `ids` of any rank name, shape ids.shape + table.shape[1:] (an embedding lookup)."""
    def build() -> Tensor:
        rows_of, index = _tensor("take", "table", table), _tensor("take", "ids", ids)
        if index.dtype not in IDS:
            raise TraceError(f"take: ids is {index.spec}; ids are int32 or int64")
        rows = rows_of.shape[0]
        if not isinstance(rows, int) or rows < 1:
            raise TraceError(f"take: table is {rows_of.spec}; its first axis (the rows ids name) must be static "
                             "and non-empty")
        _bounded(index.value, rows)
        shape = (*index.shape, *rows_of.shape[1:])
        return _layout("take", [rows_of, index], shape, rows_of.dtype, {"kind": "take"})
    return _build(build)


def _bounded(value: ir.Value, rows: int) -> None:
    """TraceError unless every id `value` can hold is known to be in [0, rows) or is an input's
    (which the runtime checks per call)."""
    owner = value.owner
    if isinstance(owner, ir.Block):
        return
    op = owner.operation if hasattr(owner, "operation") else owner
    if op.name == "hexir.constant":
        bad = layouts.out_of_range(hx.constant_array(op), rows)
        if bad is not None:
            raise TraceError(f"take: the constant ids hold {bad[0]} at {list(bad[1])}, out of range for a table "
                             f"of {rows} rows")
        return
    family = ops.family_of(op)
    if family == "layout":
        moved = list(op.operands)[:1] if op.name == "hexir.take" else list(op.operands)
        for operand in moved:
            _bounded(operand, rows)
        return
    if family == "reduce" and hx.dtype_of(op.result.type) == "int64":  # an argmax
        length = hx.shape_of(op.operands[0].type)[hx.expr_of(op)["axis"]]
        if isinstance(length, int) and length <= rows:
            return
        raise TraceError(f"take: the ids are an argmax over {length} values, which may not be below the "
                         f"table's {rows} rows")
    raise TraceError(f"take: ids computed by {op.name} cannot be shown to lie in [0, {rows}); ids come from an "
                     "input, a constant, an argmax over at most as many values as the table has rows, or "
                     "layout ops of those")
