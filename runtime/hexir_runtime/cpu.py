"""The CPU device: the module's native shared object, loaded with ctypes, run on host threads.

Calling convention (docs/hxb-format.md): `void symbol(T *arg0, ..., T *argN, int64_t size0, ...,
int64_t first, int64_t last)` computes iterations [first, last) of the kernel's outermost parallel
loop, whose trip count is its `work.extent` evaluated for the call (the sizes are the call's
values of the kernel's `sizes` symbols). Big launches are split over one thread pool that
every CpuDevice of the process shares: the native one the compiler links into its libraries
(`NativePool`: no Python between a launch's chunks), else, for libraries without one, Python
threads (ctypes releases the GIL during a foreign call, so the chunks really run in parallel).
A custom kernel is called once, as `void symbol(T0 *arg0, ..., TN *argN, int64_t scalar0, ...)`,
from the module's library or from a shared object of its own (its `library` blob). Which code
runs a kernel (its own or its cpu_fallback) is the manifest's `Kernel.cpu_code`.

Trust: a module's CPU code comes in builds for several CPU levels (`cpu.libraries`, best first);
the first whose features this host has is loaded, so no instruction it lacks can run. Before
dlopen, its ELF is read (elf.py) and a library that would run code or load another library when
it is loaded is refused. Its kernel table (`hexir_kernels`, written by the compiler into the code)
must record the level the manifest says (`cpu`, `features`: the host's features were checked
against the manifest's) and describe every kernel exactly as the manifest does, in files of every
version, and a kernel's symbol must be defined by the library itself: dlsym
also finds the symbols of its dependencies (libc's `system`), so each address is checked with
dladdr. How libraries are loaded without leaking fds or aliasing: see "loading libraries" below.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import platform
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .device import HostMemory
from .elf import check_dynamic
from .errors import DeviceError, HxbFormatError, KernelError
from .format import Cpu, CpuLibrary, Expr, Hxb, Work, check_build, check_table, evaluate, parse_table
from .reference import numpy_function

ARCH_ALIASES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}
# ELF e_machine -> architecture, for the clear error; dlopen refuses other foreign objects itself.
ELF_MACHINES = {62: "x86_64", 183: "aarch64", 243: "riscv64"}
TABLE_SYMBOL = "hexir_kernels"  # the kernel table the compiler embeds in every CPU library

# Loaded libraries by the sha256 of their bytes. ctypes never unloads a library, so loading the
# same module twice must not map its code twice.
_libraries: dict[str, Library] = {}
_libraries_lock = threading.Lock()
_loads = 0  # how many libraries went through a memfd: each gets its own spelling of the path

#: A split launch is cut in this many chunks per thread (at most; never below the work record's
#: grain), which the threads take in order as each finishes its last: one a thread left the
#: whole launch waiting for the slowest thread's share on a shared 16-core host. A kernel whose
#: work record has `spans` walks its chunk as one span and gets one a thread, faster there
#: (docs/tuning.md, "CPU split launches").
CHUNKS_PER_THREAD = 4
#: The most chunks a launch is split into (the native pool counts them in 16 bits).
MAX_CHUNKS = 1 << 12
# One pool of worker threads for the whole process, started on first use: each loaded module
# (each jit signature) must not start threads of its own that nothing stops.
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def worker_pool() -> ThreadPoolExecutor:
    """The process's CPU worker threads (one per core it may use), started on first use."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_cores(), thread_name_prefix="hexir-cpu")
        return _pool


def _forget_pool_in_child() -> None:
    global _pool, _pool_lock, _native
    # A forked child has none of its parent's threads. Its plans made before the fork keep the
    # parent's NativePool (its chunks then all run on the calling thread, one launch at a time);
    # no other is started on the same library's state (False: none in this process).
    _pool, _pool_lock, _native = None, threading.Lock(), False


class NativePool:
    """The native thread pool of a cpu library (hexir/backend/pool.c, which the compiler links
    into every library of generated kernels): a worker per core but one parked in its
    `hexir_pool_work`, a launch's chunks handed to them and to the calling thread by
    `hexir_pool_run`, with no Python in between (a chunk through `worker_pool` costs ~20-50 µs).
    The first library loaded that has one serves every module of the process."""

    def __init__(self, library: Library) -> None:
        functions = {name: library.function(f"hexir_pool_{name}") for name in ("run", "work", "max_args")}
        if None in functions.values():
            raise DeviceError(f"{library.what} has no complete thread pool")
        self.run, work, limit = functions["run"], functions["work"], functions["max_args"]
        self.run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
        self.run.restype = work.restype = None
        self.sequence = _sequence(library)
        work.argtypes = limit.argtypes = []
        limit.restype = ctypes.c_int
        self.max_args = limit()
        self.busy = threading.Lock()  # one launch at a time; a caller finding it taken runs its own
        for index in range(_cores() - 1):  # parked in native code: no GIL held, ever
            threading.Thread(target=work, name=f"hexir-cpu-{index}", daemon=True).start()


_native: NativePool | None | bool = None


def native_pool(library: Library | None) -> NativePool | None:
    """The process's native pool, started from `library` if it is the first to have one."""
    global _native
    with _pool_lock:
        if _native is None and library is not None and library.function("hexir_pool_run") is not None:
            _native = NativePool(library)
        return _native or None


def _sequence(library: Library) -> tuple[Any, int] | None:
    """A library's `hexir_pool_sequence` and the most argument words it passes a kernel (None:
    a library built without pool.c, or before it had one)."""
    run, limit = library.function("hexir_pool_sequence"), library.function("hexir_pool_max_args")
    if run is None or limit is None:
        return None
    run.argtypes, run.restype, limit.argtypes, limit.restype = [ctypes.c_void_p, ctypes.c_int], None, [], ctypes.c_int
    return run, limit()


def _cores() -> int:
    """The cores this process may run on (its affinity, which a container's limit sets)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)


def pick_library(cpu: Cpu, machine: str | None = None, flags: set[str] | None = None) -> CpuLibrary:
    """The first (best) of the module's CPU libraries that this machine (or `machine`/`flags`)
    can run; DeviceError naming what is missing if none. Features are looked up in
    /proc/cpuinfo; where it cannot be read, the last library (the most basic build) is taken."""
    machine = machine or platform.machine()
    if _arch(machine) != _arch(cpu.arch):
        raise DeviceError(f"the module's CPU code is for {cpu.arch}, but this machine is {machine}")
    flags = _cpu_flags() if flags is None else flags
    if flags is None:
        return cpu.libraries[-1]
    for build in cpu.libraries:
        if set(build.features) <= flags:
            return build
    lacks = "; ".join(f"{build.cpu} needs CPU features this machine lacks: "
                      + ", ".join(feature for feature in build.features if feature not in flags)
                      for build in cpu.libraries)
    raise DeviceError(f"no CPU library of the module runs on this machine: {lacks}")


def check_library(blob: memoryview, what: str, machine: str | None = None, field: str = "library") -> None:
    """Check the shared object `blob` before dlopen maps it: DeviceError if it is an ELF for another
    architecture than this machine's; HxbFormatError(`field`) if it is no ELF64 shared object, if
    what the loader maps reaches past its end (the loader would die of SIGBUS touching it), or if
    loading it would run any of its code or load another library (elf.py says what is refused)."""
    header = bytes(blob[:20])
    if len(header) == 20 and header.startswith(b"\x7fELF"):
        order = "little" if header[5] == 1 else "big"
        arch = ELF_MACHINES.get(int.from_bytes(header[18:20], order))
        machine = machine or platform.machine()
        if arch is not None and _arch(arch) != _arch(machine):
            raise DeviceError(f"{what} is for {arch}, but this machine is {machine}")
    check_dynamic(blob, field, what)


def _arch(name: str) -> str:
    return ARCH_ALIASES.get(name.lower(), name.lower())


def _cpu_flags() -> set[str] | None:
    try:
        with open("/proc/cpuinfo") as file:
            lines = file.read().splitlines()
    except OSError:
        return None
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86, arm
            return set(value.split())
    return None


# --- loading libraries ----------------------------------------------------------------------
#
# glibc's dlopen returns an already loaded library when it was opened with the same path string
# (or is the same file: same device and inode). So every library is opened under a path that
# no other library ever had, and no file descriptor outlives its dlopen:
# - a memfd (nothing on disk, so nothing is left behind whatever happens to the process), opened
#   as /proc/self/fd/N; N is reused once the fd is closed, so each load spells the path with its
#   own runs of slashes, which the kernel reads as one ("//proc/self///fd/3");
# - where memfds cannot hold code (no memfd_create, or vm.memfd_noexec), a file in a new private
#   directory, both removed right after dlopen, whether it succeeded or not.


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


@functools.cache
def _dl() -> ctypes.CDLL:
    """dlopen, dlerror and dladdr (in libc since glibc 2.34, in libdl before)."""
    for name in (None, "libdl.so.2"):
        try:
            dl = ctypes.CDLL(name)
            dl.dlopen.restype, dl.dlopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_int]
            dl.dlerror.restype, dl.dlerror.argtypes = ctypes.c_char_p, []
            dl.dladdr.restype, dl.dladdr.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
            return dl
        except (OSError, AttributeError):
            continue
    raise DeviceError("cannot load native code: this C library has no dlopen/dladdr")


class Library:
    """A loaded shared object and the path it was opened as, which dladdr reports for its own symbols."""

    def __init__(self, path: str, what: str) -> None:
        dl = _dl()
        handle = dl.dlopen(path.encode(), os.RTLD_NOW | os.RTLD_LOCAL)
        if not handle:
            # dlerror's text can hold any byte of the file (a dependency's name): never fail decoding it
            reason = (dl.dlerror() or b"unknown error").decode("utf-8", "replace").replace(f"{path}: ", "")
            raise OSError(f"cannot load {what}: {reason}")
        self.path, self.what = path, what
        self.cdll = ctypes.CDLL(path, handle=handle)

    def owns(self, address: int | None) -> bool:
        """Whether `address` lies in this library itself (not in one of its dependencies)."""
        info = _DlInfo()
        return bool(address) and _dl().dladdr(address, ctypes.byref(info)) != 0 and info.dli_fname == self.path.encode()

    def function(self, symbol: str) -> Any | None:
        """A fresh ctypes function for `symbol` if this library defines it (None otherwise)."""
        try:
            function = self.cdll[symbol]  # dlsym: also finds the dependencies' symbols (libc's `system`)
        except AttributeError:
            return None
        return function if self.owns(ctypes.cast(function, ctypes.c_void_p).value) else None

    def table(self) -> bytes | None:
        """The library's kernel table (the NUL-terminated `hexir_kernels`), or None without one."""
        try:
            address = ctypes.addressof(ctypes.c_char.in_dll(self.cdll, TABLE_SYMBOL))
        except ValueError:
            return None
        return ctypes.string_at(address) if self.owns(address) else None


def open_library(blob: memoryview, digest: str, what: str) -> Library:
    """The library whose bytes are `blob` (sha256 `digest`), loaded once per process."""
    with _libraries_lock:
        if digest not in _libraries:
            try:
                _libraries[digest] = _open_in_memory(blob, what) or _open_from_private_file(blob, digest, what)
            except OSError as error:
                raise DeviceError(str(error) if str(error).startswith("cannot load") else
                                  f"cannot load {what}: {error}") from None
        return _libraries[digest]


def _open_in_memory(blob: memoryview, what: str) -> Library | None:
    """The library loaded from a memfd; None where memfds cannot hold code here."""
    global _loads
    try:
        descriptor = os.memfd_create("hexir-cpu-kernels", os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        return None
    try:
        with open(descriptor, "wb", closefd=False) as file:
            file.write(blob)
        count, _loads = _loads, _loads + 1
        parts = ("proc", "self", "fd", str(descriptor))  # 128 spellings per slash: 2^28 in all
        path = "".join("/" * (1 + (count >> 7 * i) % 128) + part for i, part in enumerate(parts))
        try:
            return Library(path, what)
        except OSError as error:
            if "failed to map segment" in str(error) or "not permitted" in str(error):
                return None  # memfds may not be executed here (vm.memfd_noexec): through a file
            raise
    finally:
        os.close(descriptor)


def _open_from_private_file(blob: memoryview, digest: str, what: str) -> Library:
    with tempfile.TemporaryDirectory(prefix="hexir-") as directory:  # removed with the file, loaded or not
        path = os.path.join(directory, f"{digest}.so")
        with open(path, "wb") as file:
            file.write(blob)
        return Library(path, what)


class CpuDevice(HostMemory):
    """Host buffers; kernels from the module's shared object, split into at most
    CHUNKS_PER_THREAD x `threads` chunks (run by the process's `NativePool`, or `worker_pool`)
    of at least the work record's `grain` iterations each, when a launch's arguments total at
    least `split_bytes` bytes (256 KiB: a 256x256 float32 product already gains from two
    threads). With
    `fallbacks`, it also runs CUDA kernels, as their `cpu_fallback` code."""

    name = "cpu"

    def __init__(self, threads: int | None = None, split_bytes: int = 1 << 18, fallbacks: bool = True) -> None:
        self.threads = threads or _cores()
        self.split_bytes = split_bytes
        self.kinds = ("cpu", "cuda") if fallbacks else ("cpu",)

    def load(self, hxb: Hxb) -> CpuProgram:
        """Pick the CPU library this host runs, load it (no file left behind), check it against
        its kernel table, and look up every kernel's code among the library's own symbols."""
        manifest, functions = hxb.manifest, {}
        kernels = {index: kernel for index, kernel in enumerate(manifest.kernels) if kernel.device in self.kinds}
        for index, kernel in list(kernels.items()):
            if kernel.cpu_code is None and kernel.op == "linear_t":  # (a TF32 linear's w^T: no twin)
                functions[index] = (_NumpyKernel(numpy_function(kernel, f"kernels[{index}] ({kernel.name})")), None, ())
                del kernels[index]
            elif kernel.cpu_code is None:
                other = ("a custom kernel has no numpy version for --device=reference" if kernel.custom
                         else "or with --device=reference, in numpy")
                raise DeviceError(f"kernels[{index}] ({kernel.name}) runs on cuda and has no cpu_fallback: "
                                  f"run this module with --device=cuda on a GPU ({other})")
        shared = [index for index, kernel in kernels.items() if kernel.cpu_code.library is None]
        main, main_where = None, ""
        if shared:  # every version is checked alike: a file too old to carry a table is refused
            build = pick_library(manifest.cpu)
            field = f"cpu.libraries[{manifest.cpu.libraries.index(build)}]"
            where = main_where = f"the CPU library for {build.cpu} (blob {build.library})"
            check_library(hxb.blob(build.library), where, field=f"{field}.library")
            main = open_library(hxb.blob(build.library), manifest.blobs[build.library].sha256, where)
            table = main.table()
            if table is None:
                raise HxbFormatError(f"{field}.library", f"{where} has no kernel table ({TABLE_SYMBOL}): built by an "
                                                         "older compiler? (rebuild the module)")
            entries, record = parse_table(table, where)
            check_build(record, build, field, where)
            check_table(hxb, entries, shared, False, where)
        for index, kernel in kernels.items():
            code = kernel.cpu_code
            field = f"kernels[{index}]{'' if kernel.device == 'cpu' else '.cpu_fallback'}"
            if code.library is None:
                library, where = main, main_where
            else:  # a custom kernel's prebuilt shared object
                blob = code.library
                where = f"its library (blob {blob}, {manifest.blobs[blob].name})"
                check_library(hxb.blob(blob), f"kernels[{index}] ({kernel.name}): {where}", field=f"{field}.library")
                library = open_library(hxb.blob(blob), manifest.blobs[blob].sha256,
                                       f"the library of kernels[{index}] ({kernel.name}) (blob {blob})")
            function = library.function(code.symbol)
            if function is None:
                try:
                    library.cdll[code.symbol]
                except AttributeError:
                    raise KernelError(f"kernels[{index}] ({kernel.name}): symbol {code.symbol!r} is not in "
                                      f"{where}") from None
                raise HxbFormatError(f"{field}.symbol", f"{kernel.name}: {code.symbol!r} is not defined by "
                                                        f"{where} itself (only by a library it depends on)")
            integers = len(kernel.integers) + (0 if kernel.custom else 2)  # + first and last
            function.argtypes = [ctypes.c_void_p] * len(kernel.args) + [ctypes.c_int64] * integers
            function.restype = None
            functions[index] = (function, code.work, kernel.integers)
        return CpuProgram(functions, self, main)


def address(array: np.ndarray) -> int:
    """Where an array's data starts: through the buffer protocol when it is writable (3x
    faster than `array.ctypes.data`, which builds an object per call)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(array))
    except (TypeError, ValueError):  # read-only; a dtype with no buffer format (ml_dtypes' bfloat16)
        return array.ctypes.data


def _patched(base: list[int], overrides: Sequence[tuple[int, np.ndarray]]) -> list[int]:
    """A launch's arguments: `base` with a call's (position, array) overrides' addresses."""
    if not overrides:
        return base
    arguments = list(base)
    for position, array in overrides:
        arguments[position] = address(array)
    return arguments


class _NumpyKernel:
    """A cuda kernel that has no cpu code by design (a TF32 linear on wgmma, whose constant w the
    module holds transposed: `linear_t`) run on the cpu by the reference device's numpy function
    (BLAS), so that such a module still runs where there is no GPU."""

    def __init__(self, function: Callable[..., None]) -> None:
        self.function = function

    class Launch:
        def __init__(self, function: Callable[..., None], layouts: list[tuple[tuple[int, ...], np.dtype]]) -> None:
            self.function, self.layouts = function, layouts

        def __call__(self, *words: int) -> None:  # the buffers' addresses (a call's own inputs patched in)
            arrays = []
            for word, (shape, dtype) in zip(words, self.layouts, strict=True):
                memory = (ctypes.c_char * (max(1, math.prod(shape)) * dtype.itemsize)).from_address(word)
                arrays.append(np.ndarray(shape, dtype, memory))
            self.function(*arrays)


class CpuProgram:
    """The module's CPU kernels as ctypes functions, with their parallel loops (None for a
    custom kernel) and the size expressions they take after their pointers."""

    def __init__(self, kernels: dict[int, tuple[Any, Work | None, tuple[Expr, ...]]], device: CpuDevice,
                 library: Library | None = None) -> None:
        self.kernels = kernels
        self.device = device
        self.library = library  # the generated kernels' library, whose thread pool splits launches

    def prepare(self, kernel: int, buffers: Sequence[np.ndarray],
                sizes: Mapping[str, int]) -> tuple[Any, list[int], int, list[tuple[int, ...]]] | None:
        """A launch of kernels[kernel] on C-contiguous `buffers` for a call shape's `sizes`: its
        function, argument words, parallel extent and chunks (bounds; `()` for a custom kernel,
        called once); None when the loop has no iteration. A big launch is cut in chunks of its
        parallel loop (never of fewer than its `grain` iterations) for the pool."""
        if kernel not in self.kernels:
            raise KernelError(f"kernels[{kernel}] is not a CPU kernel of this module")
        function, work, integers = self.kernels[kernel]
        if isinstance(function, _NumpyKernel):  # (run once, in the caller's thread, by numpy's BLAS)
            layouts = [(buffer.shape, buffer.dtype) for buffer in buffers]
            return _NumpyKernel.Launch(function.function, layouts), [buffer.ctypes.data for buffer in buffers], 0, [()]
        values = [evaluate(expr, sizes) for expr in integers]
        extent = 0 if work is None else evaluate(work.extent, sizes)
        if max([extent, *values]) >= 2**63:  # would wrap in ctypes: the kernel would run on garbage
            raise KernelError(f"kernels[{kernel}]: a size or extent of this call does not fit in int64")
        base = [buffer.ctypes.data for buffer in buffers] + values
        ranges: list[tuple[int, ...]] = [()]
        if work is not None:
            if extent == 0:
                return None
            chunks = 1
            if self.device.threads > 1 and sum(buffer.nbytes for buffer in buffers) >= self.device.split_bytes:
                most = self.device.threads * (1 if work.spans else CHUNKS_PER_THREAD)
                chunks = max(1, min(most, extent // work.grain, MAX_CHUNKS))
            ranges = [(extent * i // chunks, extent * (i + 1) // chunks) for i in range(chunks)]
        return function, base, extent, ranges

    def launcher(self, kernel: int, buffers: Sequence[np.ndarray],
                 sizes: Mapping[str, int]) -> Callable[[Sequence[tuple[int, np.ndarray]]], None] | None:
        """`launcher_of` the launch `prepare` makes."""
        return self.launcher_of(self.prepare(kernel, buffers, sizes))

    def launcher_of(self, prepared: tuple[Any, list[int], int, list[tuple[int, ...]]] | None
                    ) -> Callable[[Sequence[tuple[int, np.ndarray]]], None] | None:
        """A function running a `prepare`d launch (None: nothing to run), given (argument, array)
        pairs that replace some buffers in a call; its chunks on the pool."""
        if prepared is None:
            return None
        function, base, extent, ranges = prepared
        native = native_pool(self.library) if len(ranges) > 1 else None
        if native is not None and len(base) <= native.max_args:
            return self._native_launcher(native, function, base, extent, ranges)

        def go(overrides: Sequence[tuple[int, np.ndarray]] = ()) -> None:
            arguments = _patched(base, overrides)
            if len(ranges) == 1:
                function(*arguments, *ranges[0])
                return
            pool = worker_pool()
            for future in [pool.submit(function, *arguments, *bounds) for bounds in ranges]:
                future.result()
        return go

    @staticmethod
    def _native_launcher(native: NativePool, function: Any, base: list[int], extent: int,
                         ranges: list[tuple[int, ...]]) -> Callable[[Sequence[tuple[int, np.ndarray]]], None]:
        """`launcher`'s function for a split launch on the native pool: the arguments and the
        chunks' bounds in C arrays built here, a call's overrides written into them and undone."""
        words = (ctypes.c_int64 * len(base))(*base)
        bounds = (ctypes.c_int64 * (len(ranges) + 1))(*(first for first, _ in ranges), extent)
        entry, count, chunks = ctypes.cast(function, ctypes.c_void_p).value, len(base), len(ranges)

        def go(overrides: Sequence[tuple[int, np.ndarray]] = ()) -> None:
            if not native.busy.acquire(blocking=False):  # another thread's launch holds the pool:
                function(*_patched(base, overrides), 0, extent)  # the whole range here, in one piece
                return
            try:
                for position, array in overrides:
                    words[position] = address(array)
                native.run(entry, words, count, bounds, chunks)
            finally:
                for position, _ in overrides:
                    words[position] = base[position]
                native.busy.release()
        return go

    def sequence(self, launches: list[tuple[Any, list[int], int, list[tuple[int, ...]]]]) -> Batch | None:
        """`prepare`d launches run in order by one foreign call: the native pool's
        `hexir_pool_sequence` where a launch is split, else this library's own (launches of one
        chunk start no pool); None where there is none, or a launch has too many arguments."""
        native = found = None
        if any(isinstance(function, _NumpyKernel.Launch) for function, *_ in launches):
            return None  # (a Python function: not for the native sequence)
        if any(len(ranges) > 1 for *_, ranges in launches):
            native = native_pool(self.library)
            found = native.sequence if native is not None else None
        elif self.library is not None:
            found = _sequence(self.library)
        if found is None or any(len(base) > found[1] for _, base, *_ in launches):
            return None
        return Batch(found[0], native, launches)

    def launch(self, kernel: int, buffers: Sequence[np.ndarray], sizes: Mapping[str, int]) -> None:
        """Run kernels[kernel] on C-contiguous `buffers` (see `launcher`); not at all if its loop
        has no iteration."""
        go = self.launcher(kernel, buffers, sizes)
        if go is not None:
            go()

    def close(self) -> None:
        """Nothing to unload: a library stays loaded for the process (ctypes cannot unload it)."""


class Batch:
    """Launches run in order by one call of `hexir_pool_sequence` (pool.c), the pool's (`native`)
    when one is split: each one's argument words and chunk bounds in C arrays built once, which a
    call may patch (`words`) before `run`."""

    def __init__(self, sequence: Any, native: NativePool | None,
                 launches: list[tuple[Any, list[int], int, list[tuple[int, ...]]]]) -> None:
        self.sequence, self.native = sequence, native
        self.words = [(ctypes.c_int64 * len(base))(*base) for _, base, _, _ in launches]
        self.bounds = [(ctypes.c_int64 * (len(ranges) + 1))(*(r[0] if r else 0 for r in ranges), extent)
                       for _, _, extent, ranges in launches]
        table = []
        for (function, base, _, ranges), words, bounds in zip(launches, self.words, self.bounds, strict=True):
            table += [ctypes.cast(function, ctypes.c_void_p).value, ctypes.addressof(words), len(base),
                      ctypes.addressof(bounds), len(ranges)]
        self.table, self.count = (ctypes.c_int64 * len(table))(*table), len(launches)

    def run(self) -> bool:
        """Run the launches; False (nothing run) if another thread's launch holds the pool."""
        if self.native is None:
            self.sequence(self.table, self.count)
            return True
        if not self.native.busy.acquire(blocking=False):
            return False
        try:
            self.sequence(self.table, self.count)
        finally:
            self.native.busy.release()
        return True
