"""The compile cache on disk: .hxb modules keyed by what made them, shared by every process.

The key hashes the traced hexir module (its text with the constants' bytes, so captured
weights are part of it without being stored twice), the compile options, the bytes of every
custom kernel file it names, and the compiler itself (its version and the size and time of
each of its source files, so an edited compiler never serves old code). An entry is
`<folder>/<sha256>.hxb`, written to a temporary file and renamed into place (atomic: several
processes may fill the same folder). A hit is decoded before it is used; an entry that does
not decode (truncated, foreign) is rebuilt. Each hit touches the entry's time; after a write,
the least recently used entries go until the folder holds at most `MAX_BYTES`.

The folder is `$HEXIR_CACHE_DIR`, else `$XDG_CACHE_HOME/hexir`, else `~/.cache/hexir`;
`HEXIR_CACHE_DIR=` (set and empty) turns the cache off, as does `hexir.jit(cache=False)`.
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
import time
import warnings
from pathlib import Path

import hexir_runtime
from hexir_runtime.format import decode
from mlir import ir

from hexir.dialects import hexir as hx
from hexir.driver import Options, compile_module
from hexir.version import __version__

#: The most bytes the cache folder holds; the least recently used entries go first.
MAX_BYTES = 512 * 2**20


def directory() -> Path | None:
    """The cache folder, or None when the cache is off (`HEXIR_CACHE_DIR=`)."""
    folder = os.environ.get("HEXIR_CACHE_DIR")
    if folder is not None:
        return Path(folder) if folder else None
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hexir"


@functools.cache
def _compiler_fingerprint() -> str:
    """The compiler's version and every source file's size and time (and the runtime's version)."""
    package = Path(__file__).resolve().parent
    stats = sorted((str(p.relative_to(package)), p.stat().st_size, p.stat().st_mtime_ns) for p in package.rglob("*.py"))
    return f"{__version__} {hexir_runtime.__version__} {stats}"


def key(module: ir.Module, options: Options) -> str:
    """The cache key of a traced module compiled with `options` (hex sha256)."""
    digest = hashlib.sha256(f"{_compiler_fingerprint()}\n{options!r}\n".encode())
    digest.update(module.operation.get_asm(large_elements_limit=16).encode())
    for op in hx.main_function(module).regions[0].blocks[0].operations:
        if op.name == "hexir.constant":
            digest.update(hx.constant_array(op.operation).tobytes())
        elif op.name == "hexir.custom_call":
            for _, path in sorted(hx.objects_of(op.operation).items()):
                digest.update(Path(path).read_bytes())
    return digest.hexdigest()


def compile_cached(module: ir.Module, options: Options, use: bool = True) -> bytes:
    """The .hxb bytes of `module`: from the cache when it holds them, else compiled and stored."""
    folder = directory() if use else None
    if folder is None:
        return compile_module(module, options)
    path = folder / f"{key(module, options)}.hxb"
    try:
        data = path.read_bytes()
        decode(data)  # a corrupt or foreign entry raises here and is rebuilt
        os.utime(path)
        return data
    except (OSError, hexir_runtime.HxbFormatError):
        pass
    data = compile_module(module, options)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".tmp-", delete=False) as temporary:
            temporary.write(data)
        os.replace(temporary.name, path)
        evict(folder)
    except OSError as error:
        _warn_once(f"hexir: the compile cache in {folder} cannot be written ({error.strerror}); "
                   "compiling without it (HEXIR_CACHE_DIR= turns it off)")
    return data


def evict(folder: Path, limit: int | None = None) -> None:
    """Remove the least recently used entries until `folder` holds at most `limit` bytes (and
    temporary files left by a writer that died an hour ago)."""
    entries = []
    for path in folder.iterdir():
        try:
            stat = path.stat()
        except OSError:
            continue  # removed by another process meanwhile
        if path.name.startswith(".tmp-") and stat.st_mtime < time.time() - 3600:
            path.unlink(missing_ok=True)
        elif path.suffix == ".hxb":
            entries.append((stat.st_mtime, stat.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= (MAX_BYTES if limit is None else limit):
            break
        path.unlink(missing_ok=True)
        total -= size


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=4)
