"""package: a lowered module and its compiled kernels -> the .hxb manifest and blobs.

The host program (`func.func @main` after lower-to-tir) becomes the entry's command list:
every SSA value gets a buffer on the device that makes it; block arguments are inputs,
`hexir.constant` binds a weight (stored once per distinct content), `hexir.call` runs a
kernel, `hexir.transfer` copies between devices, `hexir.print` prints and `func.return`
returns. The format itself belongs to the runtime (`hexir_runtime.format`).
"""

from __future__ import annotations

import hashlib

from hexir_runtime import format as hxb
from mlir import ir

from hexir import __version__
from hexir.backend.cpu import CpuLibrary
from hexir.backend.cuda import CudaBinary
from hexir.dialects import hexir as hx
from hexir.dialects import hextir as ht
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

    def blob(self, name: str, data: bytes) -> int:
        self.blobs.append((name, data))
        return len(self.blobs) - 1

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
    if device == "cpu":
        entry["parallel_extent"] = ir.IntegerAttr(kernel.attributes[WORK_ITEMS]).value
    return entry


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


def package(module: ir.Module, cpu_library: CpuLibrary | None, cuda_binary: CudaBinary | None = None) -> bytes:
    """Encode the .hxb bytes of a module whose kernels have been compiled."""
    with module.context:
        return _package(module, cpu_library, cuda_binary)


def _package(module: ir.Module, cpu_library: CpuLibrary | None, cuda_binary: CudaBinary | None) -> bytes:
    packer = _Packer()
    manifest: dict = {"producer": f"hexir {__version__}"}
    fallbacks = {ir.FlatSymbolRefAttr(k.attributes[FALLBACK_OF]).value: _kernel_entry(k)
                 for k in kernels(module, "cpu") if FALLBACK_OF in k.attributes}
    kernel_entries = [_kernel_entry(k) for k in kernels(module) if FALLBACK_OF not in k.attributes]
    for entry in kernel_entries:
        if entry["device"] == "cuda":
            entry.update(cuda_binary.manifest_fields(entry["name"], packer.blob))
            fallback = fallbacks[entry["name"]]
            entry["cpu_fallback"] = {"symbol": fallback["symbol"],
                                     "parallel_extent": fallback["parallel_extent"]}
    if cpu_library is not None:
        manifest["cpu"] = {"arch": cpu_library.arch, "cpu": cpu_library.cpu,
                           "features": list(cpu_library.features),
                           "library": packer.blob("cpu.so", cpu_library.shared_object)}
    kernel_index = {k["name"]: i for i, k in enumerate(kernel_entries)}
    manifest["entries"] = [_entry(module, kernel_index, packer)]
    manifest["kernels"] = kernel_entries
    manifest["constants"] = packer.constants
    return hxb.encode(manifest, packer.blobs)
