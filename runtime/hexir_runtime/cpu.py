"""The CPU device: the module's native shared object, loaded with ctypes, run on host threads.

Calling convention (docs/hxb-format.md): `void symbol(T *arg0, ..., T *argN, int64_t size0, ...,
int64_t first, int64_t last)` computes iterations [first, last) of the kernel's outermost parallel
loop, whose trip count is its `work.extent` evaluated for the call (the sizes are the call's
values of the kernel's `sizes` symbols). Big launches are split over one thread pool that
every CpuDevice of the process shares; ctypes releases the GIL during a foreign call, so the
chunks really run in parallel. A custom kernel is called once, as `void symbol(T0 *arg0, ...,
TN *argN, int64_t scalar0, ...)`, from the module's library or from a shared object of its own
(its `library` blob). Which code runs a kernel (its own or its cpu_fallback) is the manifest's
`Kernel.cpu_code`.
"""

from __future__ import annotations

import ctypes
import os
import platform
import tempfile
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .device import HostMemory
from .errors import DeviceError, KernelError
from .format import Cpu, Expr, Hxb, Work, evaluate

ARCH_ALIASES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}
# ELF e_machine -> architecture, for the clear error; dlopen refuses other foreign objects itself.
ELF_MACHINES = {62: "x86_64", 183: "aarch64", 243: "riscv64"}

# Loaded libraries by the sha256 of their bytes. ctypes never unloads a library, so loading the
# same module twice must not map its code twice.
_libraries: dict[str, ctypes.CDLL] = {}
_libraries_lock = threading.Lock()

# One pool of worker threads for the whole process, started on first use: each loaded module
# (each jit signature) must not start threads of its own that nothing stops.
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def worker_pool() -> ThreadPoolExecutor:
    """The process's CPU worker threads (os.cpu_count() of them), started on first use."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="hexir-cpu")
        return _pool


def _forget_pool_in_child() -> None:
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()  # a forked child has none of its parent's threads


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)


def check_host(cpu: Cpu, machine: str | None = None, flags: set[str] | None = None) -> None:
    """Raise DeviceError unless this machine (or `machine`/`flags`) can run the manifest's `cpu` code.

    Features are looked up in /proc/cpuinfo; where it cannot be read, they are not checked.
    """
    machine = machine or platform.machine()
    if _arch(machine) != _arch(cpu.arch):
        raise DeviceError(f"the module's CPU code is for {cpu.arch}, but this machine is {machine}")
    flags = _cpu_flags() if flags is None else flags
    missing = [feature for feature in cpu.features if flags is not None and feature not in flags]
    if missing:
        raise DeviceError(
            f"the module's CPU code was built for {cpu.cpu} and needs CPU features this machine lacks: "
            + ", ".join(missing)
        )


def check_library(blob: memoryview, what: str, machine: str | None = None) -> None:
    """Raise DeviceError if the shared object `blob` is an ELF for another architecture than this machine's."""
    header = bytes(blob[:20])
    if len(header) < 20 or not header.startswith(b"\x7fELF"):
        return  # not an ELF at all: dlopen says so
    arch = ELF_MACHINES.get(int.from_bytes(header[18:20], "little" if header[5] == 1 else "big"))
    machine = machine or platform.machine()
    if arch is not None and _arch(arch) != _arch(machine):
        raise DeviceError(f"{what} is for {arch}, but this machine is {machine}")


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


def _open_library(blob: memoryview, digest: str, what: str) -> ctypes.CDLL:
    with _libraries_lock:
        if digest not in _libraries:
            try:
                _libraries[digest] = _open_in_memory(blob)
            except (AttributeError, OSError):  # no memfd_create, or memfds may not be executed
                try:
                    _libraries[digest] = _open_from_temporary_file(blob)
                except OSError as error:
                    raise DeviceError(f"cannot load {what}: {error}") from None
        return _libraries[digest]


def _open_in_memory(blob: memoryview) -> ctypes.CDLL:
    descriptor = os.memfd_create("hexir-cpu-kernels")
    try:
        with open(descriptor, "wb", closefd=False) as file:
            file.write(blob)
        library = ctypes.CDLL(f"/proc/self/fd/{descriptor}")
    except OSError:
        os.close(descriptor)
        raise
    # The descriptor stays open for good: the dynamic loader recognises loaded libraries by
    # path, so if this number were reused for another library, dlopen would return this one.
    return library


def _open_from_temporary_file(blob: memoryview) -> ctypes.CDLL:
    with tempfile.NamedTemporaryFile(prefix="hexir-", suffix=".so") as file:  # deleted on close
        file.write(blob)
        file.flush()
        return ctypes.CDLL(file.name)


class CpuDevice(HostMemory):
    """Host buffers; kernels from the module's shared object, split into at most `threads`
    chunks (run by the process's `worker_pool`) when a launch's arguments total at least
    `split_bytes` bytes. With `fallbacks`, it also runs CUDA kernels, as their `cpu_fallback` code."""

    name = "cpu"

    def __init__(self, threads: int | None = None, split_bytes: int = 1 << 20, fallbacks: bool = True) -> None:
        self.threads = threads or os.cpu_count() or 1
        self.split_bytes = split_bytes
        self.kinds = ("cpu", "cuda") if fallbacks else ("cpu",)

    def load(self, hxb: Hxb) -> CpuProgram:
        """Check the host, load the library (no file left behind), look up every kernel's code."""
        manifest, functions = hxb.manifest, {}
        kernels = {index: kernel for index, kernel in enumerate(manifest.kernels) if kernel.device in self.kinds}
        for index, kernel in kernels.items():
            if kernel.cpu_code is None:
                other = ("a custom kernel has no numpy version for --device=reference" if kernel.custom
                         else "or with --device=reference, in numpy")
                raise DeviceError(f"kernels[{index}] ({kernel.name}) runs on cuda and has no cpu_fallback: "
                                  f"run this module with --device=cuda on a GPU ({other})")
        if any(kernel.cpu_code.library is None for kernel in kernels.values()):
            check_host(manifest.cpu)
        for index, kernel in kernels.items():
            code = kernel.cpu_code
            if code.library is not None:  # a custom kernel's prebuilt shared object
                blob = code.library
                where = f"its library (blob {blob}, {manifest.blobs[blob].name})"
                check_library(hxb.blob(blob), f"kernels[{index}] ({kernel.name}): {where}")
                what = f"the library of kernels[{index}] ({kernel.name}) (blob {blob})"
            else:
                blob, where, what = manifest.cpu.library, "the CPU library", "the module's CPU library"
            library = _open_library(hxb.blob(blob), manifest.blobs[blob].sha256, what)
            try:
                function = library[code.symbol]  # a fresh function object, unlike getattr
            except AttributeError:
                raise KernelError(
                    f"kernels[{index}] ({kernel.name}): symbol {code.symbol!r} is not in {where}") from None
            integers = len(kernel.integers) + (0 if kernel.custom else 2)  # + first and last
            function.argtypes = [ctypes.c_void_p] * len(kernel.args) + [ctypes.c_int64] * integers
            function.restype = None
            functions[index] = (function, code.work, kernel.integers)
        return CpuProgram(functions, self)


class CpuProgram:
    """The module's CPU kernels as ctypes functions, with their parallel loops (None for a
    custom kernel) and the size expressions they take after their pointers."""

    def __init__(self, kernels: dict[int, tuple[Any, Work | None, tuple[Expr, ...]]], device: CpuDevice) -> None:
        self.kernels = kernels
        self.device = device

    def launch(self, kernel: int, buffers: Sequence[np.ndarray], sizes: Mapping[str, int]) -> None:
        """Run kernels[kernel] on C-contiguous `buffers`, in chunks of its parallel loop if big
        (never of fewer than its `grain` iterations); not at all if the loop has no iteration."""
        if kernel not in self.kernels:
            raise KernelError(f"kernels[{kernel}] is not a CPU kernel of this module")
        function, work, integers = self.kernels[kernel]
        arguments = [buffer.ctypes.data for buffer in buffers] + [evaluate(expr, sizes) for expr in integers]
        if work is None:  # a custom kernel: called once, with its scalars after the pointers
            function(*arguments)
            return
        extent = evaluate(work.extent, sizes)
        if extent == 0:
            return
        chunks = 1
        if sum(buffer.nbytes for buffer in buffers) >= self.device.split_bytes:
            chunks = min(self.device.threads, extent // work.grain)
        if chunks < 2:
            function(*arguments, 0, extent)
            return
        bounds = [extent * i // chunks for i in range(chunks + 1)]
        pool = worker_pool()
        futures = [pool.submit(function, *arguments, bounds[i], bounds[i + 1]) for i in range(chunks)]
        for future in futures:
            future.result()

    def close(self) -> None:
        """Nothing to unload: a library stays loaded for the process (ctypes cannot unload it)."""
