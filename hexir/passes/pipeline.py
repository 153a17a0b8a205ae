"""The one ordered list of stages; `-emit=<stage>` runs its prefix and prints the result.

    mlir         the traced hexir graph (or the .mlir input, verified)
    mlir-hetero  partitioned: every op has a device, transfers inserted
    mlir-tir     relus fused into their linears, then hextir kernels with their schedules;
                 the graph calls them
    mlir-linalg  kernels lowered into upstream scf/memref/arith loops (the name is the
                 original tool's; linalg-level and loop-level IR are one stage here)
    mlir-gpu     cuda kernels outlined into gpu.module / gpu.func (NVVM-ready)
    llvm         LLVM IR of the cpu kernels
    hxb          the packaged module
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from mlir import ir, passmanager

from hexir.backend import cpu as cpu_backend
from hexir.backend import cuda as cuda_backend
from hexir.backend.cuda import PTX_FEATURES
from hexir.backend.custom import build_custom
from hexir.backend.package import package
from hexir.dialects.hexir import DEVICES, PLACEABLE_OPS
from hexir.errors import ArgumentError, CompileError, HexirError, PlacementError, TargetError
from hexir.passes.common import generated_kernels
from hexir.passes.fuse import fuse
from hexir.passes.lower_to_tir import lower_to_tir
from hexir.passes.partition import partition
from hexir.passes.tir_to_loops import tir_to_loops
from hexir.passes.to_gpu import cuda_kernels_to_gpu
from hexir.passes.to_llvm import cpu_kernels_to_llvm
from hexir.passes.verify import verify

STAGES = ("mlir", "mlir-hetero", "mlir-tir", "mlir-linalg", "mlir-gpu", "llvm", "hxb")


@dataclass(frozen=True)
class Options:
    """Everything besides the program that changes what is compiled (part of the jit key)."""

    placement: tuple[tuple[str, str], ...] = ()     # (op name, device), e.g. ("hexir.linear", "cuda")
    cpu: str = "x86-64"
    cuda_archs: tuple[str, ...] = ("sm_90",)
    kernel_search_path: tuple[str, ...] = ()            # where custom kernels' files are looked for

    def placement_map(self) -> dict[str, str]:
        return dict(self.placement)


def _python_pass(name: str, run: Callable[[ir.Module], None], module: ir.Module) -> Callable:
    """Wrap one of our passes for the PassManager, so it composes with upstream ones by name."""
    def pass_body(op: ir.Operation, pass_: object) -> None:
        with module.context, ir.Location.unknown():  # types need a location; ops take their own
            run(module)
    pass_body.__name__ = name
    return pass_body


def _run(module: ir.Module, steps: list[tuple[str, Callable[[ir.Module], None]] | str]) -> None:
    with module.context:
        manager = passmanager.PassManager("builtin.module")
        for step in steps:
            if isinstance(step, str):
                manager.add(step)
            else:
                manager.add(_python_pass(step[0], step[1], module), name=step[0])
        try:
            manager.run(module.operation)
        except HexirError:
            raise
        except ir.MLIRError as error:  # an upstream pass or the verifier refused our IR
            raise CompileError(f"pass pipeline failed: {error}") from None


def run_stage(module: ir.Module, stage: str, options: Options) -> ir.Module | str | bytes:
    """Run the pipeline on `module` (in place) up to `stage` and return what that stage makes."""
    if stage not in STAGES:
        raise ArgumentError(f"unknown stage {stage!r}; expected one of {', '.join(STAGES)}")
    reached = STAGES.index(stage)
    _run(module, [("hexir-verify", verify)])
    if reached >= STAGES.index("mlir-hetero"):
        _run(module, [("hexir-partition", lambda m: partition(m, options.placement_map()))])
    if reached >= STAGES.index("mlir-tir"):
        # cse only: canonicalize would fold 1-trip loops away, and their schedules with them
        _run(module, [("hexir-fuse", fuse), ("hexir-lower-to-tir", lower_to_tir), "cse"])
    if reached >= STAGES.index("mlir-linalg"):
        _run(module, [("hextir-to-loops", tir_to_loops)])
    if reached >= STAGES.index("mlir-gpu") and generated_kernels(module, "cuda"):
        cuda_kernels_to_gpu(module)
    if reached <= STAGES.index("mlir-gpu"):
        return module
    cpu_module = cpu_kernels_to_llvm(module) if generated_kernels(module, "cpu") else None
    if stage == "llvm":
        return cpu_backend.llvm_ir(cpu_module) if cpu_module is not None else "; no cpu kernels\n"
    with tempfile.TemporaryDirectory(prefix="hexir-custom-") as scratch:
        custom = build_custom(module, options.cpu, options.cuda_archs, Path(scratch))
        library = None
        if cpu_module is not None or custom.cpu_objects:
            library = cpu_backend.compile_kernels(cpu_module, options.cpu, custom.cpu_objects)
    cuda_binary = None
    if generated_kernels(module, "cuda"):
        cuda_binary = cuda_backend.compile_kernels(module, options.cuda_archs)
    return package(module, library, cuda_binary, custom)


def compile_module(module: ir.Module, options: Options) -> bytes:
    """The .hxb bytes of a hexir module."""
    return run_stage(module, "hxb", options)


# ---- option parsing (shared by @jit, export and the CLI) --------------------------------

CUDA_ARCHS = tuple(PTX_FEATURES)  # the architectures the cuda backend knows a PTX version for


def parse_placement(text: str | dict | None) -> tuple[tuple[str, str], ...]:
    """`hexir.linear=cuda,hexir.relu=cpu` (or a dict) -> validated (op, device) pairs."""
    if not text:
        return ()
    items = text.items() if isinstance(text, dict) else (
        part.split("=", 1) if "=" in part else (part, None) for part in text.split(",") if part.strip())
    pairs = {}
    for op, device in items:
        if not isinstance(op, str) or not isinstance(device, (str, type(None))):
            raise PlacementError(f"placement: expected op name -> device name strings, got {op!r}: {device!r}")
        op = op.strip()
        if op not in PLACEABLE_OPS:
            raise PlacementError(f"placement: unknown op {op!r}; placeable ops are {', '.join(PLACEABLE_OPS)}")
        if device is None or device.strip() not in DEVICES:
            raise PlacementError(f"placement: unknown device {device!r} for {op}; expected one of "
                                 f"{', '.join(DEVICES)}")
        pairs[op] = device.strip()
    return tuple(sorted(pairs.items()))


def parse_target(text: str | None, base: Options | None = None) -> Options:
    """`cpu:x86-64-v3,cuda:sm_80,cuda:sm_90` -> Options with those code generation targets."""
    base = base or Options()
    if not text:
        return base
    cpu, archs = base.cpu, []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        device, _, arch = part.partition(":")
        if device == "cpu":
            if arch and arch not in cpu_backend.CPU_LEVELS:
                raise TargetError(f"target {part!r}: unknown cpu level {arch!r}; expected one of "
                                  f"{', '.join(cpu_backend.CPU_LEVELS)}")
            cpu = arch or cpu
        elif device == "cuda":
            arch = arch or "sm_90"
            if arch not in CUDA_ARCHS:
                raise TargetError(f"target {part!r}: {arch!r} is not a supported CUDA architecture; "
                                  f"expected one of {', '.join(CUDA_ARCHS)}")
            archs.append(arch)
        else:
            raise TargetError(f"target {part!r}: unknown device {device!r}; expected cpu or cuda")
    return replace(base, cpu=cpu, cuda_archs=tuple(dict.fromkeys(archs)) or base.cuda_archs)
