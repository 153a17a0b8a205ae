"""@jit and export: trace once per signature, compile to a .hxb, run it with the runtime.

A call binds its arguments to the function's parameters (positionally or by keyword,
defaults filled in). A numpy array is a tensor input of the compiled module; any other
value (a number, string, None, a tuple of those; a parameter left to its default) is
*static*: the traced code sees it as a plain Python value and a new value means a new trace,
as JAX's `static_argnames`. The module's inputs are the tensors only.

The in-process key (`JitFunction.cache_key`) is explicit: the abstract tensor arguments
(shape, dtype), the static values (with their types: 1 and 1.0 differ), the device of any
enclosing `hexir.on()` block, and the compile options. A call whose key was seen before is a
dict lookup and the runtime call. A new key traces the function; the traced module then
keys the compile cache on disk (`hexir/cache.py`), so a second process skips the compile.

Captured arrays: numpy arrays the function reads from outside (globals, closures) become
constants of the compiled module. Once traced, each is made read-only
(`array.flags.writeable = False`), and so is every array it is a view of (the `W` of a captured
`W.T` or `W[:, :4]`), so writing into it in place raises numpy's own error instead of leaving
the compiled code silently stale. Freezing rather than copying at capture: a copy would leave
the base writable and its writes as silently ignored as before, and hold the weights twice.
Memory owned by something other than a numpy array (a bytearray, an mmap, a torch tensor
behind `.numpy()`) cannot be frozen through numpy; writes through that owner are not caught.
Pass an array as an argument to vary it.

Sizes (`dynamic`): by default the first call's shapes are compiled as they are; when a later
call of the same dtypes and ranks differs from it in some extents, the function is compiled
once more with every extent that changed symbolic (`batch` for a leading one, `seq` for
another), and that module serves every later size (as torch.compile's automatic dynamic
shapes); if the function cannot take one of them symbolic (a linear's K against its weight),
that call's shapes are compiled as they are. `dynamic=True` makes the leading extent of every input
symbolic from the first call; `dynamic=False` compiles once per shape. Changed extents that are
equal in that call share one symbol, so the module checks they stay equal.
A function that calls a custom kernel is compiled once per shape under `dynamic=None`: a
custom kernel's launch (its CUDA grid, from `grid=`) is fixed at trace time, so it takes
static shapes only (under `dynamic=True` its call is a TraceError that says so).
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import threading
import typing
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import hexir_runtime
import numpy as np
from hexir_runtime import dlpack, signing
from mlir import ir
from typeguard import TypeCheckError, check_type

from hexir import cache
from hexir.dialects.hexir import result_form
from hexir.driver import Options, parse_placement, parse_precision
from hexir.errors import ArgumentError, TraceError
from hexir.frontend import trace as tracing
from hexir.frontend.tensor import DTYPES as TENSOR_DTYPES
from hexir.frontend.tensor import TensorSpec
from hexir.frontend.trace import current_device, trace, user_frame, user_where
from hexir.target import DEFAULT_CPU_LEVELS, host_level, parse_target

_STATIC_TYPES = (bool, int, float, complex, str, bytes, type(None), np.generic)


def _static_key(value: Any) -> tuple:
    """A static value with its type (1, 1.0 and True are equal in Python but trace differently)."""
    if type(value) is tuple:
        return (tuple, tuple(_static_key(item) for item in value))
    if not isinstance(value, _STATIC_TYPES):
        raise TypeError(value)
    return (type(value), value)


class _Bound:
    """`fn` with its static arguments filled in, called with the tensors only. It shows the
    tracer `fn`'s globals and closure (which name captured arrays in the IR) and records the
    arrays that became constants (`captured`)."""

    def __init__(self, fn: Callable, count: int, statics: dict[int, Any]):
        self.fn, self.count, self.statics, self.state = fn, count, statics, None
        self.__globals__, self.__code__, self.__closure__ = fn.__globals__, fn.__code__, fn.__closure__

    def __call__(self, *tensors: Any) -> Any:
        self.state = tracing._current()  # the trace's record of constants, complete once the trace ends
        it = iter(tensors)
        return self.fn(*(self.statics[i] if i in self.statics else next(it) for i in range(self.count)))

    @property
    def captured(self) -> list[np.ndarray]:
        return [array for array, _ in self.state.constants.values()] if self.state else []


class JitFunction:
    """A traced-and-compiled version of a Python function over tensors."""

    def __init__(self, fn: Callable, options: Options, dynamic: bool | None = None, cache: bool = True):
        self.fn = fn
        self.options = options
        self.dynamic = dynamic
        self.cache = cache
        self.trace_count = 0
        self._calls: dict[tuple, tuple] = {}    # call key -> (entry, result form, tensor positions, native?)
        self._compiled: dict[tuple, tuple[Any, str]] = {}   # cache_key -> (loaded module, result form)
        self._first: dict[tuple, tuple[TensorSpec, ...]] = {}  # the first specs of each shape family
        self._per_shape: set[tuple] = set()  # shape families whose trace calls a custom kernel
        self._lock = threading.Lock()  # one trace per signature, even from several threads
        if not callable(fn):
            raise TraceError(f"@hexir.jit needs a function, got {type(fn).__name__}", *user_where())
        self.signature = inspect.signature(fn)
        for parameter in self.signature.parameters.values():
            if parameter.kind not in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
                raise TraceError(f"@hexir.jit: {fn.__qualname__} takes {parameter}; only plain "
                                 "positional tensor arguments are supported (they may be passed by keyword, "
                                 "and take static values and defaults)", *user_where())
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", parameter.name):
                raise TraceError(f"@hexir.jit: {fn.__qualname__}'s argument {parameter.name!r} must be an ASCII "
                                 "identifier: it names the input in the .hxb module", *user_where())
        self.arg_names = tuple(self.signature.parameters)
        functools.update_wrapper(self, fn)

    def bind(self, args: tuple, kwargs: dict) -> tuple:
        """Every parameter's value in order, from a call's arguments (defaults filled in)."""
        if not kwargs and len(args) == len(self.arg_names):
            return args
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as error:
            name, names = self.fn.__qualname__, ", ".join(self.arg_names)
            if kwargs:
                raise TraceError(f"{name}(): {error} (its arguments: {names})", *user_where()) from None
            raise TraceError(f"{name}() takes {len(self.arg_names)} argument(s) ({names}), got {len(args)}",
                             *user_where()) from None
        bound.apply_defaults()
        return tuple(bound.arguments.values())

    def split(self, values: tuple) -> tuple[tuple[TensorSpec, ...], dict[int, Any]]:
        """The tensor arguments' specs and the static values by position, checked."""
        name = self.fn.__qualname__
        specs, statics = [], {}
        for position, (arg_name, value) in enumerate(zip(self.arg_names, values, strict=True)):
            if isinstance(value, TensorSpec):
                specs.append(value)
            elif isinstance(value, np.ndarray) or hasattr(value, "__dlpack__"):
                shape, dtype = _shape_and_dtype(value)
                if dtype not in TENSOR_DTYPES:
                    raise TraceError(f"{name}(): argument '{arg_name}' has dtype {dtype}; expected float32, "
                                     "float64, bfloat16 or float16 (or int32, int64 ids)", *user_where())
                specs.append(TensorSpec(shape, dtype))
            else:
                try:
                    _static_key(value)
                except TypeError:
                    raise TraceError(f"{name}(): argument '{arg_name}' must be a numpy array, got "
                                     f"{type(value).__name__} (a static argument is a number, string, None or "
                                     "a tuple of those)", *user_where()) from None
                statics[position] = value
        return tuple(specs), statics

    def cache_key(self, specs: tuple[TensorSpec, ...], statics: dict[int, Any] | None = None) -> tuple:
        static = tuple((position, _static_key(value)) for position, value in sorted((statics or {}).items()))
        return (specs, static, current_device(), self.options)

    def trace(self, *args: Any, **kwargs: Any) -> ir.Module:
        """The hexir module of this function for these arguments (arrays or TensorSpecs, and static values)."""
        return self._trace(*self.split(self.bind(args, kwargs)))[0]

    def _trace(self, specs: tuple[TensorSpec, ...], statics: dict[int, Any]) -> tuple[ir.Module, _Bound]:
        self.trace_count += 1
        bound = _Bound(self.fn, len(self.arg_names), statics)
        names = [n for i, n in enumerate(self.arg_names) if i not in statics]
        return trace(bound, specs, names, self.options.kernel_search_path), bound

    def compile(self, *args: Any, **kwargs: Any) -> bytes:
        """The .hxb bytes of this function for these arguments (arrays or TensorSpecs, and static values)."""
        module, _ = self._trace(*self.split(self.bind(args, kwargs)))
        return cache.compile_cached(module, self.options, self.cache)

    def _family(self, specs: tuple[TensorSpec, ...], statics: dict[int, Any]) -> tuple:
        """What must stay equal for one module to serve two calls: the dtypes and ranks."""
        return (tuple((s.dtype, len(s.shape)) for s in specs), self.cache_key((), statics))

    def _generalize(self, specs: tuple[TensorSpec, ...], changed: list[list[bool]]) -> tuple[TensorSpec, ...]:
        """`specs` with each `changed` extent symbolic; changed extents of equal size share a symbol,
        `batch` (then `batch_1`, ...) where the first of them is a leading extent, else `seq`, `seq_1`..."""
        symbols: dict[int, str] = {}
        counts = {"batch": 0, "seq": 0}
        result = []
        for spec, axes in zip(specs, changed, strict=True):
            shape = list(spec.shape)
            for axis, symbolic in enumerate(axes):
                if symbolic and shape[axis] not in symbols:
                    stem = "batch" if axis == 0 else "seq"
                    symbols[shape[axis]] = stem if not counts[stem] else f"{stem}_{counts[stem]}"
                    counts[stem] += 1
                if symbolic:
                    shape[axis] = symbols[shape[axis]]
            result.append(TensorSpec(tuple(shape), spec.dtype))
        return tuple(result)

    def _choose(self, specs: tuple[TensorSpec, ...], statics: dict[int, Any]) -> tuple[TensorSpec, ...]:
        """The specs to compile for a call with `specs` (see the module's docstring)."""
        family = self._family(specs, statics)
        if self.dynamic is False or family in self._per_shape:
            return specs
        if self.dynamic:
            return self._generalize(specs, [[axis == 0 for axis in range(len(s.shape))] for s in specs])
        first = self._first.setdefault(family, specs)
        changed = [[a != b for a, b in zip(s.shape, f.shape, strict=True)] for s, f in zip(specs, first, strict=True)]
        return self._generalize(specs, changed) if any(map(any, changed)) else specs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the function on numpy arrays or other DLPack tensors (and static values); compiled
        on the first call of each signature. The result has the function's own form: None, an
        array, or a tuple/list of arrays."""
        values = args if not kwargs and len(args) == len(self.arg_names) else self.bind(args, kwargs)
        try:
            key = (tuple([(v.shape, v.dtype) if isinstance(v, np.ndarray) else _static_key(v) for v in values]),
                   current_device())
            call = self._calls.get(key)
        except TypeError:  # an unhashable or unsupported value: _prepare says which
            key, call = None, None
        if call is None:
            call = self._prepare(values, key)
        run, form, tensors, native = call
        if tensors is not None:
            values = [values[i] for i in tensors]
        outputs = run(*(values if native else map(_native, values)))
        if form == "single":
            return outputs
        outputs = () if outputs is None else outputs if isinstance(outputs, tuple) else (outputs,)
        return None if form == "none" else list(outputs) if form == "list" else outputs

    def _prepare(self, values: tuple, key: tuple | None) -> tuple:
        """What a call with `values` runs (compiled now unless this signature was before)."""
        for arg_name, value in zip(self.arg_names, values, strict=True):
            if isinstance(value, TensorSpec):
                raise TraceError(f"{self.fn.__qualname__}(): argument '{arg_name}' is a TensorSpec; a call "
                                 "needs arrays (TensorSpecs are for .compile() and hexir.export)", *user_where())
        specs, statics = self.split(values)
        with self._lock:
            chosen = self._choose(specs, statics)
            try:
                loaded, form = self._load(chosen, statics)
            except TraceError:
                if chosen == specs or self.dynamic:
                    raise
                # the function needs some changed extent static (a linear's K against its weight's):
                # this shape is compiled as it is
                loaded, form = self._load(specs, statics)
            tensors = [i for i in range(len(values)) if i not in statics] if statics else None
            native = all(v.dtype.isnative for v in values if isinstance(v, np.ndarray))
            call = (loaded.main, form, tensors, native)
            if key is not None:
                self._calls[key] = call
        return call

    def _for_this_host(self) -> Options:
        """The options a call compiles with: code for this machine's x86-64 level alone, unless the
        target names cpu levels (export keeps every default level, for machines not yet seen)."""
        if self.options.target.cpu_levels != DEFAULT_CPU_LEVELS:
            return self.options
        return replace(self.options, target=replace(self.options.target, cpu_levels=(host_level(),)))

    def _load(self, specs: tuple[TensorSpec, ...], statics: dict[int, Any]) -> tuple[Any, str]:
        """The loaded module for `specs`, compiled unless it was already (under the lock)."""
        key = self.cache_key(specs, statics)
        if key not in self._compiled:
            module, bound = self._trace(specs, statics)
            if bound.state and bound.state.custom_kernels:  # static shapes only: no symbolic batch later
                self._per_shape.add(self._family(specs, statics))
            for array in bound.captured:  # the module holds their values now: see the module's docstring
                _freeze(array)
            form = result_form(module)
            with warnings.catch_warnings(record=True) as notices:  # e.g. "no usable GPU"
                warnings.simplefilter("always")
                loaded = hexir_runtime.load(cache.compile_cached(module, self._for_this_host(), self.cache))
            for notice in notices:  # said once per signature, at the caller's line
                caller = user_frame()  # the user's line, however deep in hexir this compile started
                warnings.warn_explicit(str(notice.message), notice.category, caller.filename if caller else "hexir",
                                       caller.lineno if caller else 0)
            self._compiled[key] = (loaded, form)
        return self._compiled[key]


def _freeze(array: np.ndarray) -> None:
    """Make a captured array read-only, and every array it is a view of (`W.T`'s `W`): the
    base's memory is the constant's too. A base that is not a numpy array (a bytearray, an mmap,
    another library's tensor) cannot be made read-only: the module's docstring says so."""
    while isinstance(array, np.ndarray):
        array.flags.writeable = False
        array = array.base


_DLPACK_DTYPES = {"code 4 bits 16 lanes 1": "bfloat16"}  # the runtime's text of a dtype numpy has not


def _shape_and_dtype(value: Any) -> tuple[tuple[int, ...], str]:
    """The shape and dtype name of a numpy array or of any DLPack tensor (torch, cupy, jax, on
    the host or a GPU), which the compiled module then takes as it is."""
    if isinstance(value, np.ndarray):
        return value.shape, value.dtype.name
    device_type, _ = value.__dlpack_device__()
    if device_type in (dlpack.CPU, dlpack.CUDA_HOST):
        try:
            array = np.from_dlpack(value)  # a view, no copy
            return array.shape, array.dtype.name
        except RuntimeError:  # "Unsupported dtype in DLTensor" (bfloat16): its capsule says which
            pass
    tensor = dlpack.unpack(value.__dlpack__())  # borrows the tensor, and gives it back when dropped
    text = getattr(tensor, "dtype_text", None)
    return tensor.shape, _DLPACK_DTYPES.get(text, text) if text else tensor.dtype.name


def _native(value: Any) -> Any:
    """A numpy array in the machine's byte order (the runtime takes nothing else)."""
    if isinstance(value, np.ndarray) and not value.dtype.isnative:
        return value.astype(value.dtype.newbyteorder("="))
    return value


def _checked(fn: Callable) -> Callable:
    """`fn` with its arguments checked against its annotations by typeguard; a mismatch is a
    TraceError naming the argument, the expected and actual types, and the user's line."""
    signature = inspect.signature(fn)
    hints = typing.get_type_hints(fn)

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            arguments = signature.bind(*args, **kwargs).arguments
        except TypeError as error:
            raise TraceError(f"hexir.{fn.__name__}(): {error}", *user_where()) from None
        for name, value in arguments.items():
            parameter = signature.parameters[name]
            for item in value if parameter.kind is parameter.VAR_POSITIONAL else (value,):
                try:
                    check_type(item, hints[name])
                except TypeCheckError:
                    raise TraceError(f"hexir.{fn.__name__}(): argument '{name}' must be "
                                     f"{parameter.annotation}, got {type(item).__name__}", *user_where()) from None
        return fn(*args, **kwargs)
    return checked


@_checked
def jit(fn: Callable | None = None, *, placement: str | dict | None = None, target: str | None = None,
        kernel_search_path: Sequence[str | os.PathLike] = (), dynamic: bool | None = None, cache: bool = True,
        matmul_precision: str = "highest") -> Any:
    """Compile `fn` on its first call for each argument signature, then run the compiled code.

    `placement` ("hexir.linear=cuda,...") overrides `on()` blocks; `target` chooses the code
    generation targets ("cpu:x86-64-v3,cuda:sm_90"); `kernel_search_path` is where custom
    kernels' files are looked for after their own folders; `dynamic` says when batch sizes are
    symbolic (None: from the second leading size seen; True: always; False: never); `cache=False`
    keeps compiled modules out of the compile cache on disk (see `hexir/cache.py`);
    `matmul_precision` is "highest" (float32 linears and matmuls in float32) or "tf32" (on cuda,
    a linear's inputs rounded to TF32 for the tensor cores, as torch's; a matmul between
    activations and the cpu compute float32).
    """
    options = Options(placement=parse_placement(placement), target=parse_target(target),
                      kernel_search_path=tuple(map(os.fspath, kernel_search_path)),
                      matmul_precision=_precision(matmul_precision))
    if fn is None:
        return lambda f: JitFunction(f, options, dynamic, cache)
    return JitFunction(fn, options, dynamic, cache)


def with_options(fn: Callable, placement: str | dict | None = None, target: str | None = None,
                 kernel_search_path: Sequence[str | os.PathLike] = (), matmul_precision: str | None = None
                 ) -> JitFunction:
    """`fn` as a JitFunction, these options on top of its own (a plain function has the defaults)."""
    jitted = fn if isinstance(fn, JitFunction) else JitFunction(fn, Options())
    if placement is None and target is None and not kernel_search_path and matmul_precision is None:
        return jitted
    options = jitted.options
    return JitFunction(jitted.fn, replace(
        options, placement=parse_placement(placement) or options.placement, target=parse_target(target, options.target),
        kernel_search_path=options.kernel_search_path + tuple(map(os.fspath, kernel_search_path)),
        matmul_precision=options.matmul_precision if matmul_precision is None else _precision(matmul_precision)),
        cache=jitted.cache)


def _precision(value: object) -> str:
    try:
        return parse_precision(value)
    except ArgumentError as error:
        raise ArgumentError(error.message, *user_where()) from None


@_checked
def export(fn: Callable, path: str | Path, *example_args: Any, placement: str | dict | None = None,
           target: str | None = None, kernel_search_path: Sequence[str | os.PathLike] = (),
           sign_with: Any = None, matmul_precision: str | None = None, **static: Any) -> Path:
    """Compile `fn` for the signature of `example_args` (arrays or TensorSpecs, and static values;
    keyword arguments other than the options are `fn`'s own, e.g. static values) into a .hxb file,
    signed with `sign_with` (a PEM private key's path or an Ed25519PrivateKey) if given;
    `matmul_precision` as jit's (None: fn's own, "highest" for a plain function)."""
    jitted = with_options(fn, placement, target, kernel_search_path, matmul_precision)
    path = Path(path)
    if not path.parent.is_dir():  # before the compile, not after it
        raise TraceError(f"hexir.export: cannot write {path}: the folder {path.parent} does not exist", *user_where())
    key = None if sign_with is None else signing_key(sign_with, "hexir.export: sign_with")
    data = jitted.compile(*example_args, **static)
    if key is not None:
        data = signing.sign(data, key)
    try:
        path.write_bytes(data)
    except OSError as error:
        raise TraceError(f"hexir.export: cannot write {path}: {error.strerror}", *user_where()) from None
    return path


def signing_key(key: Any, what: str) -> signing.Key:
    """The runtime's signing key for `key` (a path or a key object); ArgumentError if it cannot sign."""
    try:
        return signing.signing_key(key)
    except (hexir_runtime.KeyFileError, TypeError) as error:
        raise ArgumentError(f"{what}: {error}", *user_where()) from None
