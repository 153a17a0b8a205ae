"""What code generation can aim at, and the limits of each device: x86-64 levels, CUDA
architectures, CUDA's launch limits. Every layer reads these here (the frontend checks a custom
kernel's launch, the schedules size their tiles, the backends pick flags), so a limit is said once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from hexir.errors import CompileError, TargetError

#: x86-64 micro-architecture levels and the /proc/cpuinfo flags each one needs.
_V1 = ("sse", "sse2")
_V2 = _V1 + ("pni", "ssse3", "sse4_1", "sse4_2", "popcnt", "cx16")
_V3 = _V2 + ("avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "abm", "movbe")
_V4 = _V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
CPU_LEVELS = {"x86-64": _V1, "x86-64-v2": _V2, "x86-64-v3": _V3, "x86-64-v4": _V4}

#: Lowest PTX ISA version able to express each architecture (PTX ISA release notes). NVPTX
#: aborts the process (it does not raise) when asked for a PTX version that cannot express the
#: chip, so an architecture is checked against this table before any pass runs.
PTX_FEATURES = {"sm_75": "+ptx63", "sm_80": "+ptx70", "sm_86": "+ptx71", "sm_87": "+ptx74",
                "sm_89": "+ptx78", "sm_90": "+ptx80", "sm_90a": "+ptx80", "sm_100": "+ptx86", "sm_103": "+ptx88",
                "sm_120": "+ptx87", "sm_121": "+ptx88"}
CUDA_ARCHS = tuple(PTX_FEATURES)



def arch_number(arch: str) -> int:
    """The compute capability an architecture name stands for, as a number: sm_90a -> 90 (an "a"
    name's image uses that capability's own instructions, wgmma for one, and runs on it alone)."""
    return int(arch[3:].rstrip("a"))


#: CUDA's limits on a launch: blocks per grid axis, threads per block; the shared memory a block
#: may have (opting in past 48 KiB), by architecture (the CUDA programming guide's table).
MAX_GRID = (2**31 - 1, 65535, 65535)
MAX_BLOCK_THREADS = 1024
MAX_SHARED_BYTES = {"sm_75": 64 << 10, "sm_80": 163 << 10, "sm_86": 99 << 10, "sm_87": 163 << 10,
                    "sm_89": 99 << 10, "sm_90": 227 << 10, "sm_90a": 227 << 10, "sm_100": 227 << 10,
                    "sm_103": 227 << 10, "sm_120": 99 << 10, "sm_121": 99 << 10}


#: What an exported module carries: AVX-512, AVX2+FMA and the portable baseline; the runtime
#: runs the best one the host supports.
DEFAULT_CPU_LEVELS = ("x86-64-v4", "x86-64-v3", "x86-64")


@functools.cache
def _host_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as file:
            line = next((line for line in file if line.startswith("flags")), "")
    except OSError:
        line = ""
    return frozenset(line.partition(":")[2].split())


def host_level(flags: set[str] | frozenset[str] | None = None) -> str:
    """The best x86-64 level this machine runs (its /proc/cpuinfo flags), the baseline if unknown."""
    flags = _host_flags() if flags is None else flags
    fitting = [level for level, needed in CPU_LEVELS.items() if set(needed) <= flags]
    return fitting[-1] if fitting else "x86-64"


@dataclass(frozen=True)
class Target:
    """The machines a module is compiled for: x86-64 levels (best first: a library of cpu code
    for each, the runtime picks the best the host runs) and CUDA architectures."""

    cpu_levels: tuple[str, ...] = DEFAULT_CPU_LEVELS
    cuda_archs: tuple[str, ...] = ("sm_90",)

    @property
    def cpu(self) -> str:
        """The primary (best) level: the one `-emit` stages show first."""
        return self.cpu_levels[0]

    def __post_init__(self) -> None:
        for level in self.cpu_levels:
            if level not in CPU_LEVELS:
                raise TargetError(f"cpu target {level!r} is not supported; expected one of {', '.join(CPU_LEVELS)}")
        if not self.cpu_levels:
            raise TargetError("a target needs at least one cpu level")
        order = list(CPU_LEVELS)
        object.__setattr__(self, "cpu_levels", tuple(sorted(dict.fromkeys(self.cpu_levels), key=order.index,
                                                            reverse=True)))
        for arch in self.cuda_archs:
            if arch not in PTX_FEATURES:
                raise TargetError(f"{arch!r} is not a supported CUDA architecture; expected one of "
                                  f"{', '.join(CUDA_ARCHS)}")


def parse_target(text: str | None, base: Target | None = None) -> Target:
    """`cpu:x86-64-v3,cpu:x86-64,cuda:sm_80,cuda:sm_90` -> a Target (`base`'s choices where the
    text is silent; `cpu:host` is the level of the machine that compiles)."""
    base = base or Target()
    if not text:
        return base
    levels, archs = [], []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        device, _, arch = part.partition(":")
        if device == "cpu":
            arch = host_level() if arch == "host" else arch
            if arch and arch not in CPU_LEVELS:
                raise TargetError(f"target {part!r}: unknown cpu level {arch!r}; expected one of "
                                  f"{', '.join(CPU_LEVELS)} or host")
            levels.append(arch or "x86-64")
        elif device == "cuda":
            arch = arch or "sm_90"
            if arch not in PTX_FEATURES:
                raise TargetError(f"target {part!r}: {arch!r} is not a supported CUDA architecture; "
                                  f"expected one of {', '.join(CUDA_ARCHS)}")
            archs.append(arch)
        else:
            raise TargetError(f"target {part!r}: unknown device {device!r}; expected cpu or cuda")
    return Target(tuple(levels) or base.cpu_levels, tuple(dict.fromkeys(archs)) or base.cuda_archs)


def check_launch(kernel: str, grid: list[int | None], block: list[int]) -> None:
    """CompileError unless CUDA can launch `grid` x `block`; a None grid axis depends on a
    size known only at run time (the runtime checks it per call)."""
    for axis, (blocks, limit) in enumerate(zip(grid, MAX_GRID, strict=True)):
        if blocks is not None and blocks > limit:
            raise CompileError(f"cuda kernel {kernel}: its launch needs {blocks} blocks along "
                               f"{'xyz'[axis]}, more than CUDA's {limit}; the tensor is too large for one launch")
    if block[0] * block[1] * block[2] > MAX_BLOCK_THREADS:
        raise CompileError(f"cuda kernel {kernel}: a block of {block} has more than {MAX_BLOCK_THREADS} threads")
