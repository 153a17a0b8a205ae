"""The .hxb module format, version 1: read, check and write (docs/hxb-format.md).

A file is checked twice before anything uses it: first its structure (header, manifest bytes,
the blob table against the file's bytes), then its meaning (keys, types, indices, shapes, the
host programs). The first rule broken raises `HxbFormatError` naming the field, e.g.
`kernels[2].args[1].dtype: expected one of float32, float64, got 'int8'`. The compiler writes
through `encode`, which runs the same checks on its own output.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
import zlib
from dataclasses import dataclass
from typing import Any, NoReturn

from .errors import HxbFormatError

MAGIC = b"\x89HXB\r\n\x1a\n"
VERSION = 1
# magic, version, header_size, manifest_offset, manifest_size, manifest_crc32, reserved
HEADER = struct.Struct("<8sIIQQII")
ALIGNMENT = 64
DTYPES = {"float32": 4, "float64": 8}
DEVICES = ("cpu", "cuda")
HOST = "cpu"
KERNEL_OPS = {  # op -> its args in call order (destination last)
    "linear": ("x[M, K]", "w[K, N]", "out[M, N]"),
    "linear_bias": ("x[M, K]", "w[K, N]", "bias[N]", "out[M, N]"),
    "linear_relu": ("x[M, K]", "w[K, N]", "out[M, N]"),
    "linear_bias_relu": ("x[M, K]", "w[K, N]", "bias[N]", "out[M, N]"),
    "relu": ("x", "out of the same shape"),
    "custom": ("1 to 4 inputs of any shapes", "out"),
}
COMMANDS = {  # host program op -> its other fields
    "input": ("index", "dst"),
    "constant": ("constant", "dst"),
    "call": ("kernel", "args"),
    "transfer": ("src", "dst"),
    "print": ("src",),
    "return": ("srcs",),
}
_COMMAND_FIELDS = tuple(sorted({field for fields in COMMANDS.values() for field in fields}))
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_IMAGE = re.compile(r"(sm|compute)_[0-9]+|fatbin")
# A kernel's keys beyond name, op, device, symbol and args, by (device, custom): (required, optional).
_KERNEL_KEYS = {
    ("cpu", False): (("parallel_extent",), ()),
    ("cpu", True): (("scalars", "source"), ("library",)),
    ("cuda", False): (("launch", "images"), ("cpu_fallback",)),
    ("cuda", True): (("scalars", "source", "launch", "images"), ("cpu_fallback",)),
}
_OPTIONAL_KERNEL_KEYS = tuple(dict.fromkeys(key for keys in _KERNEL_KEYS.values() for key in sum(keys, ())))
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class TensorType:
    """A tensor's shape and dtype name; prints as `float32[2, 8]`."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype]

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"


@dataclass(frozen=True)
class Hxb:
    """A decoded and fully checked .hxb file: its manifest and its bytes."""

    manifest: dict[str, Any]
    data: bytes

    @property
    def version(self) -> int:
        return VERSION

    def blob(self, index: int) -> memoryview:
        """The bytes of blob `index` (a read-only view into the file)."""
        entry = self.manifest["blobs"][index]
        return memoryview(self.data)[entry["offset"] : entry["offset"] + entry["size"]]


def decode(data: bytes | bytearray | memoryview) -> Hxb:
    """Check `data` (structure, then meaning) and return it decoded; raises HxbFormatError."""
    data = bytes(data)
    manifest = _check_structure(data)
    _check_meaning(manifest)
    return Hxb(manifest, data)


def read(path: str | os.PathLike[str]) -> Hxb:
    """Read and decode the .hxb file at `path` (OSError if it cannot be read)."""
    with open(path, "rb") as file:
        return decode(file.read())


def encode(manifest: dict[str, Any], blobs: list[tuple[str, bytes]]) -> bytes:
    """Lay out a .hxb file: `manifest` without its `blobs` key, plus (name, bytes) blobs.

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


# --- structure: header, manifest bytes, blob table -------------------------------------------


def _check_structure(data: bytes) -> dict[str, Any]:
    if not data.startswith(MAGIC):
        if 0 < len(data) < len(MAGIC) and MAGIC.startswith(data):
            _fail("header", f"truncated: the file has {len(data)} bytes, the header {HEADER.size}")
        _fail("header.magic", "not a hexir module (bad magic)")
    if len(data) < HEADER.size:
        _fail("header", f"truncated: the file has {len(data)} bytes, the header {HEADER.size}")
    _, version, header_size, offset, size, crc, reserved = HEADER.unpack_from(data)
    if version != VERSION:
        _fail("header.version", f"version {version} is not supported; this runtime reads version {VERSION}")
    for field, value, expected in [
        ("header_size", header_size, HEADER.size),
        ("manifest_offset", offset, HEADER.size),
        ("reserved", reserved, 0),
    ]:
        if value != expected:
            _fail(f"header.{field}", f"expected {expected}, got {value}")
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
    return manifest


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


# --- meaning: keys, types, indices, kernels, host programs -----------------------------------


def _check_meaning(manifest: dict[str, Any]) -> None:
    _object(manifest, "", ("producer", "blobs", "constants", "kernels", "entries"), ("cpu",))
    _str(manifest["producer"], "producer")
    blob_sizes = [blob["size"] for blob in manifest["blobs"]]
    for i, constant in enumerate(_list(manifest["constants"], "constants")):
        path = f"constants[{i}]"
        tensor = _tensor(constant, path, ("name", "blob"))
        _str(constant["name"], f"{path}.name")
        blob = _index(constant["blob"], f"{path}.blob", len(blob_sizes), "blob")
        if blob_sizes[blob] != tensor.nbytes:
            _fail(f"{path}.blob", f"blob {blob} has {blob_sizes[blob]} bytes; {tensor} needs {tensor.nbytes}")
    kernels = _list(manifest["kernels"], "kernels")
    for i, kernel in enumerate(kernels):
        _check_kernel(kernel, f"kernels[{i}]", len(blob_sizes))
    cpu_code = [i for i, kernel in enumerate(kernels) if _uses_cpu_library(kernel)]
    if cpu_code and "cpu" not in manifest:
        _fail("cpu", f"missing, but kernels[{cpu_code[0]}] has cpu code and no library of its own")
    if "cpu" in manifest:
        if not cpu_code:
            _fail("cpu", "present, but no kernel has cpu code in cpu.library (a cpu kernel or a cpu_fallback "
                         "without a library of its own)")
        cpu = _object(manifest["cpu"], "cpu", ("arch", "cpu", "features", "library"))
        _str(cpu["arch"], "cpu.arch")
        _str(cpu["cpu"], "cpu.cpu")
        for i, feature in enumerate(_list(cpu["features"], "cpu.features")):
            _str(feature, f"cpu.features[{i}]")
        _index(cpu["library"], "cpu.library", len(blob_sizes), "blob")
    entries = _list(manifest["entries"], "entries")
    if not entries:
        _fail("entries", "empty: a module needs at least one entry")
    names: set[str] = set()
    for i, entry in enumerate(entries):
        _check_entry(entry, f"entries[{i}]", manifest, names)


def _uses_cpu_library(kernel: dict[str, Any]) -> bool:
    """Whether a (checked) kernel has cpu code in `cpu.library` rather than in a library of its own."""
    code = kernel if kernel["device"] == "cpu" else kernel.get("cpu_fallback")
    return code is not None and "library" not in code


def _check_kernel(kernel: Any, path: str, blob_count: int) -> None:
    _object(kernel, path, ("name", "op", "device", "symbol", "args"), _OPTIONAL_KERNEL_KEYS)
    _str(kernel["name"], f"{path}.name")
    op = _choice(kernel["op"], f"{path}.op", tuple(KERNEL_OPS))
    device = _choice(kernel["device"], f"{path}.device", DEVICES)
    custom = op == "custom"
    required, optional = _KERNEL_KEYS[device, custom]
    for key in _OPTIONAL_KERNEL_KEYS:
        if key in kernel and key not in required + optional:
            _fail(f"{path}.{key}", f"only {_kernels_with(key)} have this key")
        if key in required and key not in kernel:
            _fail(f"{path}.{key}", f"missing ({_kernels_with(key)} need it)")
    _identifier(kernel["symbol"], f"{path}.symbol")
    _check_args(op, _list(kernel["args"], f"{path}.args"), f"{path}.args")
    if custom:  # its code takes every dimension of every arg, in order, after the pointers
        _check_custom_code(kernel, path, blob_count)
        dims = [size for arg in kernel["args"] for size in arg["shape"]]
        scalars = _list(kernel["scalars"], f"{path}.scalars")
        for j, scalar in enumerate(scalars):
            _int(scalar, f"{path}.scalars[{j}]")
        if scalars != dims:
            _fail(f"{path}.scalars", f"expected the dimensions of every arg in order, {dims}, got {scalars}")
    if device == "cpu":
        if not custom:
            _int(kernel["parallel_extent"], f"{path}.parallel_extent")
        return
    launch = _object(kernel["launch"], f"{path}.launch", ("grid", "block", "shared_bytes"))
    for key in ("grid", "block"):
        sizes = _list(launch[key], f"{path}.launch.{key}")
        if len(sizes) != 3:
            _fail(f"{path}.launch.{key}", f"expected [x, y, z], got {len(sizes)} numbers")
        for j, size in enumerate(sizes):
            _int(size, f"{path}.launch.{key}[{j}]", minimum=1)
    _int(launch["shared_bytes"], f"{path}.launch.shared_bytes")
    images = kernel["images"]
    if not isinstance(images, dict) or not images:
        _fail(f"{path}.images", f"expected an object of sm_NN/compute_NN images, got {_describe(images)}")
    for arch, blob in images.items():
        if not _IMAGE.fullmatch(arch):
            _fail(f"{path}.images.{arch}", "expected sm_<number> (CUBIN), compute_<number> (PTX) or fatbin")
        if arch == "fatbin" and not custom:
            _fail(f"{path}.images.fatbin", "only custom kernels have a fatbin image")
        _index(blob, f"{path}.images.{arch}", blob_count, "blob")
    if "cpu_fallback" in kernel:
        where = f"{path}.cpu_fallback"
        keys = (("symbol", "source"), ("library",)) if custom else (("symbol", "parallel_extent"), ())
        fallback = _object(kernel["cpu_fallback"], where, *keys)
        _identifier(fallback["symbol"], f"{where}.symbol")
        if custom:
            _check_custom_code(fallback, where, blob_count)
        else:
            _int(fallback["parallel_extent"], f"{where}.parallel_extent")


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


def _check_custom_code(code: dict[str, Any], path: str, blob_count: int) -> None:
    """The `source` of a custom kernel (or of its cpu_fallback) and its own `library`, if any."""
    if not isinstance(code["source"], str) or not code["source"]:
        _fail(f"{path}.source", f"expected a file name (a non-empty string), got {_describe(code['source'])}")
    if "library" in code:
        _index(code["library"], f"{path}.library", blob_count, "blob")


def _check_args(op: str, specs: list[Any], path: str) -> None:
    """A kernel's args: their types and access, and the shapes its op needs."""
    args = [_tensor(arg, f"{path}[{j}]", ("access",)) for j, arg in enumerate(specs)]
    for j, arg in enumerate(specs):
        _choice(arg["access"], f"{path}[{j}].access", ("write",) if j == len(args) - 1 else ("read",))
    if op == "custom":  # any shapes; float32 and float64 may mix
        if not 2 <= len(args) <= 5:
            _fail(path, f"custom takes 2 to 5 args (1 to 4 inputs, then out), got {len(args)}")
        return
    expected = ", ".join(KERNEL_OPS[op])
    if len(args) != len(KERNEL_OPS[op]):
        _fail(path, f"{op} takes {len(KERNEL_OPS[op])} args ({expected}), got {len(args)}")
    for j, arg in enumerate(args):
        if arg.dtype != args[0].dtype:
            _fail(f"{path}[{j}].dtype", f"expected {args[0].dtype} like args[0], got {arg.dtype!r}")
    shapes = [arg.shape for arg in args]
    if op == "relu":
        consistent = shapes[0] == shapes[1]
    else:
        x, w, out = shapes[0], shapes[1], shapes[-1]
        consistent = len(x) == 2 and len(w) == 2 and x[1] == w[0] and out == (x[0], w[1])
        consistent = consistent and (len(args) == 3 or shapes[2] == w[1:])
    if not consistent:
        _fail(path, f"{op} expects {expected}, got {', '.join(map(str, args))}")


def _check_entry(entry: Any, path: str, manifest: dict[str, Any], names: set[str]) -> None:
    _object(entry, path, ("name", "inputs", "outputs", "buffers", "program"))
    name = _identifier(entry["name"], f"{path}.name")
    if name in names:
        _fail(f"{path}.name", f"a second entry named {name!r}")
    names.add(name)
    inputs = []
    for i, spec in enumerate(_list(entry["inputs"], f"{path}.inputs")):
        inputs.append(_tensor(spec, f"{path}.inputs[{i}]", ("name",)))
        input_name = _identifier(spec["name"], f"{path}.inputs[{i}].name")
        if input_name in [other["name"] for other in entry["inputs"][:i]]:
            _fail(f"{path}.inputs[{i}].name", f"a second input named {input_name!r}")
    outputs = _list(entry["outputs"], f"{path}.outputs")
    outputs = [_tensor(spec, f"{path}.outputs[{i}]") for i, spec in enumerate(outputs)]
    buffers = _Buffers(_list(entry["buffers"], f"{path}.buffers"), f"{path}.buffers")
    kernels, constants = manifest["kernels"], manifest["constants"]
    bound = [False] * len(inputs)
    program = _list(entry["program"], f"{path}.program")
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
            buffers.write(command["dst"], f"{where}.dst", inputs[i], f"input {i}", HOST)
        elif op == "constant":
            k = _index(command["constant"], f"{where}.constant", len(constants), "constant")
            constant = TensorType(tuple(constants[k]["shape"]), constants[k]["dtype"])
            buffers.write(command["dst"], f"{where}.dst", constant, f"constant {k}")
        elif op == "call":
            k = _index(command["kernel"], f"{where}.kernel", len(kernels), "kernel")
            specs, device = kernels[k]["args"], kernels[k]["device"]
            args = _list(command["args"], f"{where}.args")
            if len(args) != len(specs):
                _fail(f"{where}.args", f"kernels[{k}] takes {len(specs)} args, got {len(args)}")
            for j, (arg, spec) in enumerate(zip(args, specs, strict=True)):
                use = buffers.write if j == len(args) - 1 else buffers.read
                expected = TensorType(tuple(spec["shape"]), spec["dtype"])
                use(arg, f"{where}.args[{j}]", expected, f"kernels[{k}].args[{j}]", device)
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
    if not program or program[-1]["op"] != "return":
        _fail(f"{path}.program", "the last command must be a return")
    for i in range(len(inputs)):
        if not bound[i]:
            _fail(f"{path}.inputs[{i}]", "never bound by an input command")
    for i in range(len(buffers.types)):
        if not buffers.written[i]:
            _fail(f"{path}.buffers[{i}]", "never written")


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


def _int(value: Any, path: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(path, f"expected an integer >= {minimum}, got {_describe(value)}")
    return value


def _choice(value: Any, path: str, options: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in options:
        _fail(path, f"expected one of {', '.join(options)}, got {_describe(value)}")
    return value


def _index(value: Any, path: str, count: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < count:
        _fail(path, f"expected a {what} index in [0, {count}), got {_describe(value)}")
    return value


def _tensor(value: Any, path: str, extra: tuple[str, ...] = ()) -> TensorType:
    _object(value, path, ("shape", "dtype", *extra))
    shape = tuple(_int(size, f"{path}.shape[{i}]") for i, size in enumerate(_list(value["shape"], f"{path}.shape")))
    tensor = TensorType(shape, _choice(value["dtype"], f"{path}.dtype", tuple(DTYPES)))
    if tensor.nbytes >= 2**63:
        _fail(f"{path}.shape", f"{tensor} is too large ({tensor.nbytes} bytes)")
    return tensor
