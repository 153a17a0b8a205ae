"""The ops: every compute op is one definition in a family, registered once.

Families (what the compiler knows how to compute; the runtime checks kernels by family):
- `Pointwise(name, function)`: n-ary, numpy broadcasting; `function` maps `Scalar`s to a
  `Scalar` (`hexir/ops/scalar.py`), e.g. `Pointwise("silu", lambda x: x / (1 + exp(-x)))`.
- `Reduce(name, function, operands)`: over one axis of its first operand; `function` also
  calls `row_sum` / `row_max` / `row_argmax` (`softmax`, `layer_norm`, `argmax` ...).
- `Contract(name, ...)`: `linear`, `matmul` (ops/matmul.py), each with its own shape rule and schedules.
- `Layout(name)`: moves elements, computes nothing (transpose, reshape, slice, concat, take);
  its `expr` is a record whose rule and numpy meaning are the runtime's `format/layouts.py`.

An instance of a pointwise or reduce op carries its tree (the runtime's scalar-expression
language) in the IR as `expr`, Python numbers folded in as constants: that tree is the one
source of the kernel's IR (`hexir/schedules/emit.py`), its numpy meaning (the runtime's
`scalars.evaluate`, which the reference device and the tests use), the cache key and the
manifest. Each family's kernel per device is one builder (`hexir/schedules/<device>.py`).
`register(...)` (public as `hexir.register_op`) adds an op; the built-in ones are in
`hexir/ops/library.py`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hexir_runtime.errors import HxbFormatError
from hexir_runtime.format import scalars as sc

from hexir.dialects import hexir as hx
from hexir.errors import TraceError, user_where
from hexir.ops import scalar
from hexir.schedules import Builder, Variants, cpu_families, cpu_layout, cuda_families, cuda_layout

FAMILY_SCHEDULES: dict[str, dict[str, Builder]] = {
    "pointwise": {"cpu": cpu_families.pointwise, "cuda": cuda_families.pointwise},
    "reduce": {"cpu": cpu_families.reduce, "cuda": cuda_families.reduce},
    "layout": {"cpu": cpu_layout.layout, "cuda": cuda_layout.layout},
}


@dataclass(frozen=True)
class Pointwise:
    """An element-wise op: `function` of `arity` Scalars (default: its parameter count), then
    keyword parameters given when it is called (pow's `exponent`)."""

    name: str
    function: Callable[..., scalar.Scalar]
    arity: int = 0
    family = "pointwise"

    def __post_init__(self) -> None:
        _check_definition(self)
        if not self.arity:
            object.__setattr__(self, "arity", len(inspect.signature(self.function).parameters))
        if isinstance(self.arity, bool) or not isinstance(self.arity, int) or not 1 <= self.arity <= hx.MAX_CALL_ARGS:
            raise TraceError(f"pointwise: op {self.name} takes 1 to {hx.MAX_CALL_ARGS} operands, got {self.arity!r}",
                             *user_where())

    @property
    def operands(self) -> tuple[str, ...]:
        return tuple(f"x{i}" for i in range(self.arity))

    def tree(self, **params: object) -> sc.Tree:
        return scalar.pointwise_tree(self.name, self.function, self.arity, **params)


@dataclass(frozen=True)
class Reduce:
    """A reduction over one axis of the first operand: `function(x, *others, **params)` of
    Scalars (None for an absent optional operand) using `row_sum` / `row_max` / `row_argmax`."""

    name: str
    function: Callable[..., scalar.Scalar]
    operands: tuple[str, ...] = ("x",)
    family = "reduce"

    def __post_init__(self) -> None:
        _check_definition(self)
        names = self.operands
        if not isinstance(names, (tuple, list)) or not 1 <= len(names) <= hx.MAX_CALL_ARGS or not all(
                isinstance(n, str) and n.rstrip("?").isidentifier() for n in names) or names[0].endswith("?"):
            raise TraceError(f"reduce: op {self.name}'s operands must be 1 to {hx.MAX_CALL_ARGS} names (a "
                             f"trailing ? marks an optional one; not the first), got {names!r}", *user_where())
        object.__setattr__(self, "operands", tuple(names))


def _check_definition(op: Pointwise | Reduce) -> None:
    if not isinstance(op.name, str) or not op.name.isidentifier():
        raise TraceError(f"{op.family}: an op's name must be an identifier, got {op.name!r}", *user_where())
    if not callable(op.function):
        raise TraceError(f"{op.family}: op {op.name}'s function must be callable, got {type(op.function).__name__}",
                         *user_where())


@dataclass(frozen=True)
class Contract:
    """An op with its own shape rule and a schedule per device (linear)."""

    name: str
    operands: tuple[str, ...]
    shape: Callable[..., hx.Shape]
    schedules: dict[str, Builder]
    variants: dict[str, Variants] = field(default_factory=dict)  # device -> the schedule's other kernels
    epilogue_inputs: int = 0  # tensors its epilogue may read besides its sums (a residual): groups e0?, e1?, ...
    weights: bool = False  # its operand 1 is a weight w[K, N] the cpu reads in panels (pack-weights, pack_panels)
    rows: bool = False  # its kernels see x[..., K] and its output as rows (lower-to-tir views them so)
    family = "contract"

    @property
    def groups(self) -> tuple[str, ...]:
        """Its operand groups in the dialect: its operands, then the epilogue's inputs."""
        return (*self.operands, *(f"e{i}?" for i in range(self.epilogue_inputs)))


@dataclass(frozen=True)
class Layout:
    """An op that moves elements without computing any: each instance's `expr` is its record
    (`{"kind": "transpose", "perm": [1, 0]}`, hexir_runtime/format/layouts.py), one copy kernel."""

    name: str
    operands: tuple[str, ...] = ("x",)
    family = "layout"


OpDef = Pointwise | Reduce | Contract | Layout
REGISTRY: dict[str, OpDef] = {}


def register(op: OpDef) -> OpDef:
    """Make `op` known to the dialect, the tracer, the verifier and lower-to-tir."""
    if not isinstance(op, (Pointwise, Reduce, Contract, Layout)):
        raise TraceError(f"register: expected a Pointwise, Reduce or Contract, got {type(op).__name__}")
    if op.name in REGISTRY:
        raise TraceError(f"register: the op name {op.name!r} is taken (hexir.{op.name} exists)")
    if isinstance(op, Contract) and set(op.schedules) != set(hx.DEVICES):
        raise TraceError(f"register: op {op.name} needs a schedule for each of {', '.join(hx.DEVICES)}")
    _check_now(op)
    REGISTRY[op.name] = op
    hx.define_op(op.name, op.groups if isinstance(op, Contract) else op.operands, op.family)
    return op


def _check_now(op: OpDef) -> None:
    """Build a Pointwise's tree or a Reduce's program now, when its function needs no parameter
    (those come with each call, checked then), so that a bad definition fails at register_op."""
    if isinstance(op, (Contract, Layout)):
        return
    arguments = inspect.signature(op.function).parameters.values()
    if sum(p.default is p.empty and p.kind is not p.VAR_POSITIONAL for p in arguments) > len(op.operands):
        return
    try:
        if isinstance(op, Pointwise):
            sc.check(op.tree(), op.name, op.arity)
        else:
            scalar.reduce_program(op.name, op.function, [scalar.Scalar.arg(i) for i in range(len(op.operands))], 0)
    except HxbFormatError as error:
        raise TraceError(f"op {op.name}: its function makes an expression the runtime refuses: {error}") from None


def lookup(full_name: str) -> OpDef | None:
    """The registration of `hexir.<name>`, or None for any other op."""
    return REGISTRY.get(full_name.removeprefix("hexir.")) if full_name.startswith("hexir.") else None


def family_of(op: object) -> str | None:
    """"pointwise", "reduce", "contract", "layout" for a compute op of the graph, else None."""
    definition = lookup(op.name)
    return None if definition is None else definition.family


def reads_weights(op: object) -> bool:
    """Whether `op` is a contract whose operand 1 is a weight matrix (a linear's w)."""
    definition = lookup(op.name)
    return isinstance(definition, Contract) and definition.weights


def schedules_of(definition: OpDef) -> dict[str, Builder]:
    return definition.schedules if isinstance(definition, Contract) else FAMILY_SCHEDULES[definition.family]


# ---- shape rules (the tracer's and the verifier's) ------------------------------------------

def broadcast(op: str, shapes: Sequence[hx.Shape]) -> hx.Shape:
    """numpy's broadcast of `shapes` (aligned right; 1 stretches; a symbol matches only itself)."""
    rank = max(len(s) for s in shapes)
    result: list[int | str] = []
    for axis in range(rank):
        dims = {s[axis - rank + len(s)] for s in shapes if axis - rank + len(s) >= 0}
        dims.discard(1) if len(dims) > 1 else None
        if len(dims) > 1:
            shown = " and ".join(f"[{', '.join(map(str, s))}]" for s in shapes)
            raise TraceError(f"{op}: shapes {shown} do not broadcast (numpy's rules: axis {axis - rank} has "
                             f"{' vs '.join(map(str, sorted(dims, key=str)))})")
        result.append(dims.pop())
    return tuple(result)


def pointwise_shape(op: str, specs: Sequence[tuple[hx.Shape, str]]) -> hx.Shape:
    dtypes = sorted({dtype for _, dtype in specs})
    for name, (shape, dtype) in zip((f"operand {i}" for i in range(len(specs))), specs, strict=True):
        if dtype not in hx.DTYPES:
            raise TraceError(f"{op}: {name} is {hx.describe(shape, dtype)}; {op} takes float32, float64, "
                             "bfloat16 or float16 tensors")
    if len(dtypes) > 1:
        shown = " and ".join(hx.describe(s, d) for s, d in specs)
        raise TraceError(f"{op}: mixed dtypes ({shown}); cast one (numpy: .astype) so both are {dtypes[0]} or "
                         f"{dtypes[1]}")
    shape = broadcast(op, [s for s, _ in specs])
    hx.check_extents(op, "result", shape, dtypes[0])
    if not shape:
        raise TraceError(f"{op}: the result would be a scalar; hexir tensors have rank >= 1")
    return shape


def reduce_shape(op: str, specs: Sequence[tuple[hx.Shape, str]], program: sc.Program, keepdims: bool) -> hx.Shape:
    """The result of a reduce program on operands `specs` (the first is reduced along the axis)."""
    (shape, dtype), axis = specs[0], program.axis
    pointwise_shape(op, [specs[0]])
    if shape[axis] == 0:
        raise TraceError(f"{op}: axis {axis} of {hx.describe(shape, dtype)} is empty")
    if pointwise_shape(op, specs) != tuple(shape):
        others = ", ".join(hx.describe(s, d) for s, d in specs[1:])
        raise TraceError(f"{op}: {others} must broadcast to x's shape {hx.describe(shape, dtype)}")
    if not program.rows:
        return tuple(shape)
    return (*shape[:axis], 1, *shape[axis + 1:]) if keepdims or len(shape) == 1 else (*shape[:axis], *shape[axis + 1:])


def result_dtype(program: sc.Program, dtype: str) -> str:
    return "int64" if program.out[0] == "red" and program.reductions[program.out[1]][0] == "argmax" else dtype


def normalize_axis(op: str, axis: object, rank: int) -> int:
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TraceError(f"{op}: axis must be an int, got {axis!r}")
    if not -rank <= axis < rank:
        raise TraceError(f"{op}: axis {axis} is out of range for a tensor of rank {rank}")
    return axis % rank


from hexir.ops import library  # noqa: E402,F401 - the built-in ops register themselves
