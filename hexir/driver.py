"""The compiler driver: the options, the one ordered list of stages, and running a prefix of it.

It is the only module that imports both the passes and the backends (the layers below it
never import upward: tests/compiler/test_layers.py holds that). `-emit=<stage>` runs the
stages up to and including that one and returns what it makes:

    mlir         the traced hexir graph (or the .mlir input), verified
    mlir-hetero  partitioned: every op has a device, transfers inserted
    mlir-tir     16-bit contracts widened to float32, element-wise ops fused into their linears,
                 then hextir kernels built by the schedules (loops with schedules, work/launch
                 records); the graph calls them, calls of identical kernels one kernel
    mlir-linalg  kernels lowered into upstream scf/memref/arith loops, with the .hxb calling
                 convention (the name is the original tool's)
    mlir-gpu     cuda kernels outlined into gpu.module / gpu.func (NVVM-ready)
    llvm         LLVM IR of the cpu kernels
    ptx          PTX of the cuda kernels, per target architecture
    hxb          the packaged module
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from mlir import ir, passmanager

from hexir.backend import cpu as cpu_backend
from hexir.backend import cuda as cuda_backend
from hexir.backend.custom import build_custom
from hexir.backend.package import kernel_tables, package
from hexir.dialects import hexir as hx
from hexir.dialects import hextir as ht
from hexir.errors import ArgumentError, CompileError, HexirError, PlacementError
from hexir.passes.fuse import fuse
from hexir.passes.lower_to_tir import lower_to_tir
from hexir.passes.pack_weights import pack_weights
from hexir.passes.partition import partition, placeable_ops
from hexir.passes.share_kernels import share_kernels
from hexir.passes.tir_to_loops import tir_to_loops
from hexir.passes.to_gpu import cuda_kernels_to_gpu
from hexir.passes.to_llvm import cpu_kernels_to_llvm
from hexir.passes.verify import verify
from hexir.passes.widen import widen
from hexir.target import Target


@dataclass(frozen=True)
class Options:
    """Everything besides the program that changes what is compiled (part of the jit key)."""

    placement: tuple[tuple[str, str], ...] = ()     # (op name, device), e.g. ("hexir.linear", "cuda")
    target: Target = field(default_factory=Target)
    kernel_search_path: tuple[str, ...] = ()        # where custom kernels' files are looked for
    matmul_precision: str = "highest"               # float32 contracts: "highest" or "tf32" (MATMUL_PRECISIONS)


Step = Callable[[ir.Module, Options], object]


def _passes(*steps: tuple[str, Callable[[ir.Module, Options], None]] | str) -> Step:
    """A stage made of passes, ours (a name and a function) or upstream's (a pipeline text),
    run by one PassManager so that they compose by name."""
    def run(module: ir.Module, options: Options) -> ir.Module:
        with module.context:
            manager = passmanager.PassManager("builtin.module")
            for step in steps:
                if isinstance(step, str):
                    manager.add(step)
                    continue
                name, body = step

                def pass_body(op: ir.Operation, pass_: object, body: Callable = body) -> None:
                    with module.context, ir.Location.unknown():  # types need a location; ops take their own
                        body(module, options)
                pass_body.__name__ = name
                manager.add(pass_body, name=name)
            try:
                manager.run(module.operation)
            except HexirError:
                raise
            except ir.MLIRError as error:  # an upstream pass or the verifier refused our IR
                raise CompileError(f"pass pipeline failed: {error}") from None
        return module
    return run


def _outline_gpu(module: ir.Module, options: Options) -> ir.Module:
    if ht.generated_kernels(module, "cuda"):
        cuda_kernels_to_gpu(module)
    return module


def _llvm(module: ir.Module, options: Options) -> str:
    if not ht.generated_kernels(module, "cpu"):
        return "; no cpu kernels\n"
    return cpu_backend.llvm_ir(cpu_kernels_to_llvm(module))


def _ptx(module: ir.Module, options: Options) -> str:
    """The cuda kernels' PTX for each target architecture (what ptxas turns into the CUBINs)."""
    if not ht.generated_kernels(module, "cuda"):
        return "// no cuda kernels\n"
    archs = options.target.cuda_archs
    cuda_backend.check_archs(archs)
    return "".join(f"// ---- {arch}\n" + cuda_backend.ptx_of(module, arch) for arch in archs)


def _hxb(module: ir.Module, options: Options) -> bytes:
    target = options.target
    cpu_table = kernel_tables(module)[0]
    twins = [ht.identity_of(k).twin for k in ht.generated_kernels(module, "cpu")]
    own, lowest = not all(twins), target.cpu_levels[-1]
    with tempfile.TemporaryDirectory(prefix="hexir-custom-") as scratch, \
            ThreadPoolExecutor(len(target.cpu_levels) + 2) as tools:
        custom = build_custom(module, target.cpu_levels, target.cuda_archs, Path(scratch))
        # MLIR lowers one piece after another here (it holds the GIL); each piece's tools (opt,
        # llc, cc, ptxas: processes of their own) start in the pool as soon as it is made. The
        # cpu twins are one object (the lowest level's code) that every level's library links.
        twin_object = tools.submit(cpu_backend.compile_object,
                                   cpu_backend.llvm_ir(cpu_kernels_to_llvm(module, lowest, twins=True)),
                                   lowest, Path(scratch) / "twins.o") if any(twins) else None
        libraries = [tools.submit(_library, cpu_backend.llvm_ir(cpu_kernels_to_llvm(module, level, twins=False))
                                  if own else None, level, custom.cpu_objects[level], cpu_table, twin_object)
                     for level in target.cpu_levels  # best first; a module of twins alone: the lowest level's
                     if own or custom.cpu_objects[level] or (twin_object and level == lowest)]
        cuda_binary = tools.submit(cuda_backend.assemble, cuda_backend.ptx(module, target.cuda_archs)) \
            if ht.generated_kernels(module, "cuda") else None
        libraries = [library.result() for library in libraries]
        cuda_binary = cuda_binary.result() if cuda_binary else None
    return package(module, libraries, cuda_binary, custom)


def _library(llvm_text: str | None, level: str, objects: list[str], table: bytes,
             twin_object: Future | None) -> cpu_backend.CpuLibrary:
    return cpu_backend.compile_kernels(llvm_text, level, objects, table,
                                       [twin_object.result()] if twin_object else ())


#: The stages in order; each transforms the module in place, the last ones make text or bytes.
#: (cse only after lower-to-tir: canonicalize would fold 1-trip loops away, and their schedules with them)
STAGES: list[tuple[str, Step]] = [
    ("mlir", _passes(("hexir-verify", lambda m, o: verify(m)))),
    ("mlir-hetero", _passes(("hexir-partition", lambda m, o: partition(m, dict(o.placement))))),
    ("mlir-tir", _passes(("hexir-widen", lambda m, o: widen(m, o.target, o.matmul_precision)),
                         ("hexir-fuse", lambda m, o: fuse(m)),
                         ("hexir-pack-weights", lambda m, o: pack_weights(m, o.target, o.matmul_precision)),
                         ("hexir-lower-to-tir", lambda m, o: lower_to_tir(m, o.target, o.matmul_precision)), "cse",
                         ("hexir-share-kernels", lambda m, o: share_kernels(m)))),
    ("mlir-linalg", _passes(("hextir-to-loops", lambda m, o: tir_to_loops(m)))),
    ("mlir-gpu", _outline_gpu),
    ("llvm", _llvm),
    ("ptx", _ptx),
    ("hxb", _hxb),
]
STAGE_NAMES = tuple(name for name, _ in STAGES)
_TERMINAL = ("llvm", "ptx", "hxb")  # stages that make text or bytes rather than a module


def run_stage(module: ir.Module, stage: str, options: Options) -> ir.Module | str | bytes:
    """Run the stages up to `stage` on `module` (in place) and return what that stage makes."""
    if stage not in STAGE_NAMES:
        raise ArgumentError(f"unknown stage {stage!r}; expected one of {', '.join(STAGE_NAMES)}")
    result: object = module
    for name, step in STAGES:
        if name in _TERMINAL and name != stage:
            continue
        result = step(module, options)
        if name == stage:
            return result
        if name == "mlir-hetero":  # (the devices are known from here on)
            options = with_wgmma(module, options)
    raise AssertionError("unreachable: the stage is in the list")


def with_wgmma(module: ir.Module, options: Options) -> Options:
    """The options with sm_90a added to a target of sm_90 (without it) where a cuda linear would
    run on wgmma there (twice mma.sync's rate; docs/api.md): 16-bit, or float32 in TF32 with a
    constant w, K (and N) such that TMA can read the operands. Other modules do not pay for
    the image's compile."""
    archs = options.target.cuda_archs
    if "sm_90" not in archs or "sm_90a" in archs:
        return options
    for op in hx.main_function(module).regions[0].blocks[0].operations:
        op = op.operation
        if op.name != "hexir.linear" or hx.device_of(op) != "cuda":
            continue
        dtype, (k, n) = hx.dtype_of(op.result.type), hx.shape_of(op.operands[1].type)
        if not isinstance(k, int) or not isinstance(n, int):
            continue
        constant = not isinstance(op.operands[1].owner, ir.Block) and op.operands[1].owner.name == "hexir.constant"
        if dtype in hx.HALVES and k % 8 == n % 8 == 0 or dtype == "float32" and \
                options.matmul_precision == "tf32" and constant and k % 4 == 0:
            return replace(options, target=replace(options.target, cuda_archs=(*archs, "sm_90a")))
    return options


def compile_module(module: ir.Module, options: Options) -> bytes:
    """The .hxb bytes of a hexir module."""
    return run_stage(module, "hxb", options)


#: What a float32 contract's products may be (torch's set_float32_matmul_precision): "highest"
#: float32; "tf32" inputs rounded to TF32 on the cuda tensor cores (the cpu computes float32).
MATMUL_PRECISIONS = ("highest", "tf32")


def parse_precision(value: object) -> str:
    """A `matmul_precision`, checked."""
    if value not in MATMUL_PRECISIONS:
        raise ArgumentError(f"matmul_precision must be one of {', '.join(map(repr, MATMUL_PRECISIONS))}, got {value!r}")
    return value


def parse_placement(text: str | dict | None) -> tuple[tuple[str, str], ...]:
    """`hexir.linear=cuda,hexir.relu=cpu` (or a dict) -> validated (op, device) pairs; `*=cuda`
    places every op not named otherwise."""
    if not text:
        return ()
    items = text.items() if isinstance(text, dict) else (
        part.split("=", 1) if "=" in part else (part, None) for part in text.split(",") if part.strip())
    pairs = {}
    placeable = placeable_ops()
    for op, device in items:
        if not isinstance(op, str) or not isinstance(device, (str, type(None))):
            raise PlacementError(f"placement: expected op name -> device name strings, got {op!r}: {device!r}")
        op = op.strip()
        if op not in placeable and op != "*":
            raise PlacementError(f"placement: unknown op {op!r}; placeable ops are * (all) and {', '.join(placeable)}")
        if device is None or device.strip() not in hx.DEVICES:
            raise PlacementError(f"placement: unknown device {device!r} for {op}; expected one of "
                                 f"{', '.join(hx.DEVICES)}")
        pairs[op] = device.strip()
    return tuple(sorted(pairs.items()))
