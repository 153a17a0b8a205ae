"""The .hxb module format, version 3: read, check and write (docs/hxb-format.md).

A file is checked twice before anything uses it: first its structure (header, manifest bytes,
the blob table against the file's bytes), then its meaning (keys, types, indices, shapes, size
expressions, the host programs). The first rule broken raises `HxbFormatError` naming the field,
e.g. `kernels[2].args[1].dtype: expected one of float32, float64, got 'int8'`. The compiler
writes through `encode`, which runs the same checks on its own output.

The meaning pass does not only check the JSON: it builds the frozen `Manifest` that the rest of
the runtime reads. That is also where each kernel's code is decided once: `Kernel.cpu_code` is
what runs it on the host (its own code, its `cpu_fallback`, or None) and `Kernel.gpu_code` what
runs it on a GPU, so no device re-derives it from dicts. A version-1 manifest is upgraded to the
version-2 JSON before the checks (`_upgrade_v1`), so nothing downstream knows version 1 existed:
a file of any version is held to every check (its code's kernel tables included), and one too
old to be checked is refused.

Shapes may hold symbols (`"batch"`), sizes bound per call from the inputs' shapes; launch grids
and parallel extents are size expressions over them (`Expr`: an int, a symbol, or
`(op, expr, expr)`), evaluated per call by `evaluate` and printed by `to_text`.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from .errors import HxbFormatError

MAGIC = b"\x89HXB\r\n\x1a\n"
VERSION = 3  # what encode writes
READABLE = (1, 2, 3)  # what decode reads (version 1 is upgraded to 2; 3 is 2 with work records' `spans`)
# magic, version, header_size, manifest_offset, manifest_size, manifest_crc32, flags
HEADER = struct.Struct("<8sIIQQII")
SIGNED = 1  # the one header flag: the file ends with a signature record (signing.py)
ALIGNMENT = 64
DTYPES = {"float32": 4, "float64": 8}
DEVICES = ("cpu", "cuda")
HOST = "cpu"
# The ops the runtime knows are linear (linear_panels: its w packed; pack_panels packs one) and
# relu (checked by their shapes); any other identifier is an op the runtime runs only as native code (no numpy
# reference). A linear's epilogues are an optional "bias" first, then the element-wise ops fused
# into it (relu, or ops the runtime does not know, which the reference device then refuses).
COMMANDS = {  # host program op -> its other fields
    "input": ("index", "dst"),
    "constant": ("constant", "dst"),
    "call": ("kernel", "args"),
    "transfer": ("src", "dst"),
    "print": ("src",),
    "return": ("srcs",),
}
EXPR_OPS = ("ceildiv", "mul", "add", "min", "max")
EXPR_DEPTH = 8  # the deepest nesting of [op, a, b] lists
MAX_SHARED_BYTES = 232448  # 227 KiB: the most dynamic shared memory a block can have (sm_90)
_COMMAND_FIELDS = tuple(sorted({field for fields in COMMANDS.values() for field in fields}))
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_IMAGE = re.compile(r"(sm|compute)_[0-9]+|fatbin")
# A kernel's keys beyond name, op, device, symbol and args, by (device, custom): (required, optional).
_KERNEL_KEYS = {
    ("cpu", False): (("epilogues", "sizes", "work"), ()),
    ("cpu", True): (("scalars", "source"), ("library",)),
    ("cuda", False): (("epilogues", "sizes", "launch", "images"), ("cpu_fallback", "variants")),
    ("cuda", True): (("scalars", "source", "launch", "images"), ("cpu_fallback",)),
}
_OPTIONAL_KERNEL_KEYS = tuple(dict.fromkeys(key for keys in _KERNEL_KEYS.values() for key in sum(keys, ())))
_SHA256 = re.compile(r"[0-9a-f]{64}")

Dim = int | str  # a dimension: a size, or a symbol bound per call
Expr = int | str | tuple  # a size expression: an int, a symbol, or (op, Expr, Expr)


# --- size expressions ------------------------------------------------------------------------


def evaluate(expr: Expr, sizes: Mapping[str, int]) -> int:
    """The value of a (checked) size expression, the symbols taking their `sizes`."""
    if isinstance(expr, int):
        return expr
    if isinstance(expr, str):
        return sizes[expr]
    op, left, right = expr[0], evaluate(expr[1], sizes), evaluate(expr[2], sizes)
    if op == "ceildiv":
        return -(-left // right)
    return {"mul": left * right, "add": left + right, "min": min(left, right), "max": max(left, right)}[op]


def to_text(expr: Expr) -> str:
    """A size expression for people: `ceildiv(batch, 64)`."""
    if isinstance(expr, tuple):
        return f"{expr[0]}({to_text(expr[1])}, {to_text(expr[2])})"
    return str(expr)


def symbols_of(expr: Expr) -> list[str]:
    """The symbols of a size expression, in order of first appearance."""
    if isinstance(expr, str):
        return [expr]
    if isinstance(expr, tuple):
        return list(dict.fromkeys(symbols_of(expr[1]) + symbols_of(expr[2])))
    return []


# --- the typed manifest ----------------------------------------------------------------------


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
class Variant:
    """Another kernel in the same images computing the same thing, run instead when every size
    of the call is below its bound (`below`: symbol -> bound)."""

    symbol: str
    launch: Launch
    below: Mapping[str, int]


@dataclass(frozen=True)
class GpuCode:
    """CUDA code for a kernel: its symbol in `images` (architecture -> blob) and its launch, and
    the variants tried first, in order."""

    symbol: str
    launch: Launch
    images: Mapping[str, int]
    variants: tuple[Variant, ...] = ()

    def pick(self, sizes: Mapping[str, int]) -> tuple[str, Launch]:
        """The symbol and launch that run a call with `sizes`."""
        for variant in self.variants:
            if all(sizes[name] < bound for name, bound in variant.below.items()):
                return variant.symbol, variant.launch
        return self.symbol, self.launch


@dataclass(frozen=True)
class Kernel:
    """A checked kernel. `integers` are the int64 values it takes after its pointers (its
    `sizes` as symbols, or a custom kernel's `scalars`), evaluated per call."""

    name: str
    op: str
    device: str
    args: tuple[TensorType, ...]
    epilogues: tuple[str, ...]
    integers: tuple[Expr, ...]
    cpu_code: Code | None  # what runs it on the host: its own code, its cpu_fallback, or nothing
    gpu_code: GpuCode | None  # what runs it on a GPU (cuda kernels only)
    source: str | None = None  # a custom kernel's file name

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


@dataclass(frozen=True)
class Hxb:
    """A decoded and fully checked .hxb file: its typed manifest, the manifest's (version-2)
    JSON, the file's bytes and the version it was written in."""

    manifest: Manifest
    json: dict[str, Any]
    data: bytes
    version: int = VERSION

    def blob(self, index: int) -> memoryview:
        """The bytes of blob `index` (a read-only view into the file)."""
        entry = self.manifest.blobs[index]
        return memoryview(self.data)[entry.offset : entry.offset + entry.size]


def decode(data: bytes | bytearray | memoryview) -> Hxb:
    """Check `data` (structure, then meaning) and return it decoded; raises HxbFormatError."""
    from .signing import split  # (signing imports this module)

    data = bytes(data)
    version, manifest = _check_structure(split(data)[0])  # a signed file: the module before its record
    if version == 1:
        manifest = _upgrade_v1(manifest)
    manifest = _upgrade_cpu(manifest)
    return Hxb(_check_meaning(manifest), manifest, data, version)


def read(path: str | os.PathLike[str]) -> Hxb:
    """Read and decode the .hxb file at `path` (OSError if it cannot be read)."""
    with open(path, "rb") as file:
        return decode(file.read())


def encode(manifest: dict[str, Any], blobs: list[tuple[str, bytes]]) -> bytes:
    """Lay out a version-3 .hxb file: `manifest` without its `blobs` key, plus (name, bytes) blobs.

    The manifest refers to blobs by their index in `blobs`; this function computes their
    offsets, sizes and checksums and the header, then decodes the result so that an invalid
    module raises HxbFormatError here rather than in the runtime.
    """
    if not isinstance(manifest, dict):
        _fail("manifest", f"expected an object, got {_describe(manifest)}")
    if "blobs" in manifest:
        _fail("blobs", "encode computes the blob table: pass the blobs separately")
    payloads = [data if isinstance(data, bytes) else bytes(memoryview(data)) for _, data in blobs]
    digests = [hashlib.sha256(payload).hexdigest() for payload in payloads]  # once: blobs can be big
    text = b""
    while True:  # offsets depend on the manifest's length, which depends on the offsets
        offset, table = _align(HEADER.size + len(text)), []
        for (name, _), payload, digest in zip(blobs, payloads, digests, strict=True):
            table.append({"name": name, "offset": offset, "size": len(payload), "sha256": digest})
            offset = _align(offset + len(payload))
        layout = {key: manifest[key] for key in ("producer",) if key in manifest}
        layout["blobs"] = table
        layout.update(manifest)
        try:
            candidate = json.dumps(layout, indent=1, allow_nan=False).encode()
        except (TypeError, ValueError) as error:
            _fail("manifest", f"cannot be written as JSON: {error}")
        if candidate == text:
            break
        text = candidate
    header = HEADER.pack(MAGIC, VERSION, HEADER.size, HEADER.size, len(text), zlib.crc32(text), 0)
    parts, end = [header, text], len(header) + len(text)
    for entry, payload in zip(table, payloads, strict=True):
        parts += [bytes(entry["offset"] - end), payload]
        end = entry["offset"] + len(payload)
    data = b"".join(parts)
    decode(data)  # checks the meaning, and the layout against the checksums (each blob hashed once more)
    return data


def write(path: str | os.PathLike[str], manifest: dict[str, Any], blobs: list[tuple[str, bytes]]) -> None:
    """Encode a module (see `encode`) and write it to `path`."""
    data = encode(manifest, blobs)
    with open(path, "wb") as file:
        file.write(data)


def _align(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


# --- version 1 -------------------------------------------------------------------------------

_V1_OPS = {"linear": [], "linear_bias": ["bias"], "linear_relu": ["relu"], "linear_bias_relu": ["bias", "relu"]}


def _upgrade_v1(manifest: dict[str, Any]) -> dict[str, Any]:
    """The version-2 JSON of a version-1 manifest: fused linear ops become `linear` with
    epilogues, generated kernels get `epilogues` and `sizes` (v1 shapes are static, so none),
    and `parallel_extent: n` becomes `work: {extent: n, grain: 1}`. A field it reads that is
    malformed is refused here, naming it; the rest is left for the version-2 checks to name."""
    manifest = copy.deepcopy(manifest)
    for i, kernel in enumerate(_list(manifest.get("kernels"), "kernels")):
        path = f"kernels[{i}]"
        _is_object(kernel, path)
        op = _str(kernel.get("op"), f"{path}.op")
        if op == "custom":
            continue
        if op in _V1_OPS:
            kernel["epilogues"] = list(_V1_OPS[op])
            kernel["op"] = "linear"
        else:
            kernel.setdefault("epilogues", [])
        kernel.setdefault("sizes", [])
        for code, where in ((kernel, path), (kernel.get("cpu_fallback"), f"{path}.cpu_fallback")):
            if code is not None and "parallel_extent" in _is_object(code, where):
                code["work"] = {"extent": code.pop("parallel_extent"), "grain": 1}
    return manifest


def _upgrade_cpu(manifest: dict[str, Any]) -> dict[str, Any]:
    """A single-library `cpu` ({arch, cpu, features, library}: version 1 and early version 2)
    becomes `{arch, libraries: [{cpu, features, library}]}`; anything else is left as it is."""
    cpu = manifest.get("cpu")
    if isinstance(cpu, dict) and "libraries" not in cpu and {"cpu", "features", "library"} <= cpu.keys():
        manifest = dict(manifest)
        rest = {key: value for key, value in cpu.items() if key not in ("cpu", "features", "library")}
        manifest["cpu"] = {**rest, "libraries": [{key: cpu[key] for key in ("cpu", "features", "library")}]}
    return manifest


# --- kernel tables: what the code says it holds ------------------------------------------------


def parse_table(text: bytes, where: str) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """A kernel table (`{"kernels": [{"symbol": ..., ...}, ...], ...}`, UTF-8 JSON, one trailing NUL
    allowed): its entries by symbol, and its other keys (a CPU library's record of the level it was
    built for: `cpu`, `features`); HxbFormatError naming `where` if it is malformed."""
    try:
        table = json.loads(text.removesuffix(b"\0").decode("utf-8"), object_pairs_hook=_unique_keys,
                           parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError, HxbFormatError) as error:
        _fail(where, f"the kernel table is not valid UTF-8 JSON ({error})")
    if not isinstance(table, dict) or not isinstance(table.get("kernels"), list):
        _fail(where, "the kernel table is not an object with a list of kernels")
    entries: dict[str, dict[str, Any]] = {}
    for i, kernel in enumerate(table["kernels"]):
        if not isinstance(kernel, dict) or not isinstance(kernel.get("symbol"), str):
            _fail(where, f"the kernel table's kernels[{i}] is not an object with a symbol")
        if kernel["symbol"] in entries:
            _fail(where, f"the kernel table lists symbol {kernel['symbol']!r} twice")
        entries[kernel["symbol"]] = kernel
    return entries, {key: value for key, value in table.items() if key != "kernels"}


def check_build(record: dict[str, Any], build: CpuLibrary, path: str, where: str) -> None:
    """Check that a CPU library's own record of what it was built for (its kernel table's `cpu` and
    `features`) is what the manifest says of it at `path` (`cpu.libraries[i]`): the host's features
    were checked against the manifest's, so the code must need no other. HxbFormatError if not."""
    for key, value in (("cpu", build.cpu), ("features", list(build.features))):
        if key not in record:
            _fail(f"{path}.{key}", f"the kernel table of {where} does not record the CPU it was built for: "
                                   "built by an older compiler? (rebuild the module)")
        if _canonical(record[key]) != _canonical(value):
            _fail(f"{path}.{key}", f"the manifest says {_canonical(value)}, the kernel table of {where} says "
                                   f"{_canonical(record[key])}")


def check_table(hxb: Hxb, table: dict[str, dict[str, Any]], kernels: list[int], gpu: bool, where: str) -> None:
    """Check that the code's `table` describes `kernels` (indices) exactly as the manifest does:
    their args (shape, dtype), sizes or scalars, work (host code) or launch (`gpu`), and a
    generated kernel's op and epilogues. The host code of a CUDA kernel is its cpu_fallback.
    HxbFormatError names the kernel and field."""
    for index in kernels:
        spec, kernel = hxb.json["kernels"][index], hxb.manifest.kernels[index]
        code = kernel.gpu_code if gpu else kernel.cpu_code
        expected = {"args": [{"shape": arg["shape"], "dtype": arg["dtype"]} for arg in spec["args"]]}
        expected["scalars" if kernel.custom else "sizes"] = spec["scalars" if kernel.custom else "sizes"]
        if gpu:
            expected["launch"] = spec["launch"]
        elif not kernel.custom:
            expected["work"] = (spec if kernel.device == "cpu" else spec["cpu_fallback"])["work"]
        if not kernel.custom:  # what the code computes: the reference device's input, so it must agree
            expected["op"], expected["epilogues"] = spec["op"], spec["epilogues"]
        path = f"kernels[{index}]" if gpu or kernel.device == "cpu" else f"kernels[{index}].cpu_fallback"
        checks = [(path, code.symbol, expected)]
        for j, variant in enumerate(spec.get("variants", []) if gpu else []):  # the same, launched otherwise
            checks.append((f"{path}.variants[{j}]", variant["symbol"], {**expected, "launch": variant["launch"]}))
        for field_path, symbol, wanted in checks:
            entry = table.get(symbol)
            if entry is None:
                _fail(f"{field_path}.symbol", f"{kernel.name}: symbol {symbol!r} is not in the kernel table of {where}")
            for key, value in wanted.items():
                if _canonical(entry.get(key)) != _canonical(value):
                    _fail(f"{field_path}.{key}", f"{kernel.name}: the manifest says {_canonical(value)}, the kernel "
                                                 f"table of {where} says {_canonical(entry.get(key))}")


def _canonical(value: Any) -> str:
    """JSON text that tells 1, 1.0 and true apart, and ignores key order."""
    return json.dumps(value, sort_keys=True)


# --- structure: header, manifest bytes, blob table -------------------------------------------


def _check_structure(data: bytes) -> tuple[int, dict[str, Any]]:
    if not data.startswith(MAGIC):
        if 0 < len(data) < len(MAGIC) and MAGIC.startswith(data):
            _fail("header", f"truncated: the file has {len(data)} bytes, the header {HEADER.size}")
        _fail("header.magic", "not a hexir module (bad magic)")
    if len(data) < HEADER.size:
        _fail("header", f"truncated: the file has {len(data)} bytes, the header {HEADER.size}")
    _, version, header_size, offset, size, crc, flags = HEADER.unpack_from(data)
    if version not in READABLE:
        readable = ", ".join(map(str, READABLE[:-1])) + f" and {READABLE[-1]}"
        _fail("header.version", f"version {version} is not supported; this runtime reads versions {readable}")
    for field, value, expected in [
        ("header_size", header_size, HEADER.size),
        ("manifest_offset", offset, HEADER.size),
    ]:
        if value != expected:
            _fail(f"header.{field}", f"expected {expected}, got {value}")
    if flags & ~SIGNED:
        _fail("header.flags", f"unknown flags {flags & ~SIGNED:#x} (this runtime knows {SIGNED}: signed)")
    end = offset + size
    if end > len(data):
        reason = f"the manifest ({size} bytes at {offset}) goes past the end of the file ({len(data)} bytes)"
        _fail("header.manifest_size", f"{reason}: truncated?")
    text = data[offset:end]
    if zlib.crc32(text) != crc:
        reason = f"checksum mismatch (header {crc:08x}, manifest {zlib.crc32(text):08x})"
        _fail("header.manifest_crc32", f"{reason}: the manifest is corrupted")
    try:
        manifest = json.loads(text.decode("utf-8"), object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        _fail("manifest", f"not valid UTF-8 JSON: {error}")
    if not isinstance(manifest, dict):
        _fail("manifest", f"expected an object, got {_describe(manifest)}")
    if "blobs" not in manifest:
        _fail("blobs", "missing")
    _check_blob_table(data, _list(manifest["blobs"], "blobs"), end)
    return version, manifest


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            _fail("manifest", f"duplicate key {key!r}")
        result[key] = value
    return result


def _no_constant(name: str) -> NoReturn:
    _fail("manifest", f"{name} is not allowed in the manifest")


def _check_blob_table(data: bytes, table: list[Any], manifest_end: int) -> None:
    spans = []
    for i, blob in enumerate(table):
        path = f"blobs[{i}]"
        _object(blob, path, ("name", "offset", "size", "sha256"))
        _str(blob["name"], f"{path}.name")
        offset = _int(blob["offset"], f"{path}.offset")
        size = _int(blob["size"], f"{path}.size")
        if not isinstance(blob["sha256"], str) or not _SHA256.fullmatch(blob["sha256"]):
            _fail(f"{path}.sha256", f"expected 64 lowercase hex digits, got {_describe(blob['sha256'])}")
        if offset % ALIGNMENT:
            _fail(f"{path}.offset", f"{offset} is not a multiple of {ALIGNMENT}")
        if offset < manifest_end:
            _fail(f"{path}.offset", f"{offset} is inside the header or manifest (they end at {manifest_end})")
        if offset + size > len(data):
            _fail(path, f"{size} bytes at {offset} go past the end of the file ({len(data)} bytes): truncated?")
        spans.append((offset, i, size))
    cursor = manifest_end
    for offset, i, size in sorted(spans):
        if offset < cursor:
            _fail(f"blobs[{i}].offset", f"blob overlaps the one before it (which ends at {cursor})")
        if any(data[cursor:offset]):
            _fail(f"blobs[{i}].offset", f"the padding before the blob (bytes {cursor}..{offset}) is not zero")
        cursor = offset + size
    if cursor != len(data):
        _fail("file", f"{len(data) - cursor} unexpected bytes after the last blob or manifest (which ends at {cursor})")
    for offset, i, size in spans:
        if hashlib.sha256(memoryview(data)[offset : offset + size]).hexdigest() != table[i]["sha256"]:
            _fail(f"blobs[{i}].sha256", "checksum mismatch: the blob's bytes are corrupted")


# --- meaning: keys, types, indices, kernels, host programs; builds the Manifest ----------------


def _check_meaning(manifest: dict[str, Any]) -> Manifest:
    _object(manifest, "", ("producer", "blobs", "constants", "kernels", "entries"), ("cpu", "cuda"))
    blobs = tuple(Blob(**blob) for blob in manifest["blobs"])  # checked with the structure
    constants = []
    for i, constant in enumerate(_list(manifest["constants"], "constants")):
        path = f"constants[{i}]"
        tensor = _tensor(constant, path, ("name", "blob"), symbolic=False)
        blob = _index(constant["blob"], f"{path}.blob", len(blobs), "blob")
        if blobs[blob].size != tensor.nbytes:
            _fail(f"{path}.blob", f"blob {blob} has {blobs[blob].size} bytes; {tensor} needs {tensor.nbytes}")
        constants.append(Constant(_str(constant["name"], f"{path}.name"), tensor, blob))
    kernels = tuple(_check_kernel(kernel, f"kernels[{i}]", len(blobs))
                    for i, kernel in enumerate(_list(manifest["kernels"], "kernels")))
    cpu_code = [i for i, kernel in enumerate(kernels) if kernel.cpu_code and kernel.cpu_code.library is None]
    if cpu_code and "cpu" not in manifest:
        _fail("cpu", f"missing, but kernels[{cpu_code[0]}] has cpu code and no library of its own")
    cpu = None
    if "cpu" in manifest:
        if not cpu_code:
            _fail("cpu", "present, but no kernel has cpu code in a cpu library (a cpu kernel or a cpu_fallback "
                         "without a library of its own)")
        spec = _object(manifest["cpu"], "cpu", ("arch", "libraries"))
        builds = []
        for i, build in enumerate(_list(spec["libraries"], "cpu.libraries")):
            where = f"cpu.libraries[{i}]"
            _object(build, where, ("cpu", "features", "library"))
            features = tuple(_str(feature, f"{where}.features[{j}]")
                             for j, feature in enumerate(_list(build["features"], f"{where}.features")))
            builds.append(CpuLibrary(_str(build["cpu"], f"{where}.cpu"), features,
                                     _index(build["library"], f"{where}.library", len(blobs), "blob")))
        if not builds:
            _fail("cpu.libraries", "empty: the module needs at least one cpu library")
        cpu = Cpu(_str(spec["arch"], "cpu.arch"), tuple(builds))
    entries = _list(manifest["entries"], "entries")
    if not entries:
        _fail("entries", "empty: a module needs at least one entry")
    checked: list[Entry] = []
    for i, entry in enumerate(entries):
        checked.append(_check_entry(entry, f"entries[{i}]", constants, kernels, checked))
    cuda_table = None
    if "cuda" in manifest:
        if not any(kernel.gpu_code for kernel in kernels):
            _fail("cuda", "present, but the module has no cuda kernels")
        cuda_table = _index(_object(manifest["cuda"], "cuda", ("table",))["table"], "cuda.table", len(blobs), "blob")
    _check_custom_libraries(constants, kernels, cpu, cuda_table)
    return Manifest(_str(manifest["producer"], "producer"), blobs, tuple(constants), cpu, kernels, tuple(checked),
                    cuda_table)


def _check_custom_libraries(constants: list[Constant], kernels: tuple[Kernel, ...], cpu: Cpu | None,
                            cuda_table: int | None) -> None:
    """A custom kernel's own `library` blob holds nothing else: no CPU library of the module, no
    constant, no image, no table. Those are checked by the code's kernel table (or are no code); a
    custom library has no table, so a manifest pointing a custom kernel at the generated code could
    call any of its functions (the thread pool's, a kernel's) with arguments of its choosing."""
    roles = {constant.blob: f"constants[{i}]" for i, constant in enumerate(constants)}
    roles.update({build.library: f"cpu.libraries[{i}]" for i, build in enumerate(cpu.libraries if cpu else ())})
    for i, kernel in enumerate(kernels):
        roles.update({blob: f"kernels[{i}].images.{arch}"
                      for arch, blob in (kernel.gpu_code.images.items() if kernel.gpu_code else ())})
    if cuda_table is not None:
        roles[cuda_table] = "cuda.table"
    for i, kernel in enumerate(kernels):
        library = kernel.cpu_code.library if kernel.cpu_code else None
        if library in roles:
            path = f"kernels[{i}]{'' if kernel.device == 'cpu' else '.cpu_fallback'}.library"
            _fail(path, f"blob {library} is {roles[library]}'s; a custom kernel's library is a shared object of "
                        "its own")


def _check_kernel(kernel: Any, path: str, blob_count: int) -> Kernel:
    _object(kernel, path, ("name", "op", "device", "symbol", "args"), _OPTIONAL_KERNEL_KEYS)
    name = _str(kernel["name"], f"{path}.name")
    op = _identifier(kernel["op"], f"{path}.op")
    device = _choice(kernel["device"], f"{path}.device", DEVICES)
    custom = op == "custom"
    required, optional = _KERNEL_KEYS[device, custom]
    for key in _OPTIONAL_KERNEL_KEYS:
        if key in kernel and key not in required + optional:
            _fail(f"{path}.{key}", f"only {_kernels_with(key)} have this key")
        if key in required and key not in kernel:
            _fail(f"{path}.{key}", f"missing ({_kernels_with(key)} need it)")
    symbol = _identifier(kernel["symbol"], f"{path}.symbol")
    epilogues = () if custom else tuple(_identifier(e, f"{path}.epilogues[{j}]")
                                        for j, e in enumerate(_list(kernel["epilogues"], f"{path}.epilogues")))
    args = _check_args(op, epilogues, _list(kernel["args"], f"{path}.args"), path)
    symbols = list(dict.fromkeys(dim for arg in args for dim in arg.symbols))
    if custom:  # its code takes every dimension of every arg, in order, after the pointers
        dims = [dim for arg in args for dim in arg.shape]
        integers = tuple(_expr(scalar, f"{path}.scalars[{j}]", symbols)
                         for j, scalar in enumerate(_list(kernel["scalars"], f"{path}.scalars")))
        if list(integers) != dims:
            _fail(f"{path}.scalars", f"expected the dimensions of every arg in order, {_json(dims)}, "
                                     f"got {_json(kernel['scalars'])}")
        own = _custom_code(kernel, symbol, path, blob_count) if device == "cpu" else None
    else:  # generated: it takes one int64 per distinct symbol of its args
        integers = tuple(_list(kernel["sizes"], f"{path}.sizes"))
        if list(integers) != symbols:
            _fail(f"{path}.sizes", f"expected the distinct symbols of the args in order, {_json(symbols)}, "
                                   f"got {_json(kernel['sizes'])}")
        own = Code(symbol, _work(kernel["work"], f"{path}.work", symbols)) if device == "cpu" else None
    if device == "cpu":
        return Kernel(name, op, device, args, epilogues, integers, own, None, own.source)
    variants = []
    for j, variant in enumerate(_list(kernel.get("variants", []), f"{path}.variants")):
        where = f"{path}.variants[{j}]"
        _object(variant, where, ("symbol", "launch", "below"))
        below = _object(variant["below"], f"{where}.below", tuple(symbols))
        if not below:
            _fail(f"{where}.below", "expected a bound for at least one of the kernel's sizes")
        variants.append(Variant(_identifier(variant["symbol"], f"{where}.symbol"),
                                _launch(variant["launch"], f"{where}.launch", symbols),
                                {name: _int(bound, f"{where}.below.{name}", 1) for name, bound in below.items()}))
    images = kernel["images"]
    if not isinstance(images, dict) or not images:
        _fail(f"{path}.images", f"expected an object of sm_NN/compute_NN images, got {_describe(images)}")
    for arch, blob in images.items():
        if not _IMAGE.fullmatch(arch):
            _fail(f"{path}.images.{arch}", "expected sm_<number> (CUBIN), compute_<number> (PTX) or fatbin")
        if arch == "fatbin" and not custom:
            _fail(f"{path}.images.fatbin", "only custom kernels have a fatbin image")
        _index(blob, f"{path}.images.{arch}", blob_count, "blob")
    fallback = None
    if "cpu_fallback" in kernel:
        where = f"{path}.cpu_fallback"
        keys = (("symbol", "source"), ("library",)) if custom else (("symbol", "work"), ())
        spec = _object(kernel["cpu_fallback"], where, *keys)
        fallback_symbol = _identifier(spec["symbol"], f"{where}.symbol")
        fallback = (_custom_code(spec, fallback_symbol, where, blob_count) if custom
                    else Code(fallback_symbol, _work(spec["work"], f"{where}.work", symbols)))
    gpu = GpuCode(symbol, _launch(kernel["launch"], f"{path}.launch", symbols), dict(images), tuple(variants))
    return Kernel(name, op, device, args, epilogues, integers, fallback, gpu, kernel.get("source"))


def _launch(spec: Any, path: str, symbols: list[str]) -> Launch:
    launch = _object(spec, path, ("grid", "block", "shared_bytes"))
    grid = tuple(_expr(size, f"{path}.grid[{j}]", symbols) for j, size in enumerate(_triple(launch, "grid", path)))
    block = tuple(_int(size, f"{path}.block[{j}]", 1) for j, size in enumerate(_triple(launch, "block", path)))
    if math.prod(block) > 1024:
        _fail(f"{path}.block", f"{block[0]} x {block[1]} x {block[2]} threads: a block has at most 1024")
    shared = _int(launch["shared_bytes"], f"{path}.shared_bytes")
    if shared > MAX_SHARED_BYTES:
        _fail(f"{path}.shared_bytes", f"{shared} bytes: a block has at most {MAX_SHARED_BYTES}")
    return Launch(grid, block, shared)


def _triple(launch: dict[str, Any], key: str, path: str) -> list[Any]:
    sizes = _list(launch[key], f"{path}.{key}")
    if len(sizes) != 3:
        _fail(f"{path}.{key}", f"expected [x, y, z], got {len(sizes)} numbers")
    return sizes


def _work(work: Any, path: str, symbols: list[str]) -> Work:
    _object(work, path, ("extent", "grain"), ("spans",))
    if work.get("spans", True) is not True:
        _fail(f"{path}.spans", f"expected true (or no key), got {_describe(work['spans'])}")
    return Work(_expr(work["extent"], f"{path}.extent", symbols), _int(work["grain"], f"{path}.grain", 1),
                "spans" in work)


def _kernels_with(key: str) -> str:
    """Which kernels have `key`, in words: "cuda kernels", "custom kernels", "generated cpu kernels"."""
    kinds = [kind for kind, keys in _KERNEL_KEYS.items() if key in sum(keys, ())]
    devices, customs = {device for device, _ in kinds}, {custom for _, custom in kinds}
    words = []
    if len(customs) == 1:
        words.append("custom" if customs.pop() else "generated")
    if len(devices) == 1:
        words.append(devices.pop())
    return " ".join([*words, "kernels"])


def _custom_code(code: dict[str, Any], symbol: str, path: str, blob_count: int) -> Code:
    """The host code of a custom kernel (or of its cpu_fallback): `source` and its own `library`, if any."""
    if not isinstance(code["source"], str) or not code["source"]:
        _fail(f"{path}.source", f"expected a file name (a non-empty string), got {_describe(code['source'])}")
    library = _index(code["library"], f"{path}.library", blob_count, "blob") if "library" in code else None
    return Code(symbol, None, library, code["source"])


def _check_args(op: str, epilogues: tuple[str, ...], specs: list[Any], path: str) -> tuple[TensorType, ...]:
    """A kernel's args: their types and access, and the shapes its op needs (a symbol is a
    dimension equal only to itself). `path` is the kernel's."""
    args = tuple(_tensor(arg, f"{path}.args[{j}]", ("access",)) for j, arg in enumerate(specs))
    for j, arg in enumerate(specs):
        _choice(arg["access"], f"{path}.args[{j}].access", ("write",) if j == len(args) - 1 else ("read",))
    if op == "custom":  # any shapes; float32 and float64 may mix
        if not 2 <= len(args) <= 5:
            _fail(f"{path}.args", f"custom takes 2 to 5 args (1 to 4 inputs, then out), got {len(args)}")
        return args
    if not args:
        _fail(f"{path}.args", f"{op} takes at least one arg (its destination)")
    for j, arg in enumerate(args):
        if arg.dtype != args[0].dtype:
            _fail(f"{path}.args[{j}].dtype", f"expected {args[0].dtype} like args[0], got {arg.dtype!r}")
    if op in ("relu", "pack_panels"):
        expected = ["x", "out of the same shape"] if op == "relu" else ["w[K, N]", "out[P, K, L] (P = ceil(N / L))"]
        if epilogues:
            _fail(f"{path}.epilogues", f"{op} has none, got {_json(list(epilogues))}")
    elif op in ("linear", "linear_panels"):
        if "bias" in epilogues[1:]:  # (an element-wise op may repeat: relu(relu(x @ w)) fuses twice)
            _fail(f"{path}.epilogues", f"expected [bias] then fused element-wise ops, got "
                                       f"{_json(list(epilogues))}")
        expected = ["x[M, K]", "w[K, N]" if op == "linear" else "w[P, K, L] (P = ceil(N / L))",
                    *(["bias[N]"] if "bias" in epilogues else []), "out[M, N]"]
    else:  # an op the runtime does not know: native code only
        return args
    if len(args) != len(expected):
        _fail(f"{path}.args", f"{op} takes {len(expected)} args ({', '.join(expected)}), got {len(args)}")
    shapes = [arg.shape for arg in args]
    if op == "relu":
        consistent = shapes[0] == shapes[1]
    elif op == "pack_panels":
        w, out = shapes
        consistent = len(w) == 2 and len(out) == 3 and all(type(d) is int for d in (*w, *out)) and out[1] == w[0] \
            and out[2] > 0 and out[0] == -(-w[1] // out[2])
    else:
        x, w, out = shapes[0], shapes[1], shapes[-1]
        n = out[1] if len(out) == 2 else None
        if op == "linear":
            consistent = len(x) == 2 and len(w) == 2 and x[1] == w[0] and out == (x[0], w[1])
        else:  # the panels' columns, static, cover N with fewer than L to spare
            consistent = len(x) == 2 and len(w) == 3 and x[1] == w[1] and out == (x[0], n) and all(
                type(d) is int for d in (*w, n)) and w[2] > 0 and w[0] == -(-n // w[2])
        consistent = consistent and (len(args) == 3 or shapes[2] == (n,))
    if not consistent:
        _fail(f"{path}.args", f"{op} expects {', '.join(expected)}, got {', '.join(map(str, args))}")
    return args


def _check_entry(entry: Any, path: str, constants: list[Constant], kernels: tuple[Kernel, ...],
                 previous: list[Entry]) -> Entry:
    _object(entry, path, ("name", "inputs", "outputs", "buffers", "program"))
    name = _identifier(entry["name"], f"{path}.name")
    if name in [other.name for other in previous]:
        _fail(f"{path}.name", f"a second entry named {name!r}")
    inputs: list[tuple[str, TensorType]] = []
    for i, spec in enumerate(_list(entry["inputs"], f"{path}.inputs")):
        tensor = _tensor(spec, f"{path}.inputs[{i}]", ("name",))
        input_name = _identifier(spec["name"], f"{path}.inputs[{i}].name")
        if input_name in [other for other, _ in inputs]:
            _fail(f"{path}.inputs[{i}].name", f"a second input named {input_name!r}")
        inputs.append((input_name, tensor))
    bound_symbols = {symbol for _, tensor in inputs for symbol in tensor.symbols}
    outputs = [_tensor(spec, f"{path}.outputs[{i}]")
               for i, spec in enumerate(_list(entry["outputs"], f"{path}.outputs"))]
    buffers = _Buffers(_list(entry["buffers"], f"{path}.buffers"), f"{path}.buffers")
    for what, tensors in (("outputs", outputs), ("buffers", buffers.types)):
        for i, tensor in enumerate(tensors):
            for symbol in tensor.symbols:
                if symbol not in bound_symbols:
                    _fail(f"{path}.{what}[{i}].shape", f"symbol {symbol!r} is bound by no input")
    bound = [False] * len(inputs)
    program = _list(entry["program"], f"{path}.program")
    commands: list[Command] = []
    for c, command in enumerate(program):
        where = f"{path}.program[{c}]"
        _object(command, where, ("op",), _COMMAND_FIELDS)
        op = _choice(command["op"], f"{where}.op", tuple(COMMANDS))
        _object(command, where, ("op", *COMMANDS[op]))
        if op == "input":
            i = _index(command["index"], f"{where}.index", len(inputs), "input")
            if bound[i]:
                _fail(f"{where}.index", f"input {i} is bound a second time")
            bound[i] = True
            buffers.write(command["dst"], f"{where}.dst", inputs[i][1], f"input {i}", HOST)
        elif op == "constant":
            k = _index(command["constant"], f"{where}.constant", len(constants), "constant")
            buffers.write(command["dst"], f"{where}.dst", constants[k].type, f"constant {k}")
        elif op == "call":
            k = _index(command["kernel"], f"{where}.kernel", len(kernels), "kernel")
            specs, device = kernels[k].args, kernels[k].device
            args = _list(command["args"], f"{where}.args")
            if len(args) != len(specs):
                _fail(f"{where}.args", f"kernels[{k}] takes {len(specs)} args, got {len(args)}")
            for j, (arg, spec) in enumerate(zip(args, specs, strict=True)):
                use = buffers.write if j == len(args) - 1 else buffers.read
                use(arg, f"{where}.args[{j}]", spec, f"kernels[{k}].args[{j}]", device)
        elif op == "transfer":
            src = buffers.read(command["src"], f"{where}.src")
            dst = buffers.write(command["dst"], f"{where}.dst", buffers.types[src], f"buffer {src}")
            if buffers.devices[src] == buffers.devices[dst]:
                _fail(where, f"a transfer between two buffers on {buffers.devices[src]} (it must change device)")
        elif op == "print":
            buffers.read(command["src"], f"{where}.src", None, "a printed buffer", HOST)
        elif c != len(program) - 1:
            _fail(where, "return must be the last command")
        else:
            srcs = _list(command["srcs"], f"{where}.srcs")
            if len(srcs) != len(outputs):
                _fail(f"{where}.srcs", f"returns {len(srcs)} values, but the entry has {len(outputs)} outputs")
            for j, src in enumerate(srcs):
                buffers.read(src, f"{where}.srcs[{j}]", outputs[j], f"output {j}", HOST)
        fields = {key: tuple(value) if isinstance(value, list) else value for key, value in command.items()}
        del fields["op"]
        commands.append(_COMMAND_TYPES[op](**fields))
    if not program or program[-1]["op"] != "return":
        _fail(f"{path}.program", "the last command must be a return")
    for i in range(len(inputs)):
        if not bound[i]:
            _fail(f"{path}.inputs[{i}]", "never bound by an input command")
    for i in range(len(buffers.types)):
        if not buffers.written[i]:
            _fail(f"{path}.buffers[{i}]", "never written")
    places = tuple(Buffer(tensor, device) for tensor, device in zip(buffers.types, buffers.devices, strict=True))
    return Entry(name, tuple(inputs), tuple(outputs), places, tuple(commands))


class _Buffers:
    """An entry's buffers while its program is checked: their types, devices, and which are written."""

    def __init__(self, specs: list[Any], path: str) -> None:
        self.types = [_tensor(spec, f"{path}[{i}]", ("device",)) for i, spec in enumerate(specs)]
        self.devices = [_choice(spec["device"], f"{path}[{i}].device", DEVICES) for i, spec in enumerate(specs)]
        self.written = [False] * len(specs)

    def read(self, value: Any, field: str, expected: TensorType | None = None, what: str = "",
             device: str | None = None) -> int:
        """Check a buffer a command reads (written before; of type `expected`, on `device` if given)."""
        return self._use(value, field, False, expected, what, device)

    def write(self, value: Any, field: str, expected: TensorType, what: str, device: str | None = None) -> int:
        """Check a buffer a command writes (not written before; of type `expected`, on `device` if given)."""
        return self._use(value, field, True, expected, what, device)

    def _use(self, value: Any, field: str, write: bool, expected: TensorType | None, what: str,
             device: str | None) -> int:
        index = _index(value, field, len(self.types), "buffer")
        if self.written[index] == write:
            _fail(field, f"buffer {index} is " + ("written a second time" if write else "read before it is written"))
        self.written[index] = True
        if expected is not None and self.types[index] != expected:
            _fail(field, f"buffer {index} is {self.types[index]} but {what} is {expected}")
        if device is not None and self.devices[index] != device:
            _fail(field, f"buffer {index} is on {self.devices[index]}, but {what} must be on {device}")
        return index


# --- field checks: each raises HxbFormatError naming `path` -----------------------------------


def _fail(path: str, reason: str) -> NoReturn:
    raise HxbFormatError(path or "manifest", reason)


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return "an object" if value else "an empty object"
    if isinstance(value, list):
        return "an array" if value else "an empty array"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _object(value: Any, path: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    if not isinstance(value, dict):
        _fail(path, f"expected an object, got {_describe(value)}")
    for key in value:
        if key not in required and key not in optional:
            allowed = ", ".join(required + optional) or "none"
            _fail(f"{path}.{key}" if path else key, f"unknown key (allowed: {allowed})")
    for key in required:
        if key not in value:
            _fail(f"{path}.{key}" if path else key, "missing")
    return value


def _is_object(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        _fail(path, f"expected an object, got {_describe(value)}")
    return value


def _list(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        _fail(path, f"expected an array, got {_describe(value)}")
    return value


def _str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        _fail(path, f"expected a string, got {_describe(value)}")
    return value


def _identifier(value: Any, path: str) -> str:
    if not isinstance(value, str) or not _IDENTIFIER.fullmatch(value):
        _fail(path, f"expected an identifier ([A-Za-z_][A-Za-z0-9_]*), got {_describe(value)}")
    return value


def _int(value: Any, path: str, minimum: int = 0, alternative: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(path, f"expected an integer >= {minimum}{alternative}, got {_describe(value)}")
    if value >= 2**63:  # every count and offset is an int64 somewhere (ctypes, numpy, the kernels)
        _fail(path, f"{value} does not fit in int64")
    return value


def _choice(value: Any, path: str, options: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in options:
        _fail(path, f"expected one of {', '.join(options)}, got {_describe(value)}")
    return value


def _index(value: Any, path: str, count: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < count:
        _fail(path, f"expected a {what} index in [0, {count}), got {_describe(value)}")
    return value


def _json(value: Any) -> str:
    return json.dumps(value)


def _dim(value: Any, path: str, symbolic: bool) -> Dim:
    if symbolic and isinstance(value, str):
        return _identifier(value, path)
    return _int(value, path, 0, " or a symbol" if symbolic else "")


def _tensor(value: Any, path: str, extra: tuple[str, ...] = (), symbolic: bool = True) -> TensorType:
    _object(value, path, ("shape", "dtype", *extra))
    shape = _list(value["shape"], f"{path}.shape")
    tensor = TensorType(tuple(_dim(size, f"{path}.shape[{i}]", symbolic) for i, size in enumerate(shape)),
                        _choice(value["dtype"], f"{path}.dtype", tuple(DTYPES)))
    # Every extent, and the bytes the shape makes with each 0 counted as 1: a 0 elsewhere must not
    # hide an extent that overflows int64 (ctypes, numpy and the kernels all count in int64).
    nbytes = math.prod(dim or 1 for dim in tensor.shape if isinstance(dim, int)) * tensor.itemsize
    if nbytes >= 2**63:
        _fail(f"{path}.shape", f"{tensor} is too large (2^63 bytes or more, even with its zero extents as 1)")
    return tensor


def _expr(value: Any, path: str, symbols: list[str], depth: int = 0) -> Expr:
    """A checked size expression (lists become tuples) whose symbols are among `symbols`."""
    if isinstance(value, str):
        if _identifier(value, path) not in symbols:
            _fail(path, f"symbol {value!r} is no dimension of the kernel's args ({', '.join(symbols) or 'none'})")
        return value
    if not isinstance(value, list):
        return _int(value, path)
    if depth == EXPR_DEPTH:
        _fail(path, f"size expressions nest at most {EXPR_DEPTH} deep")
    if len(value) != 3:
        _fail(path, f"expected an int, a symbol or [op, expr, expr], got {len(value)} items")
    op = _choice(value[0], f"{path}[0]", EXPR_OPS)
    left = _expr(value[1], f"{path}[1]", symbols, depth + 1)
    if op == "ceildiv" and (isinstance(value[2], (str, list)) or _int(value[2], f"{path}[2]") < 1):
        _fail(f"{path}[2]", f"ceildiv divides by a literal integer >= 1, got {_describe(value[2])}")
    return (op, left, _expr(value[2], f"{path}[2]", symbols, depth + 1))
