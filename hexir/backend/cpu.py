"""cpu backend: LLVM dialect -> optimised LLVM IR -> PIC object -> shared library bytes.

The code is built for named x86-64 levels (`-target=cpu:x86-64-v3`), not for the machine that
compiles, so a module made here runs on any machine of that level; a module carries a library
per level (by default AVX-512, AVX2+FMA and the baseline) and the runtime loads the best one
the host supports. The manifest records each level and the CPU features it implies.

Each library also holds its own description, the exported string `hexir_kernels`: the JSON
table of the kernels it defines (symbol, args, sizes, work record) and of the level it was built
for (`cpu`, `features`), which the runtime checks the manifest against before it calls anything.
Libraries are linked with `-nostartfiles`: no constructor, nothing run when one is loaded, and
the runtime refuses any library that would run code or load another (hexir_runtime/elf.py); a
custom kernel's C code that adds one is refused here, when it is linked.
"""

from __future__ import annotations

import atexit
import json
import platform
import shutil
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hexir_runtime import HxbFormatError
from hexir_runtime.elf import check_dynamic
from mlir import ir
from mlir.dialects import llvm as llvm_dialect

from hexir.backend.toolchain import c_compiler, llvm_tool, run_tool
from hexir.errors import CompileError, TargetError
from hexir.target import CPU_LEVELS


@dataclass(frozen=True)
class CpuLibrary:
    shared_object: bytes
    cpu: str
    features: tuple[str, ...]
    arch: str = "x86_64"


def check_cpu(cpu: str) -> None:
    if cpu not in CPU_LEVELS:
        raise TargetError(f"cpu target {cpu!r} is not supported; expected one of {', '.join(CPU_LEVELS)}")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise TargetError(f"cpu code generation targets x86_64; this machine is {platform.machine()}")


def llvm_ir(llvm_module: ir.Module) -> str:
    """The LLVM IR text of a module in the LLVM dialect."""
    # The translation returns a null module for an op it cannot translate, and printing that
    # crashes the process: refuse such a module here instead.
    foreign: list[ir.Operation] = []

    def find_foreign(op: ir.Operation) -> ir.WalkResult:
        if op.name != "builtin.module" and not op.name.startswith("llvm."):
            foreign.append(op)
            return ir.WalkResult.INTERRUPT
        return ir.WalkResult.ADVANCE

    llvm_module.operation.walk(find_foreign, ir.WalkOrder.PRE_ORDER)  # the outermost first
    if foreign:
        raise CompileError(f"cannot translate to LLVM IR: '{foreign[0].name}' at {foreign[0].location} is not "
                           "in the LLVM dialect; expected a module of llvm.* ops only")
    return str(llvm_dialect.translate_module_to_llvmir(llvm_module.operation))


_pool: list[str] = []  # the object file, once compiled
_pool_lock = threading.Lock()


def pool_object() -> str:
    """pool.c (the runtime's native thread pool, linked into every library of generated kernels)
    compiled once per process, for every x86-64 level alike."""
    with _pool_lock:
        if not _pool:
            directory = tempfile.mkdtemp(prefix="hexir-pool-")
            atexit.register(shutil.rmtree, directory, True)
            _pool.append(str(Path(directory) / "pool.o"))
            try:
                run_tool([c_compiler(), "-c", "-O2", "-fPIC", str(Path(__file__).with_name("pool.c")), "-o", _pool[0]],
                         "compiling the cpu thread pool")
            except BaseException:
                _pool.clear()
                raise
        return _pool[0]


def compile_object(llvm_module: ir.Module | str, cpu: str, path: Path) -> str:
    """Optimise and compile cpu kernels (a module of the LLVM dialect, or its LLVM IR text) for
    the x86-64 level `cpu` into the PIC object `path` (returned as a string)."""
    check_cpu(cpu)
    target = ["-mtriple=x86_64-unknown-linux-gnu", f"-mcpu={cpu}"]
    source, bitcode = path.with_suffix(".ll"), path.with_suffix(".bc")
    source.write_text(llvm_module if isinstance(llvm_module, str) else llvm_ir(llvm_module))
    run_tool([llvm_tool("opt"), "-O3", *target, str(source), "-o", str(bitcode)], "opt (LLVM optimiser)")
    run_tool([llvm_tool("llc"), "-O3", *target, "--relocation-model=pic", "-filetype=obj", str(bitcode),
              "-o", str(path)], "llc (LLVM code generator)")
    return str(path)


def compile_kernels(llvm_module: ir.Module | str | None, cpu: str = "x86-64",
                    extra_objects: Sequence[str] = (), table: bytes | None = None,
                    generated_objects: Sequence[str] = ()) -> CpuLibrary:
    """Optimise and compile the cpu kernels (a module of the LLVM dialect, or its LLVM IR text),
    link them with `generated_objects` (generated kernels compiled apart: the cuda kernels' cpu
    twins, built once at the lowest level), `extra_objects` (custom kernels' objects) and the
    kernel `table` (JSON bytes), into one position-independent shared library. Only the tools run
    here, no MLIR, so several levels can compile at once."""
    check_cpu(cpu)
    with tempfile.TemporaryDirectory(prefix="hexir-cpu-") as scratch:
        work = Path(scratch)
        objects = list(generated_objects) + list(extra_objects)
        if table is not None:  # bytes, not a string literal: no escaping to get wrong
            record = {**json.loads(table), "cpu": cpu, "features": list(CPU_LEVELS[cpu])}  # what the code needs
            data = ", ".join(str(byte) for byte in json.dumps(record, separators=(",", ":")).encode() + b"\0")
            (work / "table.c").write_text(f"const char hexir_kernels[] = {{{data}}};\n")
            run_tool([c_compiler(), "-c", "-fPIC", str(work / "table.c"), "-o", str(work / "table.o")],
                     "compiling the kernel table")
            objects.append(str(work / "table.o"))
        if llvm_module is not None:
            objects.insert(0, compile_object(llvm_module, cpu, work / "kernels.o"))
        if llvm_module is not None or generated_objects:
            objects.append(pool_object())
        # -lm: float64 math calls glibc's libm (docs/math.md); linked only where a kernel needs it
        run_tool([c_compiler(), "-shared", "-nostartfiles", "-Wl,--as-needed", "-o", str(work / "kernels.so"),
                  *objects, "-lm"],
                 "linking the cpu kernels")
        shared_object = (work / "kernels.so").read_bytes()
        check_shared_object(shared_object, f"the cpu library for {cpu}")
        return CpuLibrary(shared_object, cpu, CPU_LEVELS[cpu])


def check_shared_object(data: bytes, what: str) -> None:
    """CompileError where the runtime would refuse to load `data`: a constructor (a custom kernel's
    `__attribute__((constructor))`), a library it needs beyond libc and libm, a search path..."""
    try:
        check_dynamic(data, "library", what)
    except HxbFormatError as error:
        raise CompileError(f"{error.reason}; the runtime would refuse it") from None
