"""custom kernels: build, check and collect the user's files for the module.

Input: the declarations lower-to-tir made for each `hexir.custom_call` (`hextir.custom =
{symbol, file}`). Output: a `CustomBuild` — cpu objects to link into the
module's library, prebuilt shared objects to embed as they are, and each cuda kernel's
images (a CUBIN per target architecture and PTX, or a fatbin). Every file is checked for
its kind, architecture and the kernel's symbol here, at export time, so a module never
carries a kernel that cannot be found when it runs.
"""

from __future__ import annotations

import ctypes
import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from mlir import ir

from hexir.backend.cuda import cuda_toolkit
from hexir.backend.toolchain import c_compiler, llvm_tool, nvidia_wheel_file, run_tool
from hexir.dialects import hextir as ht
from hexir.errors import CompileError
from hexir.target import PTX_FEATURES, arch_number

_EM_X86_64, _EM_CUDA = 62, 190
_ET_REL, _ET_DYN = 1, 3


@dataclass
class CustomBuild:
    """What the custom kernels of a module add to it."""

    cpu_objects: dict[str, list[str]] = field(default_factory=dict)  # level -> objects linked into its library
    shared_objects: dict[str, bytes] = field(default_factory=dict)  # file -> a prebuilt .so
    cuda_images: dict[str, dict[str, bytes]] = field(default_factory=dict)  # file -> arch -> image


def build_custom(module: ir.Module, levels: tuple[str, ...], cuda_archs: tuple[str, ...],
                 scratch: Path) -> CustomBuild:
    """Build every custom kernel's file once (a .c file once per x86-64 level), with the
    signature check of every kernel it serves: a file may define several kernels."""
    build = CustomBuild({level: [] for level in levels})
    files: dict[str, dict[str, tuple]] = {}  # file -> symbol -> the signature its calls need
    devices: dict[str, str] = {}  # file -> the device it is built for
    for kernel in ht.kernels(module):
        if ht.custom_of(kernel) is None:
            continue
        symbol, file = ht.custom_of(kernel)
        signature = _signature(kernel)
        served = files.setdefault(file, {})
        if served.setdefault(symbol, signature) != signature:
            raise CompileError(f"custom kernel {symbol}: {Path(file).name} is called with two signatures, "
                               f"{_c_prototype(symbol, served[symbol])} and {_c_prototype(symbol, signature)}; "
                               "a C function has one")
        devices.setdefault(file, ht.kernel_of(kernel)[0])
    for file, served in files.items():
        path = Path(file)
        if not path.is_file():
            raise CompileError(f"custom kernel {next(iter(served))}: {path} no longer exists")
        if devices[file] == "cpu":
            symbols = _build_cpu(path, served, levels, scratch, build)
        else:
            build.cuda_images[file], symbols = _build_cuda(path, served, cuda_archs, scratch)
        for symbol in served:  # every kernel a file serves, not just the first
            _require_symbol(symbols, symbol, path)
    return build


# ---- the signature a call needs, checked against the user's source --------------------------
# A source file is compiled together with an assertion that its function has the signature the
# call passes (pointers of the args' element types, inputs const or not, then one 64-bit integer
# per dimension): a kernel written for double and called on float32 tensors is a compile error
# naming the kernel, not a corrupted heap at run time.

_C_TYPES = {"float32": "float", "float64": "double"}


def _signature(kernel: ir.Operation) -> tuple[tuple[str, ...], int]:
    """(the args' dtypes, inputs then output; how many dimensions follow) of a custom kernel."""
    types = [ir.MemRefType(t) for t in ir.FunctionType(ir.TypeAttr(kernel.attributes["function_type"]).value).inputs]
    dtypes = tuple("float32" if isinstance(t.element_type, ir.F32Type) else "float64" for t in types)
    return dtypes, sum(t.rank for t in types)


def _pointer_types(signature: tuple, integer: str) -> list[str]:
    """Every accepted spelling of the function's parameter list (each input const or not)."""
    dtypes, count = signature
    *inputs, output = [_C_TYPES[d] for d in dtypes]
    spellings = []
    for mask in range(2 ** len(inputs)):
        parameters = [f"{'const ' if mask >> i & 1 else ''}{t} *" for i, t in enumerate(inputs)]
        spellings.append(", ".join([*parameters, f"{output} *", *[integer] * count]))
    return spellings


def _c_prototype(symbol: str, signature: tuple) -> str:
    return f"void {symbol}({_pointer_types(signature, 'int64_t')[-1]})"


def _c_check(path: Path, served: dict[str, tuple]) -> str:
    """A C file that includes the user's and asserts each served function's type."""
    lines = [f"#include <stdint.h>\n#include {json.dumps(str(path))}\n"]
    for symbol, signature in served.items():
        cases = ", ".join(f"void (*)({p}): 1" for p in _pointer_types(signature, "int64_t"))
        message = f"custom kernel {symbol}: expected {_c_prototype(symbol, signature)} (docs/custom-kernels.md)"
        lines.append(f"_Static_assert(_Generic(({symbol}), {cases}, default: 0), {json.dumps(message)});\n")
    return "".join(lines)


def _cuda_check(served: dict[str, tuple]) -> bytes:
    """C++ appended to the user's .cu: the same assertions (NVRTC has no <type_traits>)."""
    lines = ["\ntemplate <class A, class B> struct hexir_same { static const bool value = false; };\n"
             "template <class A> struct hexir_same<A, A> { static const bool value = true; };\n"]
    for symbol, signature in served.items():
        cases = " || ".join(f"hexir_same<decltype(&{symbol}), void (*)({p})>::value"
                            for p in _pointer_types(signature, "long long"))
        message = f"custom kernel {symbol}: expected extern \"C\" __global__ " \
                  f"{_c_prototype(symbol, signature).replace('int64_t', 'long long')}"
        lines.append(f"static_assert({cases}, {json.dumps(message)});\n")
    return "".join(lines).encode()


# ---- cpu ---------------------------------------------------------------------------------

def _elf_header(path: Path) -> tuple[int, int, int, int]:
    """(type, machine, ABI version, flags) of a 64-bit ELF file, or a CompileError."""
    data = path.read_bytes()[:64]
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2:
        raise CompileError(f"{path} is not a 64-bit ELF file")
    e_type, e_machine = struct.unpack_from("<HH", data, 16)
    (e_flags,) = struct.unpack_from("<I", data, 48)
    return e_type, e_machine, data[8], e_flags


def _defined_symbols(path: Path, dynamic: bool) -> set[str]:
    command = [llvm_tool("llvm-nm"), "--defined-only", "--format=just-symbols", *(["-D"] if dynamic else []), str(path)]
    return set(run_tool(command, f"reading the symbols of {path}").stdout.decode().split())


def _require_symbol(symbols: set[str] | bytes, symbol: str, path: Path) -> None:
    if isinstance(symbols, bytes):  # a fatbin: its images are ELF files whose strtab names the kernel
        if symbol.encode() + b"\0" not in symbols:
            raise CompileError(f"custom kernel {symbol}: {path} does not contain the symbol {symbol!r} "
                               "(compressed fatbins cannot be inspected: build it with -Xfatbin=-compress-all=false)")
    elif symbol not in symbols:
        hint = _EXTERN_C if path.suffix in (".cu", ".cubin") else ""
        raise CompileError(f"custom kernel {symbol}: {path} does not define the symbol {symbol!r}{hint}")


def _named(served: dict[str, tuple]) -> str:
    """"custom kernel k" or "custom kernels k, l": who a file's build or check is for."""
    return f"custom kernel{'s' if len(served) > 1 else ''} {', '.join(served)}"


def _build_cpu(path: Path, served: dict[str, tuple], levels: tuple[str, ...], scratch: Path,
               build: CustomBuild) -> set[str]:
    """Compile or check a cpu file (the kernels it serves: symbol -> signature), add it to
    `build`; the symbols it defines."""
    if path.suffix == ".c":
        checked = scratch / f"{path.stem}-{len(build.cpu_objects[levels[0]])}-checked.c"
        checked.write_text(_c_check(path.resolve(), served))
        for level in levels:
            obj = scratch / f"{path.stem}-{level}-{len(build.cpu_objects[level])}.o"
            # -march takes the same x86-64 level names as the generated code's -mcpu
            run_tool([c_compiler(), "-O2", "-fPIC", f"-march={level}", "-c", str(checked), "-o", str(obj)],
                     f"compiling {_named(served)} ({path.name}) for {level}")
            build.cpu_objects[level].append(str(obj))
        return _defined_symbols(obj, dynamic=False)
    e_type, e_machine, _, _ = _elf_header(path)
    wanted = _ET_REL if path.suffix == ".o" else _ET_DYN
    if e_machine != _EM_X86_64 or e_type != wanted:
        kind = "relocatable object (.o)" if wanted == _ET_REL else "shared object (.so)"
        raise CompileError(f"{_named(served)}: {path} is not an x86-64 {kind} "
                           f"(ELF type {e_type}, machine {e_machine})")
    if path.suffix == ".o":
        for objects in build.cpu_objects.values():
            objects.append(str(path))
    else:
        build.shared_objects[str(path)] = path.read_bytes()
    return _defined_symbols(path, dynamic=path.suffix == ".so")


# ---- cuda --------------------------------------------------------------------------------

def _cubin_arch(path: Path, data: bytes) -> str:
    """sm_XY of a CUBIN, from its ELF header (ABI version 8 moved the SM up a byte)."""
    _, e_machine, abi_version, e_flags = _elf_header(path)
    if e_machine != _EM_CUDA:
        raise CompileError(f"{path} is not a CUDA binary (ELF machine {e_machine}, expected {_EM_CUDA})")
    return f"sm_{(e_flags >> 8) & 0xFF if abi_version >= 8 else e_flags & 0xFF}"


def _ptx_entries(ptx: bytes) -> set[str]:
    return {name.decode() for name in re.findall(rb"\.entry\s+([A-Za-z_$][\w$]*)", ptx)}


_EXTERN_C = " (declare it extern \"C\" so that C++ does not mangle its name)"


def _build_cuda(path: Path, served: dict[str, tuple], archs: tuple[str, ...],
                scratch: Path) -> tuple[dict[str, bytes], set[str] | bytes]:
    """The images of a cuda file (arch -> bytes) and the symbols it defines (a fatbin: its bytes)."""
    lowest = min(archs, key=arch_number)
    virtual = lowest.replace("sm_", "compute_")
    if path.suffix == ".cu":
        source = path.read_bytes() + _cuda_check(served)
        images = {arch: _nvrtc(source, path, arch) for arch in archs}
        ptx = _nvrtc(source, path, virtual)
        return {**images, virtual: ptx}, _ptx_entries(ptx)
    if path.suffix == ".ptx":
        ptx = path.read_bytes()
        target = re.search(rb"\.target\s+(sm_\d+a?)", ptx)
        if target is None:
            raise CompileError(f"{_named(served)}: {path} has no .target directive")
        ptx_arch = target.group(1).decode()
        usable = [a for a in archs if arch_number(a) >= arch_number(ptx_arch)]
        if not usable:
            raise CompileError(f"{_named(served)}: {path} is PTX for {ptx_arch}, newer than every target "
                               f"({', '.join(archs)})")
        images = {arch: _ptxas(path, arch, scratch) for arch in usable}
        return {**images, ptx_arch.replace("sm_", "compute_"): ptx}, _ptx_entries(ptx)
    data = path.read_bytes()
    if path.suffix == ".cubin":
        arch = _cubin_arch(path, data)
        if arch not in archs:
            raise CompileError(f"{_named(served)}: {path} is a CUBIN for {arch}, but the module targets "
                               f"{', '.join(archs)} (-target=cuda:{arch} to build for it)")
        return {arch: data}, _defined_symbols(path, dynamic=False)
    return {"fatbin": data}, data


def _ptxas(path: Path, arch: str, scratch: Path) -> bytes:
    output = scratch / f"{path.stem}.{arch}.cubin"  # not beside the user's file: it may be read-only
    run_tool([str(Path(cuda_toolkit()) / "bin" / "ptxas"), f"-arch={arch}", "-O3", str(path), "-o", str(output)],
             f"ptxas for {arch}")
    return output.read_bytes()


def _nvrtc_library() -> ctypes.CDLL:
    library = nvidia_wheel_file("cu*/lib/libnvrtc.so*")
    if library is not None:
        return ctypes.CDLL(str(library))
    try:
        return ctypes.CDLL("libnvrtc.so")
    except OSError:
        raise CompileError("NVRTC is needed to compile .cu kernels: pip install 'hexir[cuda]' "
                           "(the nvidia-cuda-nvrtc wheel) or install a CUDA toolkit") from None


def _nvrtc(source: bytes, path: Path, arch: str) -> bytes:
    """CUBIN (arch sm_XY) or PTX (arch compute_XY) of a .cu file, through NVRTC."""
    if arch.replace("compute_", "sm_") not in PTX_FEATURES:
        raise CompileError(f"{arch} is not a supported CUDA architecture")
    nvrtc = _nvrtc_library()
    nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
    program = ctypes.c_void_p()
    status = nvrtc.nvrtcCreateProgram(ctypes.byref(program), source, path.name.encode(), 0, None, None)
    if status != 0:
        raise CompileError(f"NVRTC could not read {path}: {nvrtc.nvrtcGetErrorString(status).decode()}")
    try:
        options = [f"--gpu-architecture={arch}".encode(), b"-std=c++17"]
        status = nvrtc.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(program, log)
        if status != 0:
            message = log.value.decode(errors="replace").strip()
            raise CompileError(f"NVRTC could not compile {path} for {arch}:\n{message}")
        get_size, get = (nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN) if arch.startswith("sm_") else \
            (nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX)
        get_size(program, ctypes.byref(size))
        image = ctypes.create_string_buffer(size.value)
        get(program, image)
        return image.raw.rstrip(b"\0") if arch.startswith("compute_") else image.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))

