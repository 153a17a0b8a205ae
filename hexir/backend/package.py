"""package: a lowered module and its compiled kernels -> the .hxb manifest and blobs.

The host program (`func.func @main` after lower-to-tir) becomes the entry's command list:
every SSA value gets a buffer on the device that makes it; block arguments are inputs,
`hexir.constant` binds a weight (stored once per distinct content), `hexir.call` runs a
kernel, `hexir.transfer` copies between devices, `hexir.print` prints and `func.return`
returns. The format itself belongs to the runtime (`hexir_runtime.format`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from hexir_runtime import format as hxb
from mlir import ir

from hexir import __version__
from hexir.backend.cpu import CpuLibrary
from hexir.backend.cuda import CudaBinary
from hexir.backend.custom import CustomBuild, custom_info
from hexir.dialects import hexir as hx
from hexir.dialects import hextir as ht
from hexir.errors import CompileError
from hexir.passes.common import argument_names, kernels, main_function
from hexir.passes.lower_to_tir import FALLBACK_OF
from hexir.passes.tir_to_loops import WORK_ITEMS


def _spec(type_: ir.Type) -> dict:
    return {"shape": list(hx.shape_of(type_)), "dtype": hx.dtype_of(type_)}


class _Packer:
    def __init__(self) -> None:
        self.blobs: list[tuple[str, bytes]] = []
        self.constants: list[dict] = []
        self._constant_by_digest: dict[str, int] = {}
        self._blob_by_key: dict[str, int] = {}

    def blob(self, name: str, data: bytes) -> int:
        self.blobs.append((name, data))
        return len(self.blobs) - 1

    def blob_once(self, key: str, name: str, data: bytes) -> int:
        """A blob shared by everything that asks with the same `key` (a custom kernel's code
        used by several calls is keyed by its file's full path, not its name)."""
        if key not in self._blob_by_key:
            self._blob_by_key[key] = self.blob(name, data)
        return self._blob_by_key[key]

    def constant(self, op: ir.Operation) -> int:
        array = hx.constant_array(op)
        digest = hashlib.sha256(array.tobytes() + repr((array.shape, array.dtype.name)).encode()).hexdigest()
        if digest not in self._constant_by_digest:
            name = hx.string_attr(op, "name")
            self.constants.append({"name": name, **_spec(op.result.type),
                                   "blob": self.blob(f"constant:{name}", array.tobytes())})
            self._constant_by_digest[digest] = len(self.constants) - 1
        return self._constant_by_digest[digest]


def _kernel_entry(kernel: ir.Operation) -> dict:
    name = ir.StringAttr(kernel.attributes["sym_name"]).value
    device, op = ht.kernel_of(kernel)
    # the signature, not the entry block: a gpu.func's block also holds its workgroup buffers
    arg_types = ir.FunctionType(ir.TypeAttr(kernel.attributes["function_type"]).value).inputs
    buffers = [t for t in arg_types if t != ir.IndexType.get()]  # drop the work-range arguments
    args = [{**_spec(t), "access": "read"} for t in buffers]
    args[-1]["access"] = "write"
    entry = {"name": name, "op": op, "device": device, "symbol": name, "args": args}
    if op == "custom":
        info = custom_info(kernel)
        entry.update(symbol=info["symbol"], source=Path(info["file"]).name,
                     scalars=[d for a in args for d in a["shape"]])
    elif device == "cpu":
        entry["parallel_extent"] = ir.IntegerAttr(kernel.attributes[WORK_ITEMS]).value
    return entry


def _custom_fields(kernel: ir.Operation, entry: dict, custom: CustomBuild, packer: _Packer) -> dict:
    """A custom kernel's own code: its images (cuda) or prebuilt library (cpu), each stored once."""
    file = custom_info(kernel)["file"]
    if entry["device"] == "cuda":
        images = {arch: packer.blob_once(f"{file}:{arch}", f"{Path(file).name}:{arch}", data)
                  for arch, data in custom.cuda_images[file].items()}
        info = custom_info(kernel)
        return {"launch": {"grid": info["grid"], "block": info["block"], "shared_bytes": 0}, "images": images}
    if file in custom.shared_objects:
        return {"library": packer.blob_once(file, Path(file).name, custom.shared_objects[file])}
    return {}


def _entry(module: ir.Module, kernel_index: dict[str, int], packer: _Packer) -> dict:
    main = main_function(module)
    block = main.regions[0].blocks[0]
    names = argument_names(main)
    buffers: list[dict] = []
    buffer_of: dict[ir.Value, int] = {}
    program: list[dict] = []

    def new_buffer(value: ir.Value, device: str) -> int:
        buffers.append({**_spec(value.type), "device": device})
        buffer_of[value] = len(buffers) - 1
        return len(buffers) - 1

    inputs = []
    for position, (name, argument) in enumerate(zip(names, block.arguments, strict=True)):
        inputs.append({"name": name, **_spec(argument.type)})
        program.append({"op": "input", "index": position, "dst": new_buffer(argument, "cpu")})
    outputs: list[dict] = []
    for op in block.operations:
        op = op.operation
        if op.name == "hexir.constant":
            program.append({"op": "constant", "constant": packer.constant(op),
                            "dst": new_buffer(op.result, hx.device_of(op))})
        elif op.name == "hexir.call":
            args = [buffer_of[v] for v in op.operands] + [new_buffer(op.result, hx.device_of(op))]
            program.append({"op": "call", "kernel": kernel_index[hx.callee_of(op)], "args": args})
        elif op.name == "hexir.transfer":
            program.append({"op": "transfer", "src": buffer_of[op.operands[0]],
                            "dst": new_buffer(op.result, hx.string_attr(op, "target"))})
        elif op.name == "hexir.print":
            program.append({"op": "print", "src": buffer_of[op.operands[0]]})
        elif op.name == "func.return":
            outputs = [_spec(v.type) for v in op.operands]
            program.append({"op": "return", "srcs": [buffer_of[v] for v in op.operands]})
    return {"name": "main", "inputs": inputs, "outputs": outputs, "buffers": buffers, "program": program}


def package(module: ir.Module, cpu_library: CpuLibrary | None, cuda_binary: CudaBinary | None = None,
            custom: CustomBuild | None = None) -> bytes:
    """Encode the .hxb bytes of a module whose kernels have been compiled."""
    with module.context:
        return _package(module, cpu_library, cuda_binary, custom or CustomBuild())


def _package(module: ir.Module, cpu_library: CpuLibrary | None, cuda_binary: CudaBinary | None,
             custom: CustomBuild) -> bytes:
    packer = _Packer()
    manifest: dict = {"producer": f"hexir {__version__}"}
    fallbacks = {}
    for kernel in kernels(module, "cpu"):
        if FALLBACK_OF in kernel.attributes:
            entry = _kernel_entry(kernel)
            if entry["op"] == "custom":
                entry.update(_custom_fields(kernel, entry, custom, packer))
            fallbacks[ir.FlatSymbolRefAttr(kernel.attributes[FALLBACK_OF]).value] = entry
    kernel_entries = []
    for kernel in kernels(module):
        if FALLBACK_OF in kernel.attributes:
            continue
        entry = _kernel_entry(kernel)
        if entry["op"] == "custom":
            entry.update(_custom_fields(kernel, entry, custom, packer))
        elif entry["device"] == "cuda":
            entry.update(cuda_binary.manifest_fields(entry["name"], packer.blob))
        fallback = fallbacks.get(entry["name"])
        if fallback is not None:
            keys = ("symbol", "source", "library") if fallback["op"] == "custom" else ("symbol", "parallel_extent")
            entry["cpu_fallback"] = {key: fallback[key] for key in keys if key in fallback}
        kernel_entries.append(entry)
    if cpu_library is not None:
        manifest["cpu"] = {"arch": cpu_library.arch, "cpu": cpu_library.cpu,
                           "features": list(cpu_library.features),
                           "library": packer.blob("cpu.so", cpu_library.shared_object)}
    kernel_index = {k["name"]: i for i, k in enumerate(kernel_entries)}
    manifest["entries"] = [_entry(module, kernel_index, packer)]
    manifest["kernels"] = kernel_entries
    manifest["constants"] = packer.constants
    try:
        return hxb.encode(manifest, packer.blobs)
    except hxb.HxbFormatError as error:  # the compiler made a module the runtime would refuse: our bug
        raise CompileError(f"the packaged module breaks the .hxb format ({error}); please report this") from None
