"""The meaning check of a whole manifest: keys, constants, kernels (kernels.py), the cpu
libraries, entries (entries.py) and the custom kernels' own libraries; builds the `Manifest`."""

from __future__ import annotations

from typing import Any

from .entries import _check_entry
from .fields import _fail, _index, _list, _object, _str, _tensor
from .kernels import _check_kernel
from .types import Blob, Constant, Cpu, CpuLibrary, Entry, Kernel, Manifest


def _check_meaning(manifest: dict[str, Any]) -> Manifest:
    _object(manifest, "", ("producer", "blobs", "constants", "kernels", "entries"), ("cpu", "cuda"))
    blobs = tuple(Blob(**blob) for blob in manifest["blobs"])  # checked with the structure
    constants = []
    for i, constant in enumerate(_list(manifest["constants"], "constants")):
        path = f"constants[{i}]"
        tensor = _tensor(constant, path, ("name", "blob"), symbolic=False)
        blob = _index(constant["blob"], f"{path}.blob", len(blobs), "blob")
        if blobs[blob].size != tensor.nbytes:
            _fail(f"{path}.blob", f"blob {blob} has {blobs[blob].size} bytes; {tensor} needs {tensor.nbytes}")
        constants.append(Constant(_str(constant["name"], f"{path}.name"), tensor, blob))
    kernels = tuple(_check_kernel(kernel, f"kernels[{i}]", len(blobs))
                    for i, kernel in enumerate(_list(manifest["kernels"], "kernels")))
    cpu_code = [i for i, kernel in enumerate(kernels) if kernel.cpu_code and kernel.cpu_code.library is None]
    if cpu_code and "cpu" not in manifest:
        _fail("cpu", f"missing, but kernels[{cpu_code[0]}] has cpu code and no library of its own")
    cpu = None
    if "cpu" in manifest:
        if not cpu_code:
            _fail("cpu", "present, but no kernel has cpu code in a cpu library (a cpu kernel or a cpu_fallback "
                         "without a library of its own)")
        spec = _object(manifest["cpu"], "cpu", ("arch", "libraries"))
        builds = []
        for i, build in enumerate(_list(spec["libraries"], "cpu.libraries")):
            where = f"cpu.libraries[{i}]"
            _object(build, where, ("cpu", "features", "library"))
            features = tuple(_str(feature, f"{where}.features[{j}]")
                             for j, feature in enumerate(_list(build["features"], f"{where}.features")))
            builds.append(CpuLibrary(_str(build["cpu"], f"{where}.cpu"), features,
                                     _index(build["library"], f"{where}.library", len(blobs), "blob")))
        if not builds:
            _fail("cpu.libraries", "empty: the module needs at least one cpu library")
        cpu = Cpu(_str(spec["arch"], "cpu.arch"), tuple(builds))
    entries = _list(manifest["entries"], "entries")
    if not entries:
        _fail("entries", "empty: a module needs at least one entry")
    checked: list[Entry] = []
    for i, entry in enumerate(entries):
        checked.append(_check_entry(entry, f"entries[{i}]", constants, kernels, checked))
    cuda_table = None
    if "cuda" in manifest:
        if not any(kernel.gpu_code for kernel in kernels):
            _fail("cuda", "present, but the module has no cuda kernels")
        cuda_table = _index(_object(manifest["cuda"], "cuda", ("table",))["table"], "cuda.table", len(blobs), "blob")
    _check_custom_libraries(constants, kernels, cpu, cuda_table)
    return Manifest(_str(manifest["producer"], "producer"), blobs, tuple(constants), cpu, kernels, tuple(checked),
                    cuda_table)


def _check_custom_libraries(constants: list[Constant], kernels: tuple[Kernel, ...], cpu: Cpu | None,
                            cuda_table: int | None) -> None:
    """A custom kernel's own `library` blob holds nothing else: no CPU library of the module, no
    constant, no image, no table. Those are checked by the code's kernel table (or are no code); a
    custom library has no table, so a manifest pointing a custom kernel at the generated code could
    call any of its functions (the thread pool's, a kernel's) with arguments of its choosing."""
    roles = {constant.blob: f"constants[{i}]" for i, constant in enumerate(constants)}
    roles.update({build.library: f"cpu.libraries[{i}]" for i, build in enumerate(cpu.libraries if cpu else ())})
    for i, kernel in enumerate(kernels):
        roles.update({blob: f"kernels[{i}].images.{arch}"
                      for arch, blob in (kernel.gpu_code.images.items() if kernel.gpu_code else ())})
    if cuda_table is not None:
        roles[cuda_table] = "cuda.table"
    for i, kernel in enumerate(kernels):
        library = kernel.cpu_code.library if kernel.cpu_code else None
        if library in roles:
            path = f"kernels[{i}]{'' if kernel.device == 'cpu' else '.cpu_fallback'}.library"
            _fail(path, f"blob {library} is {roles[library]}'s; a custom kernel's library is a shared object of "
                        "its own")
