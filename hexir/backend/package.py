"""package: a lowered module and its compiled kernels -> the .hxb manifest and blobs.

The host program (`func.func @main` after lower-to-tir) becomes the entry's command list:
every SSA value gets a buffer on the device that makes it; block arguments are inputs,
`hexir.constant` binds a weight (stored once per distinct content), `hexir.call` runs a
kernel, `hexir.transfer` copies between devices, `hexir.print` prints and `func.return`
returns. Each kernel's work or launch record is copied from its `hextir.work` /
`hextir.launch` attribute, where its schedule wrote it; symbolic extents stay symbols
(`["batch", 784]`) and size expressions become JSON (`["ceildiv", "batch", 64]`). The format
itself belongs to the runtime (`hexir_runtime.format`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from hexir_runtime import format as hxb
from hexir_runtime.format import exprs
from mlir import ir

from hexir.backend.cpu import CpuLibrary, check_shared_object
from hexir.backend.cuda import CudaBinary
from hexir.backend.custom import CustomBuild
from hexir.dialects import hexir as hx
from hexir.dialects import hextir as ht
from hexir.errors import CompileError
from hexir.version import __version__


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


def _record(kernel: ir.Operation) -> dict:
    """The kernel's work (cpu) or launch (cuda) record, in the manifest's form."""
    record = ht.record_of(kernel)
    if isinstance(record, ht.Work):
        return {"work": {"extent": exprs.to_json(record.extent), "grain": record.grain,
                         **({"spans": True} if record.spans else {})}}
    if isinstance(record, ht.Launch):
        return {"launch": {"grid": [exprs.to_json(e) for e in record.grid], "block": list(record.block),
                           "shared_bytes": record.shared_bytes}}
    return {}


def _call_types(module: ir.Module) -> dict[str, list[ir.Type]]:
    """Each kernel's buffer types, from the graph op that calls it: tensor types keep the names
    of symbolic extents, which the lowered kernel (a bare pointer for such a buffer) has not."""
    calls = {}
    for op in hx.main_function(module).regions[0].blocks[0].operations:
        if op.operation.name == "hexir.call":
            calls[hx.callee_of(op.operation)] = [v.type for v in [*op.operands, *op.results]]
    return calls


def _kernel_entry(kernel: ir.Operation, calls: dict[str, list[ir.Type]]) -> dict:
    device, op = ht.kernel_of(kernel)
    name = ht.name_of(kernel)
    args = [{**_spec(t), "access": "read"} for t in calls[ht.fallback_of(kernel) or ht.variant_of(kernel) or name]]
    args[-1]["access"] = "write"
    for i, view in ht.views_of(kernel).items():  # read in place as another shape, or strided (tir-to-loops)
        args[i]["view"] = {k: v for k, v in view.items() if k != "buffer"} if isinstance(view, dict) else view
    entry = {"name": name, "op": op, "device": device, "symbol": name, "args": args}
    custom = ht.custom_of(kernel)
    if custom is not None:
        entry.update(symbol=custom[0], source=Path(custom[1]).name, scalars=[d for a in args for d in a["shape"]])
    else:
        expr = ht.expr_of(kernel)
        entry.update({**({"expr": expr} if expr is not None else {}), "sizes": list(ht.sizes_of(kernel))})
        if ht.tensor_maps_of(kernel):
            entry["tensor_maps"] = ht.tensor_maps_of(kernel)
        if ht.arch_of(kernel):
            entry["arch"] = ht.arch_of(kernel)
    entry.update(_record(kernel))
    return entry


def _custom_fields(kernel: ir.Operation, entry: dict, custom: CustomBuild, packer: _Packer) -> dict:
    """A custom kernel's own code: its images (cuda) or prebuilt library (cpu), each stored once."""
    file = ht.custom_of(kernel)[1]
    if entry["device"] == "cuda":
        images = {arch: packer.blob_once(f"{file}:{arch}", f"{Path(file).name}:{arch}", data)
                  for arch, data in custom.cuda_images[file].items()}
        return {"images": images}
    if file in custom.shared_objects:  # embedded as it is: it must load as the runtime allows
        check_shared_object(custom.shared_objects[file], f"custom kernel {entry['symbol']}: {file}")
        return {"library": packer.blob_once(file, Path(file).name, custom.shared_objects[file])}
    return {}


def _entry(module: ir.Module, kernel_index: dict[str, int], packer: _Packer) -> dict:
    main = hx.main_function(module)
    block = main.regions[0].blocks[0]
    names = hx.argument_names(main)
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


def _table_entry(entry: dict) -> dict:
    """What a library's own table says of one of its kernels (the manifest must agree)."""
    row = {"symbol": entry["symbol"], "op": entry["op"],
           "args": [{key: a[key] for key in ("shape", "dtype", "view") if key in a} for a in entry["args"]]}
    row.update({key: entry[key] for key in ("expr", "sizes", "scalars", "work", "launch") if key in entry})
    return row


def kernel_tables(module: ir.Module) -> tuple[bytes, bytes]:
    """The JSON tables of the kernels in the cpu libraries and in the cuda images."""
    with module.context:
        calls = _call_types(module)
        tables: dict[str, list[dict]] = {"cpu": [], "cuda": []}
        for kernel in ht.kernels(module):
            if not ht.identity_of(kernel).best:
                continue  # another level's copy: the same table
            entry = _kernel_entry(kernel, calls)
            if entry["device"] == "cpu" and ht.custom_of(kernel) is not None and \
                    Path(ht.custom_of(kernel)[1]).suffix == ".so":
                continue  # a prebuilt library of its own
            tables[entry["device"]].append(_table_entry(entry))
        return tuple(json.dumps({"kernels": tables[d]}, separators=(",", ":")).encode() for d in ("cpu", "cuda"))


def package(module: ir.Module, cpu_libraries: list[CpuLibrary], cuda_binary: CudaBinary | None = None,
            custom: CustomBuild | None = None) -> bytes:
    """Encode the .hxb bytes of a module whose kernels have been compiled (a cpu library per
    x86-64 level, best first)."""
    with module.context:
        return _package(module, cpu_libraries, cuda_binary, custom or CustomBuild())


def _package(module: ir.Module, cpu_libraries: list[CpuLibrary], cuda_binary: CudaBinary | None,
             custom: CustomBuild) -> bytes:
    packer = _Packer()
    manifest: dict = {"producer": f"hexir {__version__}"}
    fallbacks, kernel_entries, variants, others = {}, [], {}, []
    cuda_images: dict[str, int] = {}  # the generated kernels' images, stored once for all of them
    calls = _call_types(module)
    for kernel in ht.kernels(module):
        if not ht.identity_of(kernel).best:
            continue  # another level's copy of a cpu kernel: in that level's library, same entry
        entry = _kernel_entry(kernel, calls)
        if entry["op"] == "custom":
            entry.update(_custom_fields(kernel, entry, custom, packer))
        elif entry["device"] == "cuda":
            if not cuda_images:
                for arch, data in cuda_binary.cubins.items():
                    cuda_images[arch] = packer.blob(f"cuda:{arch}.cubin", data)
                virtual = cuda_binary.ptx[0].replace("sm_", "compute_")
                cuda_images[virtual] = packer.blob(f"cuda:{virtual}.ptx", cuda_binary.ptx[1])
            entry["images"] = dict(cuda_images)
        if ht.fallback_of(kernel) is not None:
            fallbacks[ht.fallback_of(kernel)] = entry
        elif ht.variant_of(kernel) is not None:
            variants[ht.name_of(kernel)] = entry
        else:
            kernel_entries.append(entry)
            others.append(ht.variants_of(kernel))
    for entry, chosen in zip(kernel_entries, others, strict=True):  # a kernel's variants, in the order tried
        if chosen:
            entry["variants"] = [{"symbol": symbol, "launch": variants[symbol]["launch"],
                                  **({"below": below} if below else {}),
                                  **{key: value for key, value in variants[symbol].items()
                                     if key in ("arch", "tensor_maps")}}
                                 for symbol, below in chosen]
    for entry in kernel_entries:
        fallback = fallbacks.get(entry["name"])
        if fallback is not None:
            keys = ("symbol", "source", "library") if fallback["op"] == "custom" else ("symbol", "work")
            entry["cpu_fallback"] = {key: fallback[key] for key in keys if key in fallback}
    if cpu_libraries:
        manifest["cpu"] = {"arch": cpu_libraries[0].arch, "libraries": [
            {"cpu": library.cpu, "features": list(library.features),
             "library": packer.blob(f"cpu-{library.cpu}.so", library.shared_object)} for library in cpu_libraries]}
    if any(k["device"] == "cuda" for k in kernel_entries):
        manifest["cuda"] = {"table": packer.blob("cuda:kernels.json", kernel_tables(module)[1])}
    kernel_index = {k["name"]: i for i, k in enumerate(kernel_entries)}
    manifest["entries"] = [_entry(module, kernel_index, packer)]
    manifest["kernels"] = kernel_entries
    manifest["constants"] = packer.constants
    try:
        return hxb.encode(manifest, packer.blobs)
    except hxb.HxbFormatError as error:  # the compiler made a module the runtime would refuse: our bug
        raise CompileError(f"the packaged module breaks the .hxb format ({error}); please report this") from None
