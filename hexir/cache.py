"""The compile cache on disk: .hxb modules keyed by what made them, shared by one user's processes.

The key (sha256) covers every input of the compile:
- the traced hexir module: its text with the constants' bytes (captured weights are in the key
  without being stored twice), and the compile options;
- every custom kernel file it names and what that file includes: a .c file's headers as the C
  compiler lists them (`cc -MM`), a .cu file's `#include "..."` files, followed recursively in
  the including file's folder, the kernel search path and the working folder (NVRTC's);
- the definition of every registered op it uses (`_describe`: a function's bytecode, constants,
  defaults, closure and the globals it names, recursively);
- the compiler: its version and the runtime's, each .py file's size and time, the bytes of its
  other files (`backend/pool.c`), the C compiler's `--version`, the MLIR/LLVM/CUDA wheels.

The cache trusts only itself. The folder is created 0700; an existing folder that is not the
user's, or that others can write to, is not used (one warning, compiles go on without it). An
entry, `<folder>/<key>.hxc`, is 32 bytes of HMAC-SHA256(secret, key + module) then the .hxb
bytes, the secret being 32 random bytes in `<folder>/.secret` (a regular 0600 file of the user,
created atomically; any other is refused). An entry is opened without following links and used
only if it is a regular file of the user, at most `MAX_BYTES`, whose tag matches: anything else
(a link, a FIFO, a device, a planted, swapped or renamed entry) is rebuilt, not run. Entries are
written to a temporary file and renamed into place (several processes may fill one folder);
each hit touches its entry, and after a write the least recently used entries go until the
folder holds at most `MAX_BYTES`.

The folder is `$HEXIR_CACHE_DIR`, else `$XDG_CACHE_HOME/hexir`, else `~/.cache/hexir`;
`HEXIR_CACHE_DIR=` (set and empty) turns the cache off, as does `hexir.jit(cache=False)`.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import hmac
import os
import re
import secrets
import stat
import subprocess
import sys
import sysconfig
import time
import types
import warnings
from pathlib import Path
from typing import Any

import hexir_runtime
import numpy as np
from mlir import ir

from hexir import ops
from hexir.backend.toolchain import c_compiler, run_tool
from hexir.dialects import hexir as hx
from hexir.driver import Options, compile_module
from hexir.errors import CompileError
from hexir.frontend.trace import user_frame
from hexir.version import __version__

#: The most bytes the cache folder holds (and the largest entry read); the least recently used go first.
MAX_BYTES = 512 * 2**20
#: The compiler's own files, part of every key.
PACKAGE = Path(__file__).resolve().parent
_HEXIR = str(PACKAGE) + os.sep  # its code is in the fingerprint: an op's functions from here are named

_SUFFIX = ".hxc"
_SECRET = ".secret"
_TAG_BYTES = 32
_OPEN_ENTRY = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a FIFO opens at once, a link not at all
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class _Refused(Exception):
    """The folder or its secret is not trusted: compile without the cache."""


class _Uncacheable(Exception):
    """A registered op's definition that cannot be described: compile without the cache."""


class _Untrusted(Exception):
    """An entry that is not one this user's hexir wrote for this key: rebuild it."""


def directory() -> Path | None:
    """The cache folder, or None when the cache is off (`HEXIR_CACHE_DIR=`)."""
    folder = os.environ.get("HEXIR_CACHE_DIR")
    if folder is not None:
        return Path(folder) if folder else None
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hexir"


# ---- the key -----------------------------------------------------------------------------

@functools.cache
def _compiler_fingerprint() -> str:
    """What of the compiler can change its output, read once per process."""
    parts = [__version__, hexir_runtime.__version__, _c_compiler_version(), *_wheels()]
    for path in sorted(PACKAGE.rglob("*")):
        if "__pycache__" in path.parts or not path.is_file():
            continue
        name = path.relative_to(PACKAGE)
        if path.suffix == ".py":  # size and time: cheap, and an edit changes the time
            parts.append(f"{name} {path.stat().st_size} {path.stat().st_mtime_ns}")
        else:  # pool.c and the like: few bytes, hashed
            parts.append(f"{name} {hashlib.sha256(path.read_bytes()).hexdigest()}")
    return "\n".join(parts)


def _c_compiler_version() -> str:
    """The C compiler (it builds pool.c, the custom kernels and links every cpu library): its
    path and `--version` output."""
    try:
        compiler = c_compiler()
        done = subprocess.run([compiler, "--version"], capture_output=True, timeout=120)
    except (CompileError, OSError, subprocess.TimeoutExpired) as error:
        return f"no C compiler: {error}"  # the compile itself then fails and says why
    return f"{os.path.realpath(compiler)} {done.returncode} {done.stdout.decode(errors='replace')}"


def _wheels() -> list[str]:
    """The MLIR, LLVM and CUDA wheels beside the MLIR bindings, by their dist-info names
    (which carry the version): one directory listing, where importlib.metadata takes ~40 ms."""
    site = Path(ir.__file__).resolve().parents[1]
    return sorted(n for n in os.listdir(site) if n.endswith(".dist-info") and n.startswith(("xtc_", "nvidia_")))


def key(module: ir.Module, options: Options) -> str:
    """The cache key of a traced module compiled with `options` (hex sha256)."""
    digest = hashlib.sha256(f"{_compiler_fingerprint()}\n{options!r}\n".encode())
    digest.update(module.operation.get_asm(large_elements_limit=16).encode())
    used = set()
    for op in hx.main_function(module).regions[0].blocks[0].operations:
        if op.name == "hexir.constant":
            digest.update(hx.constant_array(op.operation).tobytes())
        elif op.name == "hexir.custom_call":
            for _, path in sorted(hx.objects_of(op.operation).items()):
                try:
                    files = _kernel_files(Path(path), options.kernel_search_path)
                except CompileError:  # the compile itself says what is wrong with the file
                    raise _Uncacheable(f"the headers of {path}") from None
                for file in files:
                    _put(digest, str(file), file.read_bytes() if file.is_file() else b"<missing>")
        elif ops.family_of(op.operation) == "contract":
            used.add(op.name)
    # A pointwise or reduce op's meaning is its tree, in the module's text above (`expr`); a
    # contract op's is its code: what reaches the kernel (`shape` shows in the module's types).
    for name in sorted(used):
        definition = ops.lookup(name)
        _put(digest, name)
        try:
            _describe(digest, (definition.operands, definition.schedules, definition.variants), {})
        except Exception as error:  # too deep (RecursionError), a repr that raises: no key, no cache
            raise _Uncacheable(f"{name}: {type(error).__name__}") from None
    return digest.hexdigest()


_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"\n]+)"', re.MULTILINE)


def _kernel_files(path: Path, search_path: tuple[str, ...]) -> list[Path]:
    """A custom kernel's file and every file its build reads: a .c file's headers from the C
    compiler itself; a .cu file's quoted includes, each looked for where NVRTC may find it."""
    if path.suffix == ".c" and path.is_file():
        rule = run_tool([c_compiler(), "-MM", "-MT", "k", str(path)], f"listing the headers of {path}").stdout
        names = re.split(r"(?<!\\)\s+", os.fsdecode(rule).split(":", 1)[1].replace("\\\n", " ").strip())
        return [Path(n.replace("\\ ", " ")).resolve() for n in names if n]  # the source first
    files, pending = [], [path]
    while pending:
        file = pending.pop()
        if file in files:
            continue
        files.append(file)
        if path.suffix != ".cu" or not file.is_file():
            continue
        for name in _INCLUDE.findall(file.read_bytes()):
            for folder in (file.parent, *map(Path, search_path), Path.cwd()):
                candidate = (folder / os.fsdecode(name)).resolve()
                if candidate.is_file():
                    pending.append(candidate)
    return files


def _put(digest: Any, *parts: str | bytes) -> None:
    """Each part, length-prefixed: no two sequences of parts feed the same bytes."""
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        digest.update(b"%d:" % len(data) + data)


_LIBRARIES = tuple(sorted({sysconfig.get_paths()[k] + os.sep for k in ("stdlib", "platstdlib", "purelib", "platlib")}))


def _is_library(filename: str | None) -> bool:
    """Code of hexir itself or of an installed package or the standard library: named (see
    `_put_named`), not described."""
    return not filename or filename.startswith((_HEXIR, *_LIBRARIES, "<frozen"))


def _put_named(digest: Any, kind: str, module: str, qualname: str, filename: str | None) -> None:
    """A library's function or class by name, with its file's size and time (hexir's own files
    are in the fingerprint): an edited installed package changes the key too."""
    _put(digest, kind, module or "", qualname)
    if filename and not filename.startswith(_HEXIR):
        try:
            status = os.stat(filename)
            _put(digest, f"{status.st_size} {status.st_mtime_ns}")
        except OSError:  # frozen or built in
            _put(digest, "<no file>")


def _describe(digest: Any, value: Any, seen: dict[int, Any]) -> None:
    """Feed `digest` what `value` (part of an op's definition) computes, the same in every process.

    A function is its bytecode, constants and names (recursively through nested functions),
    its defaults, its closure's values and the values of the globals it names, so two
    definitions that differ in any of them (`MaximumFOp` or `MinimumFOp`, 2.0 or 3.0, a captured
    or global constant) get different keys. Bytecode, not source text: a lambda defined in
    `exec`/a REPL has no source, a source line holds more than its lambda, and neither shows a
    closure's or a global's value. hexir's, the standard library's and installed packages'
    functions and classes are named instead (`_put_named`). An object described by none of
    the rules feeds its repr: where that names an address the key differs in each process, so
    such an op is compiled each time, never served another's code."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        _put(digest, type(value).__name__, repr(value))
        return
    if id(value) in seen:
        _put(digest, "<again>")
        return
    seen[id(value)] = value  # held, so that no temporary's id is reused while describing
    if isinstance(value, (tuple, list, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        _put(digest, type(value).__name__, str(len(items)))
        for item in items:
            _describe(digest, item, seen)
    elif isinstance(value, dict):
        _put(digest, "dict", str(len(value)))
        for item_key in sorted(value, key=repr):
            _describe(digest, item_key, seen)
            _describe(digest, value[item_key], seen)
    elif isinstance(value, np.ndarray):
        _put(digest, "ndarray", value.dtype.str, repr(value.shape), np.ascontiguousarray(value).tobytes())
    elif isinstance(value, types.CodeType):
        _put(digest, "code", value.co_code, repr(value.co_names), str(value.co_argcount), str(value.co_flags))
        _describe(digest, value.co_consts, seen)
    elif isinstance(value, types.FunctionType):
        _describe_function(digest, value, seen)
    elif isinstance(value, types.MethodType):
        _describe(digest, (value.__func__, value.__self__), seen)
    elif isinstance(value, functools.partial):
        _describe(digest, (value.func, value.args, value.keywords), seen)
    elif isinstance(value, types.ModuleType):
        _put(digest, "module", value.__name__)
    elif isinstance(value, type):
        file = getattr(sys.modules.get(value.__module__), "__file__", None) or "<no file>"  # a REPL's, exec's
        if value.__module__ in sys.builtin_module_names or _is_library(file):
            _put_named(digest, "type", value.__module__, value.__qualname__, file)
        else:  # a class of the user's: its methods and attributes
            _put(digest, "type", value.__module__, value.__qualname__)
            _describe(digest, dict(vars(value)), seen)
    elif hasattr(value, "__dict__"):  # an object, e.g. a callable one: its class (methods) and its state
        _describe(digest, (type(value), dict(vars(value))), seen)
    else:
        _put(digest, "repr", repr(value))


def _describe_function(digest: Any, function: types.FunctionType, seen: dict[int, Any]) -> None:
    code = function.__code__
    if _is_library(code.co_filename):
        _put_named(digest, "function", function.__module__, f"{function.__qualname__}:{code.co_firstlineno}",
                   code.co_filename)
        return
    _describe(digest, (code, function.__defaults__, function.__kwdefaults__), seen)
    for cell in function.__closure__ or ():
        try:
            _describe(digest, cell.cell_contents, seen)
        except ValueError:  # a cell not filled yet
            _put(digest, "<empty cell>")
    names, codes = set(), [code]
    while codes:  # the names of the function and of the functions it defines
        current = codes.pop()
        names.update(current.co_names)
        codes.extend(c for c in current.co_consts if isinstance(c, types.CodeType))
    for name in sorted(names):
        if name in function.__globals__:
            _put(digest, "global", name)
            _describe(digest, function.__globals__[name], seen)


# ---- the folder, its secret and its entries ----------------------------------------------

def _open_folder(folder: Path) -> int:
    """A descriptor of the cache folder (created 0700), or _Refused if it is not the user's
    alone. Every later step goes through the descriptor, so a folder swapped meanwhile is not used."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    status = os.fstat(descriptor)
    if status.st_uid != os.geteuid() or status.st_mode & 0o022:
        os.close(descriptor)
        if status.st_uid != os.geteuid():
            raise _Refused(f"belongs to uid {status.st_uid}, not to this user (uid {os.geteuid()})")
        raise _Refused(f"can be written by others (mode {stat.S_IMODE(status.st_mode):o})")
    return descriptor


def _secret(folder: int) -> bytes:
    """The folder's secret: 32 bytes in a regular 0600 file of the user, made if missing."""
    for _ in range(3):
        try:
            descriptor = os.open(_SECRET, _OPEN_ENTRY, dir_fd=folder)
        except FileNotFoundError:
            try:  # linked into place: a reader sees all of it or none; of processes racing, the first wins
                _put_in_place(folder, _SECRET, secrets.token_bytes(_TAG_BYTES), link=True)
            except FileExistsError:
                pass
            continue
        except OSError as error:
            raise _Refused(f"has a {_SECRET} that is not a regular 0600 file of this user ({error.strerror})") from None
        with open(descriptor, "rb") as file:
            status = os.fstat(descriptor)
            secret = file.read(_TAG_BYTES + 1) if stat.S_ISREG(status.st_mode) else b""
            if status.st_uid == os.geteuid() and not status.st_mode & 0o077 and len(secret) == _TAG_BYTES:
                return secret
        raise _Refused(f"has a {_SECRET} that is not a regular 0600 file of this user holding {_TAG_BYTES} bytes "
                       "(remove it to start the cache afresh)")
    raise _Refused(f"has a {_SECRET} that keeps disappearing")


def _put_in_place(folder: int, name: str, data: bytes, link: bool = False) -> None:
    """Write `data` to a temporary 0600 file and give it the name `name`: by renaming it (a link
    there is replaced, not its target) or, `link`, by linking it (FileExistsError if the name is
    taken). A reader never sees part of it; the temporary file never stays."""
    temporary = f".tmp-{secrets.token_hex(8)}"
    descriptor = os.open(temporary, _NEW_FILE, 0o600, dir_fd=folder)
    try:
        with open(descriptor, "wb") as file:
            os.fchmod(descriptor, 0o600)  # whatever the umask
            file.write(data)
        if link:
            os.link(temporary, name, src_dir_fd=folder, dst_dir_fd=folder, follow_symlinks=False)
        else:
            os.replace(temporary, name, src_dir_fd=folder, dst_dir_fd=folder)
    finally:
        _unlink(folder, temporary)


def _tag(secret: bytes, name: str, data: bytes) -> bytes:
    return hmac.new(secret, name.encode() + b"\0" + data, hashlib.sha256).digest()


def _read(folder: int, name: str, secret: bytes) -> bytes | None:
    """The module of entry `name` if it is one this user's hexir wrote under this name; None
    if there is none; _Untrusted (why) if there is another file."""
    try:
        descriptor = os.open(name, _OPEN_ENTRY, dir_fd=folder)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise _Untrusted("a symbolic link" if error.errno == errno.ELOOP else error.strerror) from None
    with open(descriptor, "rb") as file:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise _Untrusted("not a regular file")
        if status.st_uid != os.geteuid():
            raise _Untrusted(f"owned by uid {status.st_uid}")
        if status.st_size > MAX_BYTES + _TAG_BYTES:
            raise _Untrusted(f"{status.st_size} bytes, over MAX_BYTES")
        blob = file.read(status.st_size + 1)
        tag, data = blob[:_TAG_BYTES], blob[_TAG_BYTES:]
        if not hmac.compare_digest(tag, _tag(secret, name, data)):
            raise _Untrusted("its tag does not match: not written by this user's hexir under this name")
        os.utime(descriptor)  # the file opened, never a link's target
        return data


def compile_cached(module: ir.Module, options: Options, use: bool = True) -> bytes:
    """The .hxb bytes of `module`: from the cache when it holds them, else compiled and stored."""
    path = directory() if use else None
    if path is None:
        return compile_module(module, options)
    try:
        name = key(module, options) + _SUFFIX
    except _Uncacheable:
        return compile_module(module, options)
    try:
        folder = _open_folder(path)
    except (_Refused, OSError) as error:
        _warn_once(f"hexir: the compile cache folder {path} {_why(error)}; compiling without it "
                   "(HEXIR_CACHE_DIR names another folder, HEXIR_CACHE_DIR= turns it off)")
        return compile_module(module, options)
    try:
        try:
            secret = _secret(folder)
        except (_Refused, OSError) as error:
            _warn_once(f"hexir: the compile cache folder {path} {_why(error)}; compiling without it")
            return compile_module(module, options)
        try:
            data = _read(folder, name, secret)
            if data is not None:
                return data
        except (_Untrusted, OSError, MemoryError, ValueError) as error:
            _warn_once(f"hexir: an entry of the compile cache in {path} is {_why(error)}; it is rebuilt, not used")
        data = compile_module(module, options)
        try:
            _put_in_place(folder, name, _tag(secret, name, data) + data)
            _evict(folder)
        except OSError as error:
            _warn_once(f"hexir: the compile cache in {path} cannot be written ({error.strerror}); "
                       "compiling without it (HEXIR_CACHE_DIR= turns it off)")
        return data
    finally:
        os.close(folder)


def _why(error: Exception) -> str:
    if isinstance(error, (_Refused, _Untrusted)):
        return str(error)
    if isinstance(error, OSError):
        return f"unusable ({error.strerror or error})"
    return f"unreadable ({type(error).__name__})"


def evict(folder: Path, limit: int | None = None) -> None:
    """Remove the least recently used entries until `folder` holds at most `limit` bytes (and
    temporary files left by a writer that died an hour ago)."""
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _evict(descriptor, limit)
    finally:
        os.close(descriptor)


def _evict(folder: int, limit: int | None = None) -> None:
    entries = []
    with os.scandir(folder) as listing:
        for entry in listing:
            try:
                status = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # removed by another process meanwhile
            if entry.name.startswith(".tmp-") and status.st_mtime < time.time() - 3600:
                _unlink(folder, entry.name)
            elif entry.name.endswith((_SUFFIX, ".hxb")):  # .hxb: untagged entries of earlier hexir
                entries.append((status.st_mtime, status.st_size, entry.name))
    total = sum(size for _, size, _ in entries)
    for _, size, name in sorted(entries):
        if total <= (MAX_BYTES if limit is None else limit):
            break
        _unlink(folder, name)
        total -= size


def _unlink(folder: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=folder)
    except FileNotFoundError:
        pass


@functools.cache
def _warn_once(message: str) -> None:
    caller = user_frame()  # the user's line, however deep in hexir the compile started
    warnings.warn_explicit(message, RuntimeWarning, caller.filename if caller else "hexir",
                           caller.lineno if caller else 0)
