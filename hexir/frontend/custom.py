"""Custom kernels: user-written CUDA and CPU code called from a traced function.

    relu6 = hexir.kernel("relu6", cuda="kernels/relu6.cu", cpu="kernels/relu6.c",
                         out=lambda x: hexir.TensorSpec(x.shape, x.dtype),
                         grid=lambda x: ((x.shape[0] * x.shape[1] + 255) // 256, 1, 1), block=(256, 1, 1))

Calling `relu6(t)` inside @hexir.jit builds a `hexir.custom_call` op whose result type comes
from `out`, whose launch geometry comes from `grid`/`block`, and which records where each
device's file is; the compiler builds and embeds those files when it packages the module.
Files are looked up relative to the Python file that defines the kernel, then in
`search_path`, then in the compile options' `kernel_search_path` (`--kernel-search-path`).
The calling convention is in docs/custom-kernels.md.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from hexir.dialects import hexir as hx
from hexir.errors import CompileError, HexirError, TraceError
from hexir.frontend import trace as tracing
from hexir.frontend.tensor import Tensor, TensorSpec
from hexir.target import MAX_BLOCK_THREADS, check_launch

CPU_FILES = (".c", ".o", ".so")
#: Files compiled from source at export time (checked against each call's signature then).
SOURCES = (".c", ".cu")
CUDA_FILES = (".cu", ".ptx", ".cubin", ".fatbin")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

Dims = tuple[int, int, int]


def _dims(what: str, value: object) -> Dims:
    items = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    if not 1 <= len(items) <= 3 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in items):
        raise TraceError(f"{what} must be 1 to 3 positive integers, got {value!r}")
    return (*items, 1, 1)[:3]


#: What a custom kernel's C or CUDA code takes (float, double).
CUSTOM_DTYPES = ("float32", "float64")

class CustomKernel:
    """A kernel written by the user, callable on tensors inside @hexir.jit functions."""

    def __init__(self, name: str, *, cuda: str | os.PathLike | None = None, cpu: str | os.PathLike | None = None,
                 out: Callable[..., TensorSpec], grid: Callable[..., Sequence[int]] | Sequence[int] | None = None,
                 block: Sequence[int] = (256, 1, 1), search_path: Sequence[str | os.PathLike] = (),
                 dtypes: Sequence[str] | None = None):
        where = tracing.user_where()
        if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name):
            raise TraceError(f"hexir.kernel: the name must be the kernel's C symbol, got {name!r}", *where)
        self.name = name
        self.files: dict[str, str] = {}
        for device, path, allowed in (("cuda", cuda, CUDA_FILES), ("cpu", cpu, CPU_FILES)):
            if path is None:
                continue
            suffix = Path(path).suffix
            if suffix not in allowed:
                other = "cpu" if device == "cuda" else "cuda"
                hint = f" (a {suffix} file is {other} code)" if suffix in (CPU_FILES + CUDA_FILES) else ""
                raise TraceError(f"hexir.kernel {name}: {device}={str(path)!r} must be one of "
                                 f"{', '.join(allowed)}{hint}", *where)
            self.files[device] = os.fspath(path)
        if not self.files:
            raise TraceError(f"hexir.kernel {name}: give at least one of cuda= or cpu=", *where)
        prebuilt = [p for p in self.files.values() if Path(p).suffix not in SOURCES]
        if dtypes is None and prebuilt:  # a source is checked against each call when compiled; an object cannot be
            raise TraceError(f"hexir.kernel {name}: {prebuilt[0]!r} is prebuilt, so its argument types cannot be "
                             "checked: declare them, e.g. dtypes=(\"float32\", \"float32\") (inputs, then output)",
                             *where)
        if dtypes is not None and (not isinstance(dtypes, (tuple, list)) or len(dtypes) < 2
                                   or any(d not in CUSTOM_DTYPES for d in dtypes)):
            raise TraceError(f"hexir.kernel {name}: dtypes= must list float32/float64 for each input and the "
                             f"output, got {dtypes!r}", *where)
        self.dtypes = tuple(dtypes) if dtypes is not None else None
        if not callable(out):
            raise TraceError(f"hexir.kernel {name}: out= must be a function of the input specs "
                             "returning a hexir.TensorSpec", *where)
        if "cuda" in self.files and grid is None:
            raise TraceError(f"hexir.kernel {name}: a cuda kernel needs grid= (a function of the input "
                             "specs, or a fixed (x, y, z))", *where)
        self.out, self.grid = out, grid
        try:
            self.block = _dims(f"hexir.kernel {name}: block=", block)
        except TraceError as error:
            raise TraceError(error.message, *where) from None
        threads = self.block[0] * self.block[1] * self.block[2]
        if threads > MAX_BLOCK_THREADS:
            raise TraceError(f"hexir.kernel {name}: block={block!r} has {threads} threads; a CUDA block "
                             f"has at most {MAX_BLOCK_THREADS}", *where)
        defining_file = where[0].rsplit(":", 1)[0] if where[0] else None
        self.search_path = tuple(os.fspath(p) for p in search_path)
        self.base = str(Path(defining_file).resolve().parent) if defining_file else os.getcwd()

    def __repr__(self) -> str:
        return f"hexir.kernel({self.name!r}, {', '.join(f'{d}={p!r}' for d, p in self.files.items())})"

    def resolve(self, extra: Sequence[str] = ()) -> dict[str, str]:
        """device -> absolute path of each file, searched in the documented order."""
        resolved = {}
        for device, path in self.files.items():
            if os.path.isabs(path):
                candidates = [Path(path)]
            else:
                candidates = [Path(folder) / path for folder in (self.base, *self.search_path, *extra)]
            found = next((c for c in candidates if c.is_file()), None)
            if found is None:
                looked = ", ".join(str(c.parent) for c in candidates)
                raise TraceError(f"custom kernel {self.name}: {device} file {path!r} not found (looked in {looked})")
            resolved[device] = str(found.resolve())
        return resolved

    def __call__(self, *inputs: Tensor) -> Tensor:
        """Build the custom call on these tensors (arrays become constants, as for the builtin ops)."""
        trace = tracing._current()
        try:
            with tracing.user_location():
                operands = [tracing._operand(self.name, f"input {i}", value) for i, value in enumerate(inputs)]
                specs = [t.spec for t in operands]
                trace.custom_kernels.add(self.name)  # so that jit compiles this function per shape
                if any(spec.symbolic for spec in specs):
                    raise TraceError(f"custom kernel {self.name}: its inputs are {', '.join(map(str, specs))}; "
                                     "custom kernels take static shapes only (no symbolic extent): give concrete "
                                     "sizes (hexir.jit(dynamic=False), or the default dynamic=None, compiles the "
                                     "function once per shape)")
                result = self.out(*specs)
                if not isinstance(result, TensorSpec):
                    raise TraceError(f"custom kernel {self.name}: out= returned {result!r}; expected a "
                                     "hexir.TensorSpec")
                called = tuple(spec.dtype for spec in (*specs, result))
                if any(dtype not in CUSTOM_DTYPES for dtype in called):
                    raise TraceError(f"custom kernel {self.name}: takes and makes float32 or float64 tensors; this "
                                     f"call passes {', '.join(map(str, specs))} and makes {result} (cast them)")
                if self.dtypes is not None and called != self.dtypes:
                    raise TraceError(f"custom kernel {self.name}: declared dtypes={self.dtypes}, but this call "
                                     f"passes {', '.join(map(str, specs))} and makes {result}")
                grid = (self.grid(*specs) if callable(self.grid) else self.grid) if self.grid is not None else (1,)
                grid = _dims(f"custom kernel {self.name}: grid", grid)
                try:
                    check_launch(self.name, list(grid), list(self.block))
                except CompileError as error:
                    raise TraceError(error.message) from None
                value = hx.custom_call(self.name, [t.value for t in operands],
                                       hx.tensor_type(result.shape, result.dtype),
                                       self.resolve(trace.kernel_search_path), grid, self.block,
                                       tracing.current_device())
                return Tensor(result, value)
        except HexirError as error:
            raise tracing._at_user_line(error) from None


kernel = CustomKernel  # hexir.kernel(name, cuda=..., cpu=..., out=..., ...): declares a user-written kernel
