"""Tracing: running a Python function on symbolic tensors to build a hexir module.

The op functions (`linear`, `relu`, and one for any op registered in `hexir/ops.py`, made by
`op_function`) check their operands with the op's shape rule, then build the op at the
current insertion point with a location pointing at the user's line; `print` is the host's.
`on(device)` records placement: ops built inside it carry `device = ...`.
"""

from __future__ import annotations

import linecache
import os
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field

import numpy as np
from mlir import ir
from mlir.dialects import func

from hexir import ops
from hexir.dialects import hexir as hx
from hexir.dialects import make_context
from hexir.errors import _SKIPPED, HexirError, PlacementError, TraceError, user_frame, user_where
from hexir.frontend.tensor import Tensor, TensorSpec

_state = threading.local()


# ---- the user's line (user_frame, user_where: hexir/errors.py) ----------------------------

def user_location() -> ir.Location:
    info = user_frame()
    if info is None:
        return ir.Location.unknown()
    return ir.Location.file(info.filename, info.lineno, 1)


def _at_user_line(error: HexirError) -> HexirError:
    if error.where is None:
        error = type(error)(error.message, *user_where())
    return error


# ---- placement contexts ----------------------------------------------------------------

def _device_stack() -> list[str]:
    if not hasattr(_state, "devices"):
        _state.devices = []
    return _state.devices


def on(device: str) -> AbstractContextManager[None]:
    """Place the ops built inside the `with` block on `device` ("cpu" or "cuda")."""
    # checked here, not in the generator, so the error's line is the user's `with` line
    # rather than contextlib's __enter__
    if device not in hx.DEVICES:
        raise _at_user_line(PlacementError(f"on(): unknown device {device!r}; expected one of {', '.join(hx.DEVICES)}"))
    return _placed_on(device)


@contextmanager
def _placed_on(device: str) -> Iterator[None]:
    stack = _device_stack()
    stack.append(device)
    try:
        yield
    finally:
        stack.pop()


def current_device() -> str:
    stack = _device_stack()
    return stack[-1] if stack else "auto"


# ---- the trace -----------------------------------------------------------------------

@dataclass
class _Trace:
    names: dict[int, str]                                    # id(array) -> a readable name
    # id(array) -> (array, its constant). Holding the array keeps it alive for the whole
    # trace: a freed temporary's id would be reused by the next one, which would then get
    # the first one's constant.
    constants: dict[int, tuple[np.ndarray, Tensor]] = field(default_factory=dict)
    kernel_search_path: tuple[str, ...] = ()                 # for custom kernels' files
    custom_kernels: set[str] = field(default_factory=set)    # those called: their shapes are static

    def constant(self, array: np.ndarray) -> Tensor:
        if id(array) not in self.constants:
            name = self.names.get(id(array), f"const{len(self.constants)}")
            self.constants[id(array)] = (array, Tensor(TensorSpec.of(array), hx.constant(array, name)))
        return self.constants[id(array)][1]


def _current() -> _Trace:
    trace = getattr(_state, "trace", None)
    if trace is None:
        raise _at_user_line(TraceError(
            "hexir ops can only be called inside a function decorated with @hexir.jit"))
    return trace


def _captured_names(fn: Callable) -> dict[int, str]:
    """Names of the numpy arrays a function can see (closure, then globals), for the IR."""
    names: dict[int, str] = {}
    for scope in (fn.__globals__, _closure_values(fn)):
        for name, value in scope.items():
            if isinstance(value, np.ndarray) and not name.startswith("_"):
                names[id(value)] = name
    return names


def _closure_values(fn: Callable) -> dict[str, object]:
    """The free variables of `fn` that have a value: a cell stays empty until the enclosing
    function assigns its variable, which may be after `fn` is traced, or never."""
    values = {}
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
        try:
            values[name] = cell.cell_contents
        except ValueError:
            continue
    return values


def trace(fn: Callable, specs: Sequence[TensorSpec], arg_names: Sequence[str],
          kernel_search_path: Sequence[str] = ()) -> ir.Module:
    """Run `fn` on symbolic tensors of `specs` and return the hexir module it builds."""
    context = make_context()
    with context, user_location():
        module = ir.Module.create()
        arg_types = [hx.tensor_type(s.shape, s.dtype) for s in specs]
        with ir.InsertionPoint(module.body):
            main = func.FuncOp("main", ir.FunctionType.get(arg_types, []))
            entry = main.add_entry_block()
        args = [Tensor(spec, value) for spec, value in zip(specs, entry.arguments, strict=True)]
        _state.trace = _Trace(_captured_names(fn), kernel_search_path=tuple(kernel_search_path))
        try:
            with ir.InsertionPoint(entry):
                try:
                    result = fn(*args)
                except HexirError:
                    raise
                except Exception as error:  # the user's own code failed: say where, without our frames
                    raise _user_error(fn, error) from None
                outputs = _outputs(result, fn)
                func.ReturnOp([t.value for t in outputs])
        finally:
            _state.trace = None
        form = "none" if result is None else "list" if isinstance(result, list) else \
            "tuple" if isinstance(result, tuple) else "single"
        hx.set_main_attributes(main.operation, arg_names, form)
        main.operation.attributes["function_type"] = ir.TypeAttr.get(
            ir.FunctionType.get(arg_types, [t.value.type for t in outputs]))
    return module


def _user_error(fn: Callable, error: Exception) -> TraceError:
    """A TraceError at the user's line for an exception raised by their traced function."""
    fn = getattr(fn, "fn", fn)  # the user's function inside jit's wrapper of static arguments
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not os.path.abspath(f.filename).startswith(_SKIPPED)]
    where, source = (f"{frames[-1].filename}:{frames[-1].lineno}", frames[-1].line) if frames else (None, None)
    return TraceError(f"{fn.__qualname__} raised {type(error).__name__} while it was traced: {error}", where,
                      source)


def _outputs(result: object, fn: Callable) -> list[Tensor]:
    items = [] if result is None else list(result) if isinstance(result, (tuple, list)) else [result]
    for position, item in enumerate(items):
        if isinstance(item, np.ndarray) and item.ndim and item.dtype.name in hx.DTYPES:
            items[position] = _current().constant(item)
        elif not isinstance(item, Tensor):
            # the function has returned: blame its definition, not whoever called it
            fn = getattr(fn, "fn", fn)
            code = fn.__code__
            raise TraceError(
                f"a @hexir.jit function must return tensors (or a tuple of them, or None); "
                f"{fn.__qualname__}'s output {position} is a {_kind(item)}",
                f"{code.co_filename}:{code.co_firstlineno}",
                linecache.getline(code.co_filename, code.co_firstlineno).strip() or None)
    return items


def _kind(value: object) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.ndim}-d {value.dtype} array (a constant output is a float array of rank >= 1)"
    return type(value).__name__


# ---- ops -----------------------------------------------------------------------------

def _operand(op: str, name: str, value: object) -> Tensor:
    if isinstance(value, Tensor):
        return value
    if isinstance(value, np.ndarray):
        if value.dtype.name not in hx.DTYPES:
            raise TraceError(f"{op}: argument '{name}' is a {value.dtype} array; expected float32, float64, "
                             "bfloat16 or float16")
        if value.ndim == 0:
            raise TraceError(f"{op}: argument '{name}' is a 0-d array; hexir tensors have rank >= 1")
        return _current().constant(value)
    raise TraceError(f"{op}: argument '{name}' must be a tensor or a numpy array, got {type(value).__name__}")


def _build(build: Callable[[], Tensor]) -> Tensor:
    _current()
    try:
        with user_location():
            return build()
    except HexirError as error:
        raise _at_user_line(error) from None


def _apply(definition: ops.OpDef, operands: list[Tensor]) -> Tensor:
    """Build a registered op on tensors, its result shape given by its rule."""
    shape = definition.shape(*((t.shape, t.dtype) for t in operands))
    spec = TensorSpec(shape, operands[0].dtype)
    value = hx.compute(definition.name, [t.value for t in operands], hx.tensor_type(spec.shape, spec.dtype),
                       current_device())
    return Tensor(spec, value)


def op_function(definition: ops.OpDef) -> Callable[..., Tensor]:
    """The traceable function of a registered op: `f(x, ...)` on tensors or numpy arrays."""
    names = [o.rstrip("?") for o in definition.operands]

    def apply(*operands: Tensor | np.ndarray | None) -> Tensor:
        def build() -> Tensor:
            given = [(n, v) for n, v in zip(names, operands, strict=False) if v is not None]
            if len(operands) > len(names) or len(given) < sum(not o.endswith("?") for o in definition.operands):
                raise TraceError(f"{definition.name} takes {', '.join(names)}, got {len(operands)} operand(s)")
            return _apply(definition, [_operand(definition.name, n, v) for n, v in given])
        return _build(build)
    apply.__name__ = apply.__qualname__ = definition.name
    return apply


_linear = op_function(ops.REGISTRY["linear"])


def linear(x: Tensor | np.ndarray, w: Tensor | np.ndarray, bias: Tensor | np.ndarray | None = None) -> Tensor:
    """`x @ w (+ bias)` for x[M, K], w[K, N] and bias[N]; M may be symbolic; w and bias have static shapes."""
    return _linear(x, w, bias)


def print(x: Tensor | np.ndarray) -> None:  # noqa: A001 - the op is called print
    """Print the tensor when the function runs: each element as C's `%f `, a row per line."""
    def build() -> Tensor:
        operand = _operand("print", "x", x)
        hx.elementwise_shape("print", (operand.shape, operand.dtype))
        hx.print_(operand.value)
        return operand
    _build(build)


__all__ = ["linear", "print", "on", "trace", "op_function"]
