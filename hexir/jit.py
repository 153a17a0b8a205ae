"""@jit and export: trace once per signature, compile to a .hxb, run it with the runtime.

The cache key is explicit (`JitFunction.cache_key`): the abstract arguments (shape, dtype),
the device of any enclosing `hexir.on()` block, and the compile options (placement,
targets). The function itself is the JitFunction's own. Same key -> no new trace.

Batch sizes (`dynamic`): by default the first call's shapes are compiled as they are; when a
later call differs from it only in the leading extent of some inputs, the function is
compiled once more with those extents symbolic (`batch`), and that module serves every later
size (as torch.compile's automatic dynamic shapes). `dynamic=True` makes the leading extent of
every input symbolic from the first call; `dynamic=False` compiles once per shape. Inputs whose
leading extents are equal in a call share one symbol, so the module checks they stay equal.
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
from mlir import ir
from typeguard import TypeCheckError, check_type

from hexir.dialects.hexir import result_form
from hexir.driver import Options, compile_module, parse_placement
from hexir.errors import TraceError
from hexir.frontend.tensor import BATCH, TensorSpec
from hexir.frontend.trace import current_device, trace, user_where
from hexir.target import parse_target


class JitFunction:
    """A traced-and-compiled version of a Python function over tensors."""

    def __init__(self, fn: Callable, options: Options, dynamic: bool | None = None):
        self.fn = fn
        self.options = options
        self.dynamic = dynamic
        self.trace_count = 0
        self._compiled: dict[tuple, tuple[Any, str]] = {}   # key -> (loaded module, result form)
        self._first: dict[tuple, tuple[TensorSpec, ...]] = {}  # the first specs of each shape family
        self._lock = threading.Lock()  # one trace per signature, even from several threads
        if not callable(fn):
            raise TraceError(f"@hexir.jit needs a function, got {type(fn).__name__}", *user_where())
        parameters = list(inspect.signature(fn).parameters.values())
        for parameter in parameters:
            if parameter.kind not in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
                raise TraceError(f"@hexir.jit: {fn.__qualname__} takes {parameter}; only plain "
                                 "positional tensor arguments are supported", *user_where())
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", parameter.name):
                raise TraceError(f"@hexir.jit: {fn.__qualname__}'s argument {parameter.name!r} must be an ASCII "
                                 "identifier: it names the input in the .hxb module", *user_where())
        self.arg_names = tuple(p.name for p in parameters)
        functools.update_wrapper(self, fn)

    def specs_of(self, args: tuple) -> tuple[TensorSpec, ...]:
        """The abstract values of call arguments (arrays or TensorSpecs), checked."""
        name = self.fn.__qualname__
        if len(args) != len(self.arg_names):
            raise TraceError(f"{name}() takes {len(self.arg_names)} argument(s) "
                             f"({', '.join(self.arg_names)}), got {len(args)}", *user_where())
        specs = []
        for arg_name, value in zip(self.arg_names, args, strict=True):
            if isinstance(value, TensorSpec):
                specs.append(value)
                continue
            if not isinstance(value, np.ndarray):
                raise TraceError(f"{name}(): argument '{arg_name}' must be a numpy array, "
                                 f"got {type(value).__name__}", *user_where())
            if value.dtype.name not in ("float32", "float64"):
                raise TraceError(f"{name}(): argument '{arg_name}' has dtype {value.dtype}; "
                                 "expected float32 or float64", *user_where())
            specs.append(TensorSpec.of(value))
        return tuple(specs)

    def cache_key(self, specs: tuple[TensorSpec, ...]) -> tuple:
        return (specs, current_device(), self.options)

    def trace(self, *args: Any) -> ir.Module:
        """The hexir module of this function for these arguments (arrays or TensorSpecs)."""
        specs = self.specs_of(args)
        self.trace_count += 1
        return trace(self.fn, specs, self.arg_names, self.options.kernel_search_path)

    def compile(self, *args: Any) -> bytes:
        """The .hxb bytes of this function for these arguments (arrays or TensorSpecs)."""
        return compile_module(self.trace(*args), self.options)

    def _family(self, specs: tuple[TensorSpec, ...]) -> tuple:
        """What must stay equal for one module to serve two calls: all but the leading extents."""
        return (tuple((s.dtype, len(s.shape), s.shape[1:]) for s in specs), current_device(), self.options)

    def _generalize(self, specs: tuple[TensorSpec, ...], changed: list[bool]) -> tuple[TensorSpec, ...]:
        """`specs` with the leading extent of each `changed` input symbolic; inputs with equal
        leading extents share a symbol (`batch`, then `batch_1`, ...)."""
        symbols: dict[int, str] = {}
        result = []
        for spec, symbolic in zip(specs, changed, strict=True):
            if not symbolic:
                result.append(spec)
                continue
            size = spec.shape[0]
            symbols.setdefault(size, BATCH if not symbols else f"{BATCH}_{len(symbols)}")
            result.append(TensorSpec((symbols[size], *spec.shape[1:]), spec.dtype))
        return tuple(result)

    def _choose(self, specs: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
        """The specs to compile for a call with `specs` (see the module's docstring)."""
        if self.dynamic is False:
            return specs
        if self.dynamic:
            return self._generalize(specs, [len(s.shape) > 0 for s in specs])
        first = self._first.setdefault(self._family(specs), specs)
        changed = [len(s.shape) > 0 and s.shape[0] != f.shape[0] for s, f in zip(specs, first, strict=True)]
        return self._generalize(specs, changed) if any(changed) else specs

    def __call__(self, *args: Any) -> Any:
        """Run the function on numpy arrays; compiled on the first call of each signature. The
        result has the function's own form: None, an array, or a tuple/list of arrays."""
        for arg_name, value in zip(self.arg_names, args, strict=False):
            if isinstance(value, TensorSpec):
                raise TraceError(f"{self.fn.__qualname__}(): argument '{arg_name}' is a TensorSpec; a call "
                                 "needs arrays (TensorSpecs are for .compile() and hexir.export)", *user_where())
        args = tuple(_native(value) for value in args)
        key = self.cache_key(self.specs_of(args))
        compiled = self._compiled.get(key)
        if compiled is None:
            specs = key[0]
            with self._lock:
                compiled = self._compiled[key] = self._load(self._choose(specs))
        loaded, form = compiled
        outputs = loaded.main(*args)
        if form == "single":
            return outputs
        outputs = () if outputs is None else outputs if isinstance(outputs, tuple) else (outputs,)
        return None if form == "none" else list(outputs) if form == "list" else outputs

    def _load(self, specs: tuple[TensorSpec, ...]) -> tuple[Any, str]:
        """The loaded module for `specs`, compiled unless it was already (under the lock)."""
        key = self.cache_key(specs)
        if key not in self._compiled:
            self.trace_count += 1
            module = trace(self.fn, specs, self.arg_names, self.options.kernel_search_path)
            form = result_form(module)
            with warnings.catch_warnings(record=True) as notices:  # e.g. "no usable GPU"
                warnings.simplefilter("always")
                loaded = hexir_runtime.load(compile_module(module, self.options))
            for notice in notices:  # said once per signature, at the caller's line
                warnings.warn(str(notice.message), notice.category, stacklevel=4)
            self._compiled[key] = (loaded, form)
        return self._compiled[key]


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
        kernel_search_path: Sequence[str | os.PathLike] = (), dynamic: bool | None = None) -> Any:
    """Compile `fn` on its first call for each argument signature, then run the compiled code.

    `placement` ("hexir.linear=cuda,...") overrides `on()` blocks; `target` chooses the code
    generation targets ("cpu:x86-64-v3,cuda:sm_90"); `kernel_search_path` is where custom
    kernels' files are looked for after their own folders; `dynamic` says when batch sizes are
    symbolic (None: from the second leading size seen; True: always; False: never).
    """
    options = Options(placement=parse_placement(placement), target=parse_target(target),
                      kernel_search_path=tuple(map(os.fspath, kernel_search_path)))
    if fn is None:
        return lambda f: JitFunction(f, options, dynamic)
    return JitFunction(fn, options, dynamic)


@_checked
def export(fn: Callable, path: str | Path, *example_args: Any, placement: str | dict | None = None,
           target: str | None = None, kernel_search_path: Sequence[str | os.PathLike] = ()) -> Path:
    """Compile `fn` for the signature of `example_args` (arrays or TensorSpecs) into a .hxb file."""
    jitted = fn if isinstance(fn, JitFunction) else JitFunction(fn, Options())
    if placement is not None or target is not None or kernel_search_path:
        options = jitted.options
        jitted = JitFunction(jitted.fn, replace(
            options, placement=parse_placement(placement) or options.placement,
            target=parse_target(target, options.target),
            kernel_search_path=options.kernel_search_path + tuple(map(os.fspath, kernel_search_path))))
    path = Path(path)
    if not path.parent.is_dir():  # before the compile, not after it
        raise TraceError(f"hexir.export: cannot write {path}: the folder {path.parent} does not exist", *user_where())
    data = jitted.compile(*example_args)
    try:
        path.write_bytes(data)
    except OSError as error:
        raise TraceError(f"hexir.export: cannot write {path}: {error.strerror}", *user_where()) from None
    return path
