"""The container: header, manifest bytes and blob table (the structure check), and `decode`,
`read`, `encode` and `write`, which run every check. A signed file is checked as the module
before its signature record (signing.py)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import zlib
from dataclasses import dataclass
from typing import Any

from .checks import _check_meaning
from .fields import _describe, _fail, _int, _is_object, _list, _no_constant, _object, _str, _unique_keys
from .types import Manifest
from .upgrade import _upgrade_cpu, _upgrade_epilogues, _upgrade_v1

MAGIC = b"\x89HXB\r\n\x1a\n"
VERSION = 5  # what encode writes
# What decode reads: version 1 is upgraded to 2; 3 is 2 with work records' `spans`; 4 says what a
# kernel computes in `expr` where 1 to 3 had `epilogues` (upgraded to it).
READABLE = (1, 2, 3, 4, 5)
# magic, version, header_size, manifest_offset, manifest_size, manifest_crc32, flags
HEADER = struct.Struct("<8sIIQQII")
SIGNED = 1  # the one header flag: the file ends with a signature record (signing.py)
ALIGNMENT = 64
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Hxb:
    """A decoded and fully checked .hxb file: its typed manifest, the manifest's (version-4,
    upgraded) JSON, the file's bytes and the version it was written in."""

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
    from ..signing import split  # (signing imports this module)

    data = bytes(data)
    version, manifest = _check_structure(split(data)[0])  # a signed file: the module before its record
    if version == 1:
        manifest = _upgrade_v1(manifest)
    if version < 4:
        manifest = _upgrade_epilogues(manifest, version)
    manifest = _upgrade_cpu(manifest)
    return Hxb(_check_meaning(manifest), manifest, data, version)


def read(path: str | os.PathLike[str]) -> Hxb:
    """Read and decode the .hxb file at `path` (OSError if it cannot be read)."""
    with open(path, "rb") as file:
        return decode(file.read())


def encode(manifest: dict[str, Any], blobs: list[tuple[str, bytes]]) -> bytes:
    """Lay out a version-5 .hxb file: `manifest` without its `blobs` key, plus (name, bytes) blobs.

    The manifest refers to blobs by their index in `blobs`; this function computes their
    offsets, sizes and checksums and the header, then decodes the result so that an invalid
    module raises HxbFormatError here rather than in the runtime.
    """
    _is_object(manifest, "manifest")
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
    _is_object(manifest, "manifest")
    if "blobs" not in manifest:
        _fail("blobs", "missing")
    _check_blob_table(data, _list(manifest["blobs"], "blobs"), end)
    return version, manifest


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
