"""cuda backend: `gpu.module @hexir_cuda` -> NVVM -> a CUBIN per architecture, plus PTX.

One binary holds every cuda kernel of the module, per architecture (`-target=cuda:sm_80,
cuda:sm_90`; default sm_90). PTX for the lowest architecture rides along so a newer GPU can
JIT it. MLIR lowers each kernel to PTX on its own, once for every architecture (`ptx_pieces`:
the driver runs them side by side in processes), and the pieces are joined (`merge_ptx`); ptxas,
from the `nvidia-cuda-nvcc` wheel else a CUDA toolkit on PATH, then makes each CUBIN in a process
of its own (`assemble`: the command MLIR's serializer runs, so the same bytes).
The architecture is validated before any pass runs: NVPTX aborts the process (it does not
raise) when asked for a PTX version that cannot express the chip.

Math ops (docs/math.md) become calls to libdevice (`__nv_expf`, `__nv_erf`...), which the
NVVM serializer links in before PTX is generated: the pinned MLIR wheel embeds a libdevice,
else it reads the toolkit's nvvm/libdevice (the CUDA wheel has one). A PTX that still
declares a function it does not define (an unlinked `__nv_` call) is refused here, naming it.
Square roots are the exception: libdevice's float32 sqrt is `sqrt.approx` (NVVM reflect
leaves __CUDA_PREC_SQRT off) and its rsqrt, float32 and float64, is always `rsqrt.approx`, so
`math.sqrt` becomes LLVM's sqrt (`sqrt.rn`, correctly rounded) and `math.rsqrt` 1 / that
(`rcp.rn`, also IEEE) before the conversion.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from mlir import ir, passmanager
from mlir.dialects import arith, gpu, llvm

from hexir.backend.toolchain import nvidia_wheel_file
from hexir.dialects.hextir import ARCH, GPU_MODULE
from hexir.errors import CompileError, TargetError
from hexir.passes.common import count_ops
from hexir.target import PTX_FEATURES, arch_number

#: (No canonicalize or cse after the conversion: LLVM's -O3 does that work again, and without
#: them the block's PTX, the bf16/f16 tensor-core and f64 DMMA kernels' came out byte-identical
#: for a quarter less of this pipeline's time: docs/tuning.md, "Compile time".)
_DEVICE_PASSES = ("gpu.module(expand-strided-metadata, lower-affine, convert-nvgpu-to-nvvm, convert-scf-to-cf, "
                  "convert-gpu-to-nvvm{use-bare-ptr-memref-call-conv=1}, convert-nvvm-to-llvm, "
                  "reconcile-unrealized-casts)")
#: Dynamic shared memory's alignment: TMA boxes with 128-byte swizzling want 1024 bytes.
DYNAMIC_SHARED_ALIGN = 1024


def cuda_toolkit() -> str:
    """A folder whose bin/ holds ptxas: the nvidia-cuda-nvcc wheel's, else a toolkit on PATH."""
    ptxas = nvidia_wheel_file("cu*/bin/ptxas")
    if ptxas is not None:
        return str(ptxas.parent.parent)
    found = shutil.which("ptxas")
    if found:
        return str(Path(found).resolve().parent.parent)
    raise CompileError("ptxas was not found: install the CUDA compiler wheel "
                       "(pip install 'hexir[cuda]') or put a CUDA toolkit's bin/ on PATH")


@dataclass(frozen=True)
class CudaBinary:
    """The module's cuda images: a CUBIN per architecture, and the PTX of the lowest one."""

    cubins: dict[str, bytes]
    ptx: tuple[str, bytes]


def check_archs(archs: tuple[str, ...]) -> None:
    for arch in archs:
        if arch not in PTX_FEATURES:
            raise TargetError(f"{arch!r} is not a supported CUDA architecture; expected one of "
                              f"{', '.join(PTX_FEATURES)}")


def _device_objects(module: ir.Module, archs: tuple[str, ...], format_: str,
                    only: tuple[str, ...] | None = None) -> dict[str, bytes]:
    """Lower a copy of the gpu.module for `archs` (of its kernels, `only` those if given) and
    serialize it (`isa`: PTX; `bin`: MLIR runs ptxas too)."""
    with module.context, ir.Location.unknown():
        copy = ir.Module.create()
        copy.operation.attributes["gpu.container_module"] = ir.UnitAttr.get()
        with ir.InsertionPoint(copy.body):
            for op in module.body.operations:
                if op.operation.name == "gpu.module":
                    kernels = op.operation.clone().regions[0].blocks[0].operations
                    for kernel in [k for k in kernels if k.operation.name == "gpu.func"]:
                        if not _builds(kernel, archs, only):  # another image's own, or another piece's
                            kernel.erase()
        _rounded_roots(copy)
        manager = passmanager.PassManager("builtin.module")
        for arch in archs:
            features = PTX_FEATURES[arch]
            manager.add(f"nvvm-attach-target{{module={GPU_MODULE} chip={arch} features={features} O=3}}")
        manager.add(_DEVICE_PASSES)
        manager.add(_external_dynamic_shared, name="hexir-dynamic-shared")
        # the toolkit for both formats: ptxas (bin) and, where MLIR embeds none, libdevice (both)
        manager.add(f'gpu-module-to-binary{{format={format_} toolkit="{cuda_toolkit()}"}}')  # quoted: spaces
        try:
            manager.run(copy.operation)
        except ir.MLIRError as error:  # the diagnostics, not their notes (which print the whole module)
            reasons = "\n".join(d.message for d in error.error_diagnostics) or str(error)
            raise CompileError(f"cuda code generation failed for {', '.join(archs)} ({format_}):\n{reasons}") from None
        binary = next(op for op in copy.body.operations if op.operation.name == "gpu.binary")
        objects = {}
        for arch, attribute in zip(archs, ir.ArrayAttr(binary.attributes["objects"]), strict=True):
            objects[arch] = bytes(gpu.ObjectAttr(attribute).object)
        return objects


def _builds(kernel: ir.Operation, archs: tuple[str, ...], only: tuple[str, ...] | None = None) -> bool:
    """Whether the image of `archs` holds `kernel` (a gpu.func): one built for an architecture
    (`hextir.arch`) is in that one's alone; and whether it is one of `only` (if given)."""
    if ARCH in kernel.attributes and ir.StringAttr(kernel.attributes[ARCH]).value not in archs:
        return False
    return only is None or ir.StringAttr(kernel.attributes["sym_name"]).value in only


def _external_dynamic_shared(op: ir.Operation, pass_: object) -> None:
    """convert-gpu-to-nvvm declares dynamic shared memory as an internal zero-sized global, which
    NVPTX prints as a static 1-byte `.shared .align 16 .b8 __dynamic_shmem__0;`: beside other
    shared variables (mbarriers) ptxas may then place them over it. Made external and
    DYNAMIC_SHARED_ALIGN-aligned it prints as `.extern .shared .align 1024 .b8 __dynamic_shmem__0[];`,
    the form that starts after every static shared variable. (Globals are the gpu.modules' own
    ops: a walk of every op of the kernels took 0.3 s of the block's compile.)"""
    found = [inner.operation for gpu_module in op.regions[0].blocks[0].operations
             if gpu_module.operation.name == "gpu.module" for inner in gpu_module.regions[0].blocks[0].operations
             if inner.operation.name == "llvm.mlir.global" and
             ir.StringAttr(inner.attributes["sym_name"]).value.startswith("__dynamic_shmem__")]
    with op.context:
        for global_ in found:
            global_.attributes["linkage"] = ir.Attribute.parse("#llvm.linkage<external>")
            global_.attributes["alignment"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64),
                                                                 DYNAMIC_SHARED_ALIGN)


def _rounded_roots(module: ir.Module) -> None:
    """math.sqrt -> LLVM's sqrt, math.rsqrt -> 1 / that: IEEE-rounded on NVPTX. Called by name
    (llvm.call_intrinsic): convert-gpu-to-nvvm sends llvm.intr.sqrt to libdevice too."""
    roots: list[ir.Operation] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name in ("math.sqrt", "math.rsqrt"):
            roots.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    for op in roots:
        with ir.InsertionPoint(op), op.location:
            x = op.operands[0]
            element = x.type.element_type if isinstance(x.type, ir.VectorType) else x.type
            suffix = f"v{x.type.shape[0]}{element}" if isinstance(x.type, ir.VectorType) else str(element)
            root = llvm.call_intrinsic(x.type, f"llvm.sqrt.{suffix}", [x], [], [])
            if op.name == "math.rsqrt":
                one = ir.FloatAttr.get(element, 1.0)
                one = arith.constant(x.type, ir.DenseElementsAttr.get_splat(x.type, one)
                                     if isinstance(x.type, ir.VectorType) else one)
                root = arith.divf(one, root)
        op.results[0].replace_all_uses_with(root)
        op.erase()


def ptx_of(module: ir.Module, arch: str) -> str:
    """The PTX of the module's cuda kernels for `arch` (`-emit=ptx`)."""
    return _device_objects(module, (arch,), "isa")[arch].decode()


def ptx_pieces(module: ir.Module, archs: tuple[str, ...], parts: int) -> tuple[list[tuple[int, Callable]], Callable]:
    """The MLIR half of the build in pieces, each with its size (`count_ops`): the kernels, lowered
    once for the architectures that share every kernel (a kernel built for one, `hextir.arch`: a
    variant using sm_90a's wgmma, is in that one's text alone), in at most `parts` runs of
    consecutive kernels of about equal size. MLIR holds the GIL, so the driver runs the pieces
    side by side in processes of their own; `join` makes of their results each architecture's text
    (`merge_ptx`: the text of the kernels lowered together; where it cannot, they are lowered together)."""
    check_archs(archs)
    archs = tuple(sorted(set(archs), key=lambda a: (arch_number(a), a)))  # sm_90 before sm_90a
    kernels = [k for op in module.body.operations if op.operation.name == "gpu.module"
               for k in op.regions[0].blocks[0].operations if k.operation.name == "gpu.func"]
    sizes = {ir.StringAttr(k.attributes["sym_name"]).value: count_ops(k) for k in kernels} if parts > 1 else {}
    own = {ir.StringAttr(k.attributes[ARCH]).value for k in kernels if ARCH in k.attributes}
    groups = [group for group in [tuple(a for a in archs if a not in own)] + [(a,) for a in archs if a in own] if group]
    jobs = [(group, run) for group in groups for run in _runs(
        [ir.StringAttr(k.attributes["sym_name"]).value for k in kernels if _builds(k, group)], sizes, parts)]

    def join(pieces: list[dict[str, bytes]]) -> dict[str, bytes]:
        texts: dict[str, bytes] = {}
        for group in groups:
            parts = [piece for (of, _), piece in zip(jobs, pieces, strict=True) if of == group]
            merged = {arch: merge_ptx([part[arch] for part in parts]) for arch in group}
            texts.update(merged if all(merged.values()) else _device_objects(module, group, "isa"))
        texts = {arch: texts[arch] for arch in archs}  # before ptxas: this check says more than it would
        unresolved = {n.decode() for text in texts.values()
                      for n in re.findall(rb"^\s*\.extern\s+\.func\s*(?:\([^)]*\)\s*)?(\w+)", text, re.MULTILINE)}
        if unresolved:
            raise CompileError(f"the cuda kernels call {', '.join(sorted(unresolved))}, which no library defines "
                               "(libdevice was not linked: is nvvm/libdevice in the CUDA wheel?)")
        return texts
    return [(sum(sizes.get(name, 0) for name in run), partial(_device_objects, module, group, "isa", run))
            for group, run in jobs], join


def _runs(names: list[str], sizes: dict[str, int], parts: int) -> list[tuple[str, ...]]:
    """`names` in at most `parts` runs of consecutive ones, cut where the running size passes each
    `parts`th of the total, none smaller than _RUN_OPS (a piece has its own costs: libdevice...)."""
    total, runs, start, running, cut = sum(sizes.get(name, 0) for name in names), [], 0, 0, 0
    for i, name in enumerate(names):
        running += sizes.get(name, 0)
        if i == len(names) - 1 or running - cut >= _RUN_OPS and running * parts >= total * (len(runs) + 1):
            runs.append(tuple(names[start:i + 1]))
            start, cut = i + 1, running
    return runs


_RUN_OPS = 2000


def merge_ptx(pieces: list[bytes]) -> bytes | None:
    """The PTX of runs of kernels lowered apart, joined as LLVM prints them lowered together: one
    header; the declarations MLIR puts at the module's start (dynamic shared memory's, then the
    mbarriers', the last kernel's first, their names numbered on), then the other ones; the
    entries in order, their block labels ($L__BB<function>_<block>) numbered on. None where a
    piece holds what this does not join (no entry, a .func, debug info...)."""
    head, externs, barriers, declarations, bodies, entries = None, [], [], [], [], 0
    for text in pieces:
        lines = text.split(b"\n")
        starts = [i for i, line in enumerate(lines) if line.startswith(b".visible .entry")]
        first = next((i for i, line in enumerate(lines) if line.startswith(b"\t// .globl\t")), None)
        if not starts or first is None or lines[starts[0] - 1] != b"" or re.search(
                rb"^\s*(\.visible\s+|\.weak\s+)?\.func\b|^\s*\.(file|loc)\b|\$L__(?!BB\d+_)", text, re.MULTILINE):
            return None
        head = lines[:first] if head is None else head
        names = sorted({int(n or -1) for n in re.findall(rb"\b__mbarrier(?:_(\d+))?\b", text)})
        text = re.sub(rb"\b__mbarrier(?:_(\d+))?\b", lambda m: _barrier(len(barriers) + int(m[1] or -1) + 1), text)
        text = re.sub(rb"\$L__BB(\d+)_", lambda m, at=entries: b"$L__BB%d_" % (at + int(m[1])), text)
        lines, own, entries = text.split(b"\n"), [], entries + len(starts)
        for line in lines[first + 1:starts[0] - 1]:
            kind = externs if line.startswith(b".extern ") else own if b"__mbarrier" in line else declarations
            kind.extend([line] if line not in kind else [])
        barriers[:0] = own + [b""] * (len(names) - len(own))  # (placeholders keep the count)
        bodies.append(b"\n".join([lines[first]] + lines[starts[0]:]))
    if not bodies:
        return None
    globl, first_body = bodies[0].split(b"\n", 1)
    return b"\n".join([*head, globl, *externs, *filter(None, barriers), *declarations, b"", first_body.rstrip(b"\n"),
                       *(body.rstrip(b"\n") for body in bodies[1:])]) + b"\n"


def _barrier(number: int) -> bytes:
    """The name MLIR gives the `number`th mbarrier of a module: __mbarrier, __mbarrier_0..."""
    return b"__mbarrier" if number == 0 else b"__mbarrier_%d" % (number - 1)


def _ptxas(arch: str, text: bytes) -> bytes:
    """One CUBIN: ptxas run as MLIR's gpu-module-to-binary runs it (the same bytes come out)."""
    with tempfile.TemporaryDirectory(prefix="hexir-ptxas-") as scratch:
        source, cubin = Path(scratch) / "kernels.ptx", Path(scratch) / "kernels.cubin"
        source.write_bytes(text)
        command = [str(Path(cuda_toolkit()) / "bin" / "ptxas"), "-arch", arch, str(source), "-o", str(cubin),
                   "--opt-level", "3"]
        result = subprocess.run(command, capture_output=True)
        if result.returncode != 0:
            raise CompileError(f"cuda code generation failed for {arch}: ptxas exited {result.returncode}:\n"
                               f"{result.stderr.decode(errors='replace').strip()}\ncommand: {shlex.join(command)}")
        return cubin.read_bytes()


def assemble(texts: dict[str, bytes]) -> CudaBinary:
    """CUBINs of `ptx`'s texts (ptxas, one process per architecture, side by side) and the PTX
    of the lowest one."""
    with ThreadPoolExecutor(len(texts)) as pool:
        cubins = dict(zip(texts, pool.map(_ptxas, texts, texts.values()), strict=True))
    lowest = next(iter(texts))
    return CudaBinary(cubins, (lowest, texts[lowest]))


def compile_kernels(module: ir.Module, archs: tuple[str, ...]) -> CudaBinary:
    """CUBINs for every arch and the PTX of the lowest one (the MLIR in one piece, here)."""
    pieces, join = ptx_pieces(module, archs, 1)
    return assemble(join([piece() for _, piece in pieces]))
