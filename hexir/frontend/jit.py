"""@jit and export: trace once per signature, compile to a .hxb, run it with the runtime.

The cache key is explicit (`JitFunction.cache_key`): the abstract arguments (shape, dtype),
the device of any enclosing `hexir.on()` block, and the compile options (placement,
targets). The function itself is the JitFunction's own. Same key -> no new trace.
"""

from __future__ import annotations

import functools
import inspect
import os
import typing
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import hexir_runtime
import numpy as np
from mlir import ir
from typeguard import TypeCheckError, check_type

from hexir.errors import TraceError
from hexir.frontend.tensor import TensorSpec
from hexir.frontend.trace import current_device, trace, user_where
from hexir.passes.pipeline import Options, compile_module, parse_placement, parse_target


class JitFunction:
    """A traced-and-compiled version of a Python function over tensors."""

    def __init__(self, fn: Callable, options: Options):
        self.fn = fn
        self.options = options
        self.trace_count = 0
        self._compiled: dict[tuple, Any] = {}
        parameters = list(inspect.signature(fn).parameters.values())
        for parameter in parameters:
            if parameter.kind not in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
                raise TraceError(f"@hexir.jit: {fn.__qualname__} takes {parameter}; only plain "
                                 "positional tensor arguments are supported", *user_where())
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

    def __call__(self, *args: Any) -> Any:
        key = self.cache_key(self.specs_of(args))
        if key not in self._compiled:
            self._compiled[key] = hexir_runtime.load(self.compile(*args))
        return self._compiled[key].main(*args)


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
def jit(fn: Callable | None = None, *, placement: str | dict | None = None,
        target: str | None = None, kernel_search_path: Sequence[str | os.PathLike] = ()) -> Any:
    """Compile `fn` on its first call for each argument signature, then run the compiled code.

    `placement` ("hexir.linear=cuda,...") overrides `on()` blocks; `target` chooses the code
    generation targets ("cpu:x86-64-v3,cuda:sm_90"); `kernel_search_path` is where custom
    kernels' files are looked for after their own folders.
    """
    options = parse_target(target, Options(placement=parse_placement(placement),
                                           kernel_search_path=tuple(map(os.fspath, kernel_search_path))))
    if fn is None:
        return lambda f: JitFunction(f, options)
    return JitFunction(fn, options)


@_checked
def export(fn: Callable, path: str | Path, *example_args: Any, placement: str | dict | None = None,
           target: str | None = None, kernel_search_path: Sequence[str | os.PathLike] = ()) -> Path:
    """Compile `fn` for the signature of `example_args` (arrays or TensorSpecs) into a .hxb file."""
    jitted = fn if isinstance(fn, JitFunction) else JitFunction(fn, Options())
    if placement is not None or target is not None or kernel_search_path:
        base = replace(jitted.options, placement=parse_placement(placement) or jitted.options.placement,
                       kernel_search_path=jitted.options.kernel_search_path
                       + tuple(map(os.fspath, kernel_search_path)))
        jitted = JitFunction(jitted.fn, parse_target(target, base))
    path = Path(path)
    path.write_bytes(jitted.compile(*example_args))
    return path
