"""`hexir-run --info`: a readable account of a checked module, loading and running nothing.

Entries with their programs, kernels (op and what it computes, its `expr` as text, sizes, the parallel extent or launch
grid as expressions like `ceildiv(batch, 64)`, a custom kernel's source and where its cpu code
is), the cpu libraries (and which one this machine would load), constants and blobs. Every
string that comes from the file (producer, names, sources) is printed with its control
characters escaped, as `repr` writes them, so a file cannot send escape sequences to a terminal.
"""

from __future__ import annotations

from typing import Any

from .cpu import pick_library
from .errors import DeviceError
from .format import Code, Hxb, Kernel, Work, layouts, to_text
from .format.scalars import Program, program_text, text
from .module import Signature
from .signing import Key, signer


def field(label: str, value: Any) -> str:
    """A header line: `label         : value`."""
    return f"{label:<14}: {value}"


def safe(text: str) -> str:
    """`text` with every non-printable character escaped (`\\x1b`, `\\n`, `\\u2028`)."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def describe(hxb: Hxb, path: str, verified: Key | None = None) -> str:
    """The description of a checked module read from `path`; `verified`: the trusted key its
    signature was verified with, if it was."""
    manifest = hxb.manifest
    lines = [field("module", safe(str(path))), field("version", hxb.version)]
    lines += [field("producer", safe(manifest.producer)), field("size", f"{len(hxb.data)} bytes")]
    key = signer(hxb.data)
    check = f"verified with {safe(verified.source)}" if verified else "not verified: no --trust key given"
    lines.append(field("signed by", f"key {key} (Ed25519, {check})" if key else "nobody (unsigned)"))
    constants, kernels = manifest.constants, manifest.kernels
    for entry in manifest.entries:
        lines += ["", f"entry {Signature.of(entry)}"]
        for command in entry.program:
            if command.op == "input":
                text, dst = f"input {entry.inputs[command.index][0]}", command.dst
            elif command.op == "constant":
                text, dst = f"constant {safe(constants[command.constant].name)}", command.dst
            elif command.op == "call":
                *sources, dst = command.args
                text = f"call {safe(kernels[command.kernel].name)}({', '.join(f'%{s}' for s in sources)})"
            elif command.op == "transfer":
                text, dst = f"transfer %{command.src}", command.dst
            else:
                sources = [command.src] if command.op == "print" else command.srcs
                lines.append(f"  {command.op} {', '.join(f'%{s}' for s in sources)}")
                continue
            buffer = entry.buffers[dst]
            lines.append(f"  {f'%{dst} = {text}':<40} # {buffer.type} on {buffer.device}")
    lines += ["", "kernels"]
    for i, kernel in enumerate(kernels):
        lines += _kernel(i, kernel)
    if manifest.cpu is not None:
        try:
            picked, why = pick_library(manifest.cpu), ""
        except DeviceError as error:
            picked, why = None, f"  this machine runs none of them: {error}"
        lines += ["", f"cpu {safe(manifest.cpu.arch)}, libraries (best first)"]
        for build in manifest.cpu.libraries:
            features = " ".join(map(safe, build.features)) or "none"
            mark = "  <- this machine" if build == picked else ""
            lines.append(f"  {safe(build.cpu)}: features {features}, library in blob {build.library}{mark}")
        lines += [why] if why else []
    lines += ["", "constants" if constants else "constants: none"]
    for i, constant in enumerate(constants):
        lines.append(f"  [{i}] {safe(constant.name)}: {constant.type} in blob {constant.blob}")
    lines += ["", "blobs"]
    for i, blob in enumerate(manifest.blobs):
        lines.append(f"  [{i}] {safe(blob.name)}: {blob.size} bytes at {blob.offset}, sha256 {blob.sha256[:16]}...")
    return "\n".join(lines) + "\n"


def _kernel(index: int, kernel: Kernel) -> list[str]:
    args = ", ".join(f"{'write' if j == len(kernel.args) - 1 else 'read'} {arg}" for j, arg in enumerate(kernel.args))
    lines = [f"  [{index}] {safe(kernel.name)}: {kernel.device} {kernel.op}({args})"]
    if kernel.expr is not None:  # (the tree's text holds no string from the file but its op names, checked)
        meaning = layouts.text(kernel.expr) if kernel.op == "layout" else \
            program_text(kernel.expr) if isinstance(kernel.expr, Program) else text(kernel.expr)
        lines.append(f"      computes {meaning}")
    integers = ", ".join(map(to_text, kernel.integers))
    if kernel.gpu_code is None:
        lines.append(f"      symbol {kernel.symbol}, {_where(kernel.cpu_code, source=False)}")
    else:
        launch = kernel.gpu_code.launch
        grid = ", ".join(map(to_text, launch.grid))
        lines.append(f"      symbol {kernel.symbol}, grid [{grid}], block {list(launch.block)}, "
                     f"shared {launch.shared_bytes} bytes")
    if kernel.custom:
        lines.append(f"      source {safe(kernel.source)}, scalars [{integers}]")
    elif kernel.integers:
        lines.append(f"      sizes {integers}")
    if kernel.gpu_code is not None:
        images = ", ".join(f"{arch} in blob {blob}" for arch, blob in kernel.gpu_code.images.items())
        lines.append(f"      images: {images}")
        if kernel.cpu_code is not None:
            lines.append(f"      cpu fallback: {kernel.cpu_code.symbol}, {_where(kernel.cpu_code)}")
    return lines


def _where(code: Code, source: bool = True) -> str:
    """How host code runs: a generated kernel's parallel loop, or where a custom kernel's code is."""
    if code.work is not None:
        return _work(code.work)
    where = f"library in blob {code.library}" if code.library is not None else "in the cpu library"
    return f"from {safe(code.source)}, {where}" if source else where


def _work(work: Work) -> str:
    return (f"work extent {to_text(work.extent)}" + (f", grain {work.grain}" if work.grain != 1 else "")
            + (", one span a thread" if work.spans else ""))
