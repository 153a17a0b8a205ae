"""The typed manifest: the frozen records the meaning checks build from the JSON and the rest
of the runtime reads, so that no device re-derives anything from dicts."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .exprs import Expr
    from .scalars import Program, Tree

DTYPES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2, "int32": 4,
          "int64": 8}  # ints: where a kernel's family allows them
DEVICES = ("cpu", "cuda")
HOST = "cpu"

Dim = int | str  # a dimension: a size, or a symbol bound per call


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a manifest dtype name; bfloat16 is ml_dtypes' (the optional extra
    hexir-runtime[bf16]), imported only here, when a module or an input has one."""
    if name != "bfloat16":
        return np.dtype(name)
    try:
        import ml_dtypes
    except ImportError:
        from ..errors import DeviceError

        raise DeviceError("bfloat16 tensors need the ml_dtypes package (numpy's bfloat16): "
                          "pip install 'hexir-runtime[bf16]'") from None
    return np.dtype(ml_dtypes.bfloat16)


@dataclass(frozen=True)
class TensorType:
    """A tensor's shape (ints and symbols) and dtype name; prints as `float32[batch, 8]`."""

    shape: tuple[Dim, ...]
    dtype: str

    @property
    def symbols(self) -> list[str]:
        """The symbols of the shape, in order of first appearance."""
        return list(dict.fromkeys(dim for dim in self.shape if isinstance(dim, str)))

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        """Bytes of a static tensor (a symbol counts as 1)."""
        return math.prod(dim for dim in self.shape if isinstance(dim, int)) * self.itemsize

    def concrete(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        """The shape with every symbol replaced by its size."""
        return tuple(sizes[dim] if isinstance(dim, str) else dim for dim in self.shape)

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"


@dataclass(frozen=True)
class Work:
    """A generated CPU kernel's parallel loop: its trip count per call, and the fewest
    iterations worth giving a thread."""

    extent: Expr
    grain: int
    spans: bool = False  # the kernel walks each chunk as one span: at most one chunk a thread


@dataclass(frozen=True)
class Launch:
    """A CUDA kernel's geometry: grid (size expressions), block and dynamic shared memory."""

    grid: tuple[Expr, Expr, Expr]
    block: tuple[int, int, int]
    shared_bytes: int


@dataclass(frozen=True)
class Code:
    """Host code for a kernel: a symbol in the module's `cpu.library` (or in blob `library`,
    a custom kernel's own shared object); `work` for generated code, `source` for custom code."""

    symbol: str
    work: Work | None = None
    library: int | None = None
    source: str | None = None


@dataclass(frozen=True)
class TensorMap:
    """A TMA tensor map a CUDA kernel takes after its sizes: of args[arg] (a matrix), a copy
    moving `box` elements (innermost first)."""

    arg: int
    box: tuple[int, int]


@dataclass(frozen=True)
class Variant:
    """Another kernel in the same images computing the same thing, run instead when every size
    of the call is below its bound (`below`: a symbol or size expression -> bound) and, with an
    `arch`, when the image loaded is that architecture's (whose instructions it uses: it is in no
    other image); it may take tensor maps of its own."""

    symbol: str
    launch: Launch
    below: Mapping[Expr, int]
    arch: str | None = None
    tensor_maps: tuple[TensorMap, ...] = ()


@dataclass(frozen=True)
class GpuCode:
    """CUDA code for a kernel: its symbol in `images` (architecture -> blob) and its launch, and
    the variants tried first, in order."""

    symbol: str
    launch: Launch
    images: Mapping[str, int]
    variants: tuple[Variant, ...] = ()
    tensor_maps: tuple[TensorMap, ...] = ()

    def for_image(self, arch: str) -> GpuCode:
        """This code as loaded from `arch`'s image: without the variants of other architectures."""
        from dataclasses import replace
        return replace(self, variants=tuple(v for v in self.variants if v.arch in (None, arch)))

    def maps_of(self, symbol: str) -> tuple[TensorMap, ...]:
        return next((v.tensor_maps for v in self.variants if v.symbol == symbol), self.tensor_maps)

    def pick(self, sizes: Mapping[str, int]) -> tuple[str, Launch]:
        """The symbol and launch that run a call with `sizes`."""
        from .exprs import evaluate  # (exprs reads fields, which reads this module)
        for variant in self.variants:
            if all(evaluate(size, sizes) < bound for size, bound in variant.below.items()):
                return variant.symbol, variant.launch
        return self.symbol, self.launch


@dataclass(frozen=True)
class Kernel:
    """A checked kernel. `expr` is what a generated kernel computes (scalars.py): a tree
    (linear, linear_panels, matmul, pointwise), a Program (reduce), None (pack_panels, custom).
    `integers` are the int64 values it takes after its pointers (its `sizes` as symbols, or a
    custom kernel's `scalars`), evaluated per call."""

    name: str
    op: str
    device: str
    args: tuple[TensorType, ...]
    expr: Tree | Program | None
    integers: tuple[Expr, ...]
    cpu_code: Code | None  # what runs it on the host: its own code, its cpu_fallback, or nothing
    gpu_code: GpuCode | None  # what runs it on a GPU (cuda kernels only)
    source: str | None = None  # a custom kernel's file name
    views: tuple[TensorType | None, ...] = ()  # per arg, the shape it is read as (a reshape in place), or None

    @property
    def custom(self) -> bool:
        return self.op == "custom"

    @property
    def symbol(self) -> str:
        return self.gpu_code.symbol if self.gpu_code else self.cpu_code.symbol


@dataclass(frozen=True)
class Constant:
    name: str
    type: TensorType
    blob: int


@dataclass(frozen=True)
class CpuLibrary:
    """One build of the module's CPU code: the `-mcpu` it targets, the CPU features it needs, its blob."""

    cpu: str
    features: tuple[str, ...]
    library: int


@dataclass(frozen=True)
class Cpu:
    """The module's CPU code: its architecture and its builds, best first (each defines the same symbols)."""

    arch: str
    libraries: tuple[CpuLibrary, ...]


@dataclass(frozen=True)
class Blob:
    name: str
    offset: int
    size: int
    sha256: str


@dataclass(frozen=True)
class Buffer:
    type: TensorType
    device: str


@dataclass(frozen=True)
class Input:
    index: int
    dst: int
    op = "input"


@dataclass(frozen=True)
class Bind:
    constant: int
    dst: int
    op = "constant"


@dataclass(frozen=True)
class Call:
    kernel: int
    args: tuple[int, ...]
    op = "call"


@dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    op = "transfer"


@dataclass(frozen=True)
class Print:
    src: int
    op = "print"


@dataclass(frozen=True)
class Return:
    srcs: tuple[int, ...]
    op = "return"


Command = Input | Bind | Call | Transfer | Print | Return
_COMMAND_TYPES = {kind.op: kind for kind in (Input, Bind, Call, Transfer, Print, Return)}


@dataclass(frozen=True)
class Entry:
    name: str
    inputs: tuple[tuple[str, TensorType], ...]
    outputs: tuple[TensorType, ...]
    buffers: tuple[Buffer, ...]
    program: tuple[Command, ...]


@dataclass(frozen=True)
class Manifest:
    producer: str
    blobs: tuple[Blob, ...]
    constants: tuple[Constant, ...]
    cpu: Cpu | None
    kernels: tuple[Kernel, ...]
    entries: tuple[Entry, ...]
    cuda_table: int | None = None  # the blob holding the CUDA kernels' table (version 1: none)
