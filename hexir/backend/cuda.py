"""cuda backend: `gpu.module @hexir_cuda` -> NVVM -> a CUBIN per architecture, plus PTX.

One binary holds every cuda kernel of the module, per architecture (`-target=cuda:sm_80,
cuda:sm_90`; default sm_90). PTX for the lowest architecture rides along so a newer GPU can
JIT it. MLIR lowers the kernels to PTX once for every architecture (`ptx`); ptxas, from the
`nvidia-cuda-nvcc` wheel else a CUDA toolkit on PATH, then makes each CUBIN in a process of its
own (`assemble`: the command MLIR's serializer runs, so the same bytes), beside the next MLIR work.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from mlir import ir, passmanager
from mlir.dialects import arith, gpu, llvm

from hexir.backend.toolchain import nvidia_wheel_file
from hexir.dialects.hextir import ARCH, GPU_MODULE
from hexir.errors import CompileError, TargetError
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


def _device_objects(module: ir.Module, archs: tuple[str, ...], format_: str) -> dict[str, bytes]:
    """Lower a copy of the gpu.module for `archs` and serialize it (`isa`: PTX; `bin`: MLIR runs
    ptxas too)."""
    with module.context, ir.Location.unknown():
        copy = ir.Module.create()
        copy.operation.attributes["gpu.container_module"] = ir.UnitAttr.get()
        with ir.InsertionPoint(copy.body):
            for op in module.body.operations:
                if op.operation.name == "gpu.module":
                    kernels = op.operation.clone().regions[0].blocks[0].operations
                    for kernel in [k for k in kernels if ARCH in k.attributes]:  # another image's own
                        if ir.StringAttr(kernel.attributes[ARCH]).value not in archs:
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


def ptx(module: ir.Module, archs: tuple[str, ...]) -> dict[str, bytes]:
    """The PTX of the module's cuda kernels for each of `archs`: the MLIR half of the build,
    lowered once for the architectures that share every kernel (it holds the GIL; `assemble` runs
    ptxas beside it). A kernel built for one architecture (`hextir.arch`: a variant using sm_90a's
    wgmma) is in that architecture's text alone."""
    check_archs(archs)
    archs = tuple(sorted(set(archs), key=lambda a: (arch_number(a), a)))  # sm_90 before sm_90a
    own = {ir.StringAttr(k.attributes[ARCH]).value for op in module.body.operations if op.operation.name == "gpu.module"
           for k in op.regions[0].blocks[0].operations if ARCH in k.attributes}
    texts: dict[str, bytes] = {}
    for group in [tuple(a for a in archs if a not in own)] + [(a,) for a in archs if a in own]:
        texts.update(_device_objects(module, group, "isa") if group else {})
    texts = {arch: texts[arch] for arch in archs}  # before ptxas: this check says more than it would
    unresolved = {n.decode() for text in texts.values()
                  for n in re.findall(rb"^\s*\.extern\s+\.func\s*(?:\([^)]*\)\s*)?(\w+)", text, re.MULTILINE)}
    if unresolved:
        raise CompileError(f"the cuda kernels call {', '.join(sorted(unresolved))}, which no "
                           "library defines (libdevice was not linked: is nvvm/libdevice in the CUDA wheel?)")
    return texts


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
    """CUBINs for every arch and the PTX of the lowest one."""
    return assemble(ptx(module, archs))
