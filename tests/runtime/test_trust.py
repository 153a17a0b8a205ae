"""Issue 12: nothing in a .hxb is trusted. Sizes that overflow int64, sources that are no file,
kernel symbols that resolve outside the module's own library, libraries that leak fds or alias
each other, files left behind, and libraries whose dlerror text is not UTF-8."""

from __future__ import annotations

import os
import re
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hexir_runtime import DeviceError, HxbFormatError, load
from hexir_runtime import cpu as cpu_device
from hexir_runtime import format as hxb

RUNTIME = str(Path(__file__).parents[2] / "runtime")
SALT = 0x5A17C0DE  # patched per module: each library's bytes differ, and so does its answer

ANSWER = """
const volatile int32_t salt = 0x5A17C0DE;
void answer(const float *zero, float *out, int64_t first, int64_t last) { out[0] = (float)(salt & 0xffffff); }
"""


def answer_module(modules) -> tuple[dict, list]:
    """`main() -> float32[1]`: one native kernel `answer` writing its library's salt (the manifest
    says it copies a constant zero: only the reference device would believe it)."""
    builder = modules.Builder()
    zero = builder.constant("zero", np.zeros(1, np.float32))
    builder.kernels.append({"name": "answer", "op": "pointwise", "expr": ["arg", 0], "device": "cpu",
                            "symbol": "answer", "args": [{"shape": [1], "dtype": "float32", "access": "read"},
                                                         {"shape": [1], "dtype": "float32", "access": "write"}],
                            "sizes": [], "work": {"extent": 1, "grain": 1}})
    entry = builder.entry()
    entry.ret(entry.call(0, entry.constant(zero)))
    return builder.build()


@pytest.fixture(scope="module")
def answer_library(modules, compile_c) -> bytes:
    manifest, _ = answer_module(modules)
    return compile_c(ANSWER + modules.table_c(manifest["kernels"]), "answer")


def salted(library: bytes, value: int) -> bytes:
    marker = SALT.to_bytes(4, "little")
    assert library.count(marker) == 1
    return library.replace(marker, value.to_bytes(4, "little"))


def test_extents_and_byte_counts_beyond_int64_are_refused_even_beside_a_zero(modules):
    for shape in ([0, 2**70], [2**63], [0, 2**62, 4]):
        builder = modules.Builder()
        entry = builder.entry()
        entry.ret(entry.input("x", shape))
        with pytest.raises(HxbFormatError, match=r"^entries\[0\]\.inputs\[0\]\.(shape|shape\[1\]|shape\[0\]): "):
            hxb.encode(*builder.build())


def test_load_takes_paths_bytes_and_hxb_only():
    for source in (3, 2.5, None, ["m.hxb"]):
        with pytest.raises(TypeError, match=f"got {type(source).__name__}$"):
            load(source)


def test_a_kernel_symbol_from_a_dependency_is_refused(modules, c_library, compile_c):
    """The genuine library, a manifest naming libc's `system` with a command as a constant."""
    manifest, blobs = modules.mlp(c_library)
    manifest["kernels"][1]["symbol"] = "system"
    with pytest.raises(HxbFormatError, match=r"^kernels\[1\]\.symbol: k1_relu: symbol 'system' is not in the "
                                             r"kernel table"):
        load(hxb.encode(manifest, blobs), "cpu")
    # even a table that lists it: the address is checked to lie in the library itself
    uses_libc = "int puts(const char *);\nvoid keep_libc(void) { puts(\"linked\"); }\n"  # a real dependency
    library = compile_c(modules.kernels_code + uses_libc + modules.table_c(manifest["kernels"]), "lists_system")
    manifest["cpu"]["libraries"][0]["library"] = len(blobs)
    with pytest.raises(HxbFormatError, match=r"^kernels\[1\]\.symbol: k1_relu: 'system' is not defined by the CPU "
                                             r"library for generic \(blob 4\) itself"):
        load(hxb.encode(manifest, [*blobs, ("cpu.so", library)]), "cpu")


def test_the_table_must_agree_with_the_manifest_field_by_field(modules, c_library, compile_c):
    manifest, blobs = modules.batched(c_library)
    for edit, field in [(lambda k: k["work"].update(extent=["ceildiv", "batch", 2]), "kernels[1].work"),
                        (lambda k: k["work"].update(grain=2), "kernels[1].work")]:
        changed = {**manifest, "kernels": [dict(k, work=dict(k["work"])) for k in manifest["kernels"]]}
        edit(changed["kernels"][1])
        with pytest.raises(HxbFormatError) as error:
            load(hxb.encode(changed, blobs), "cpu")
        assert error.value.field == field and "the kernel table" in error.value.reason
    old = compile_c(modules.kernels_code, "no_table")
    with pytest.raises(HxbFormatError, match="has no kernel table .*: built by an older compiler"):
        load(hxb.encode(*modules.batched(old)), "cpu")


def test_the_best_cpu_library_this_host_runs_is_loaded(modules, compile_c, monkeypatch):
    manifest, blobs = answer_module(modules)
    build = manifest["cpu"]["libraries"][0]
    future = {"cpu": "future", "features": ["sse2", "avx9000"]}
    fast = {"cpu": "fast", "features": build["features"]}
    for level, salt in ((future, 7), (fast, 8)):  # each library records the level it was built for
        library = compile_c(ANSWER + modules.table_c(manifest["kernels"], dict(level)), f"answer_{level['cpu']}")
        blobs.append((f"cpu-{level['cpu']}.so", salted(library, salt)))
        level["library"] = len(blobs) - 1
    manifest["cpu"]["libraries"] = [future, fast, build]
    monkeypatch.setattr(cpu_device, "_cpu_flags", lambda: set(build["features"]))
    assert load(hxb.encode(manifest, blobs), "cpu").main().tolist() == [8]
    monkeypatch.setattr(cpu_device, "_cpu_flags", lambda: set())
    if build["features"]:  # x86: the baseline needs sse2 too
        with pytest.raises(DeviceError, match="no CPU library of the module runs on this machine: future needs"):
            load(hxb.encode(manifest, blobs), "cpu")


def test_a_non_utf8_dlerror_is_one_clean_device_error(tmp_path, modules, compile_c):
    source = 'extern int dep(void) __asm__("hexir\\xff\\xfe");\nint use(void) { return dep(); }\n'
    manifest, blobs = modules.mlp(compile_c(source, "unresolved_non_utf8"))
    with pytest.raises(DeviceError, match=r"^cannot load the CPU library for generic \(blob 3\): .*undefined symbol: "
                                          r"hexir\ufffd\ufffd"):
        load(hxb.encode(manifest, blobs), "cpu")


def test_the_fallback_file_is_removed_whether_dlopen_succeeds_or_not(modules, c_library, compile_c, monkeypatch,
                                                                     tmp_path):
    unresolved = compile_c("int missing(void);\nint use(void) { return missing(); }\n", "unresolved")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setattr(cpu_device, "_libraries", {})
    monkeypatch.delattr(os, "memfd_create", raising=False)
    load(hxb.encode(*modules.mlp(c_library)), "cpu")
    with pytest.raises(DeviceError, match="undefined symbol: missing"):
        load(hxb.encode(*modules.mlp(unresolved)), "cpu")
    assert list(tmp_path.iterdir()) == []


DISTINCT = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
import numpy as np
from hexir_runtime import load
from hexir_runtime import format as hxb
sys.path.insert(0, {tests!r})
manifest, blobs, library = {parts!r}
marker = ({salt}).to_bytes(4, "little")
for i in range({count}):
    blobs[-1] = ("cpu.so", library.replace(marker, i.to_bytes(4, "little")))
    value = load(hxb.encode(manifest, blobs), "cpu").main()[0]
    assert value == i, (i, value)  # its own library, never an earlier one's
    print(i, flush=True)
"""


def test_2000_distinct_libraries_under_256_fds_each_give_their_own_answer(modules, answer_library, tmp_path):
    manifest, blobs = answer_module(modules)
    script = DISTINCT.format(tests=str(Path(__file__).parent), parts=(manifest, blobs, answer_library), salt=SALT,
                             count=2000)
    environment = {**os.environ, "PYTHONPATH": RUNTIME + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   "TMPDIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environment)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-1] == "1999"
    assert list(tmp_path.iterdir()) == []


def test_a_process_killed_while_loading_leaves_no_file(modules, answer_library, tmp_path):
    manifest, blobs = answer_module(modules)
    script = DISTINCT.format(tests=str(Path(__file__).parent), parts=(manifest, blobs, answer_library), salt=SALT,
                             count=10**6)
    environment = {**os.environ, "PYTHONPATH": RUNTIME + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   "TMPDIR": str(tmp_path)}
    for delay in (0.4, 0.55, 0.7):
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=environment)
        child.stdout.readline()  # loading modules now
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        child.communicate()
        assert child.returncode == -signal.SIGKILL
        assert list(tmp_path.iterdir()) == []


def test_answers_are_not_aliased_in_process(modules, answer_library):
    manifest, blobs = answer_module(modules)
    for i in (11, 12, 11, 13):
        blobs[-1] = ("cpu.so", salted(answer_library, i))
        assert load(hxb.encode(manifest, blobs), "cpu").main().tolist() == [i]
    assert np.float32(SALT & 0xFFFFFF) != 11  # the marker itself is no answer used here


# --- issue 28: a module calls only its own kernels, as compiled; nothing runs before the checks -----


def _custom(kernel: dict, **keys) -> None:
    """Relabel a generated kernel `custom`, as a manifest-only edit would."""
    for key in ("expr", "sizes", "work"):
        kernel.pop(key)
    kernel.update(op="custom", source="relabelled.c", scalars=[d for arg in kernel["args"] for d in arg["shape"]],
                  **keys)


def test_a_custom_kernel_cannot_take_the_generated_code_as_its_library(modules, c_library):
    manifest, blobs = modules.mlp(c_library)
    _custom(manifest["kernels"][1], library=3)  # blob 3: the module's cpu library, which has hexir_pool_run
    with pytest.raises(HxbFormatError, match=r"^kernels\[1\]\.library: blob 3 is cpu\.libraries\[0\]'s; a custom "
                                             r"kernel's library is a shared object of its own$"):
        hxb.encode(manifest, blobs)
    manifest["kernels"][1]["library"] = 0
    with pytest.raises(HxbFormatError, match=r"^kernels\[1\]\.library: blob 0 is constants\[0\]'s"):
        hxb.encode(manifest, blobs)
    del manifest["kernels"][1]["library"]  # in the module's library: the kernel table says what it is
    with pytest.raises(HxbFormatError, match=r"^kernels\[1\]\.scalars: k1_relu: the manifest says \[2, 16, 2, 16\], "
                                             r"the kernel table of the CPU library for generic \(blob 3\) says null$"):
        load(hxb.encode(manifest, blobs), "cpu")
    manifest, blobs = modules.cuda(c_library)  # a cuda kernel's cpu_fallback, relabelled
    kernel = manifest["kernels"][0]
    kernel.update(op="custom", source="relu.cu", scalars=[2, 3, 4, 2, 3, 4])
    for key in ("expr", "sizes"):
        kernel.pop(key)
    kernel["cpu_fallback"] = {"symbol": kernel["symbol"], "source": "relu.c", "library": kernel["images"]["sm_90"]}
    del manifest["cpu"]
    with pytest.raises(HxbFormatError, match=r"^kernels\[0\]\.cpu_fallback\.library: blob 0 is "
                                             r"kernels\[0\]\.images\.sm_90's"):
        hxb.encode(manifest, blobs)


def _downgraded(data: bytes, version: int) -> bytes:
    """The file with another version in its header (no checksum covers it)."""
    return data[:8] + version.to_bytes(4, "little") + data[12:]


@pytest.mark.parametrize("version", [1, 2, 3])
def test_an_older_version_is_held_to_every_check(modules, c_library, compile_c, version):
    manifest, blobs = modules.cuda(c_library)  # run on the cpu: the relu's cpu_fallback
    x = np.linspace(-1, 1, 24, dtype=np.float32).reshape(2, 3, 4)
    module = load(modules.encode_as(manifest, blobs, version), "cpu")
    assert module.hxb.version == version and module.main(x).tolist() == np.maximum(x, 0).tolist()
    manifest["kernels"][0]["cpu_fallback"]["work"]["grain"] = 2
    with pytest.raises(HxbFormatError, match=r"^kernels\[0\]\.cpu_fallback\.work: k0_relu: the manifest says "):
        load(modules.encode_as(manifest, blobs, version), "cpu")
    untabled = compile_c(modules.kernels_code, "untabled")
    with pytest.raises(HxbFormatError, match=r"^cpu\.libraries\[0\]\.library: the CPU library for generic \(blob 2\) "
                                             r"has no kernel table \(hexir_kernels\): built by an older compiler\?"):
        load(modules.encode_as(*modules.cuda(untabled), version), "cpu")
    builder = modules.Builder()
    relus = [builder.kernel("relu", [[2, 16], [2, 16]]) for _ in range(2)]
    entry = builder.entry()
    entry.ret(entry.call(relus[1], entry.call(relus[0], entry.input("x", [2, 16]))))
    manifest, blobs = builder.build(c_library)
    _custom(manifest["kernels"][1], library=0)
    with pytest.raises(HxbFormatError, match=r"^kernels\[1\]\.library: blob 0 is cpu\.libraries\[0\]'s"):
        hxb.decode(modules.encode_as(manifest, blobs, version))


@pytest.mark.parametrize(("edit", "field", "reason"), [
    (lambda m: m["kernels"][1].update(op=["linear_relu"]), "kernels[1].op", "expected a string, got an array"),
    (lambda m: m.update(kernels={"a": 1}), "kernels", "expected an array, got an object"),
    (lambda m: m["kernels"].append(["linear"]), "kernels[4]", "expected an object, got an array"),
    (lambda m: m["kernels"][0].update(cpu_fallback=[1]), "kernels[0].cpu_fallback", "expected an object, got an array"),
])
def test_a_malformed_version_1_manifest_is_one_line_naming_the_field(modules, c_library, tmp_path, capsys, edit,
                                                                     field, reason):
    manifest, blobs = modules.mlp(c_library)
    edit(manifest)
    try:
        data = hxb.encode(manifest, blobs)
    except HxbFormatError:  # version 3 refuses it too: write the bytes by hand, as a v1 writer would
        data = _encode_unchecked(manifest, blobs)
    with pytest.raises(HxbFormatError) as error:
        hxb.decode(_downgraded(data, 1))
    assert (error.value.field, error.value.reason) == (field, reason)
    (tmp_path / "v1.hxb").write_bytes(_downgraded(data, 1))
    from hexir_runtime.cli import main as hexir_run
    assert hexir_run([str(tmp_path / "v1.hxb"), "--info"]) == 1
    assert capsys.readouterr().err == f"hexir-run: {tmp_path / 'v1.hxb'}: {field}: {reason}\n"


def _encode_unchecked(manifest: dict, blobs: list) -> bytes:
    """`hxb.encode` without its final check of the meaning (as a writer of another version would)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hxb.container, "decode", lambda data: None)  # what encode calls
        return hxb.encode(manifest, blobs)


RUNS = "#include <unistd.h>\n__attribute__((constructor)) static void ran(void) { _exit(86); }\n"  # kills pytest if run
KERNEL = "void k(float *x) { x[0] = 1; }\n"
IFUNC = "static void real(void) {}\nstatic void (*pick(void))(void) { return real; }\n" \
        "void picked(void) __attribute__((ifunc(\"pick\")));\n"


def _shared(tmp_path: Path, name: str, source: str, *flags: str) -> bytes:
    """A shared object built with `cc -shared` and `flags` (without -nostartfiles unless given)."""
    (tmp_path / f"{name}.c").write_text(source)
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", str(tmp_path / f"{name}.so"), str(tmp_path / f"{name}.c"),
                    *flags], check=True)
    return (tmp_path / f"{name}.so").read_bytes()


@pytest.mark.parametrize(("source", "flags", "found"), [
    (KERNEL, (), "has a constructor (DT_INIT): a library must run no code when it is loaded (link it with "
                 "-nostartfiles, and without __attribute__((constructor)))"),
    (KERNEL + RUNS, ("-nostartfiles",), "has constructors (DT_INIT_ARRAY): "),
    (KERNEL + "#include <unistd.h>\n__attribute__((destructor)) static void end(void) { _exit(87); }\n",
     ("-nostartfiles",),
     "has destructors (DT_FINI_ARRAY): "),
    (KERNEL, ("-nostartfiles", "-Wl,--no-as-needed", "-L.", "-ldep"),
     "needs the library 'libdep.so' (DT_NEEDED): a library may need only libc.so.6, libm.so.6"),
    (KERNEL, ("-nostartfiles", "-Wl,-rpath,$ORIGIN/../cwd", "-Wl,--enable-new-dtags"),
     "has a DT_RUNPATH entry: a library may name no other library and no search path"),
    (KERNEL, ("-nostartfiles", "-Wl,-rpath,/tmp", "-Wl,--disable-new-dtags"), "has a DT_RPATH entry: "),
    (KERNEL, ("-nostartfiles", "-Wl,-soname,libcuda.so.1"), "has a DT_SONAME entry: "),
    (KERNEL + IFUNC, ("-nostartfiles",), "defines an IFUNC symbol 'picked', whose resolver would run when it is "
                                         "loaded or looked up"),
    (KERNEL, ("-nostartfiles", "-Wl,-z,execstack"), "asks for an executable stack (PT_GNU_STACK)"),
])
def test_a_library_that_would_run_code_or_load_another_is_refused_before_dlopen(
        modules, tmp_path, monkeypatch, source, flags, found):
    """The audit's RUNPATH $ORIGIN/../cwd: $ORIGIN is the memfd's /proc/self/fd, so ../cwd is the
    current directory, here one holding a libdep.so whose constructor would end the process."""
    monkeypatch.chdir(tmp_path)
    _shared(tmp_path, "libdep", RUNS, "-nostartfiles")
    library = _shared(tmp_path, "library", source, *flags)
    with pytest.raises(HxbFormatError) as error:
        load(hxb.encode(*modules.mlp(library)), "cpu")
    assert error.value.field == "cpu.libraries[0].library"
    assert error.value.reason.startswith(f"the CPU library for generic (blob 3) {found}")


def test_libc_and_libm_are_the_libraries_a_library_may_need(tmp_path):
    library = _shared(tmp_path, "maths", "#include <math.h>\nfloat e(float x) { return expf(x); }\n",
                      "-nostartfiles", "-Wl,--no-as-needed", "-lm")
    cpu_device.check_library(memoryview(library), "maths.so")  # no error


@pytest.mark.parametrize(("edit", "found"), [
    (lambda elf: elf[:40], "is not a 64-bit little-endian ELF shared object"),
    (lambda elf: elf[:16] + (1).to_bytes(2, "little") + elf[18:], "is not a shared object (ELF type 1)"),
    (lambda elf: elf[:32] + (len(elf) - 8).to_bytes(8, "little") + elf[40:], "is truncated or corrupt: "),
    (lambda elf: elf[:54] + (8).to_bytes(2, "little") + elf[56:], "is corrupt: its program header table is malformed"),
])
def test_a_malformed_elf_is_refused_naming_the_blob(modules, c_library, edit, found):
    with pytest.raises(HxbFormatError) as error:
        load(hxb.encode(*modules.mlp(edit(bytearray(c_library)))), "cpu")
    assert str(error.value).startswith(f"cpu.libraries[0].library: the CPU library for generic (blob 3) {found}")


def test_a_dynamic_section_outside_the_loaded_segments_is_refused(modules, c_library):
    elf = bytearray(c_library)
    table, size, count = (int.from_bytes(elf[at : at + n], "little") for at, n in ((32, 8), (54, 2), (56, 2)))
    for i in range(count):
        entry = table + i * size
        if int.from_bytes(elf[entry : entry + 4], "little") == 2:  # PT_DYNAMIC: its address moved away
            elf[entry + 16 : entry + 24] = (1 << 40).to_bytes(8, "little")
    with pytest.raises(HxbFormatError, match=r"^cpu\.libraries\[0\]\.library: the CPU library for generic \(blob 3\) "
                                             r"is corrupt: its dynamic section \(\d+ bytes at address 0x10000000000\) "
                                             r"lies in no loaded segment$"):
        load(hxb.encode(*modules.mlp(bytes(elf))), "cpu")


def test_a_custom_kernels_own_library_is_checked_alike(modules, tmp_path):
    builder = modules.Builder()
    ops = builder.blob("ops.so", _shared(tmp_path, "ops", KERNEL))
    kernel = builder.custom("k", [([1], "float32"), ([1], "float32")], library=ops)
    entry = builder.entry()
    entry.ret(entry.call(kernel, entry.input("x", [1])))
    with pytest.raises(HxbFormatError, match=r"^kernels\[0\]\.library: kernels\[0\] \(k0_k\): its library \(blob 0, "
                                             r"ops\.so\) has a constructor \(DT_INIT\)"):
        load(hxb.encode(*builder.build()), "cpu")


def test_a_library_records_the_level_it_was_built_for(modules, compile_c):
    manifest, blobs = modules.mlp()
    for build, field, said in [({"features": ["sse", "sse2"]}, "cpu", "does not record the CPU it was built for"),
                               ({"cpu": "x86-64-v4", "features": ["sse", "sse2"]}, "cpu",
                                'the manifest says "generic", the kernel table of the CPU library for generic '
                                '(blob 3) says "x86-64-v4"')]:
        library = compile_c(modules.kernels_code + modules.table_c(manifest["kernels"], build), "recorded")
        with pytest.raises(HxbFormatError) as error:
            load(hxb.encode(*modules.mlp(library)), "cpu")
        assert error.value.field == f"cpu.libraries[0].{field}" and said in error.value.reason


# --- issue 28, the review: the loader reads every relocation and keeps the last of a repeated tag ----


def _segments(elf: bytes) -> list[tuple[int, ...]]:
    """(type, flags, offset, address, size in the file, size in memory) of each program header."""
    table, size, count = (int.from_bytes(elf[at : at + n], "little") for at, n in ((32, 8), (54, 2), (56, 2)))
    return [struct.unpack_from("<IIQQ8xQQ", elf, table + i * size) for i in range(count)]


def _at(elf: bytes, address: int) -> int:
    """The file offset of `address`, through the PT_LOAD segments."""
    return next(offset + address - start for kind, _, offset, start, filesz, _ in _segments(elf)
                if kind == 1 and start <= address < start + filesz)


def _dynamic(elf: bytes) -> tuple[int, int, list[list[int]]]:
    """The file offset and size of the dynamic section, and its [tag, value] entries before DT_NULL."""
    offset, size = next((_at(elf, start), filesz) for kind, _, _, start, filesz, _ in _segments(elf) if kind == 2)
    entries = [list(struct.unpack_from("<qQ", elf, at)) for at in range(offset, offset + size, 16)]
    return offset, size, entries[: [tag for tag, _ in entries].index(0)]


def _with_dynamic(elf: bytes, entries: list[list[int]]) -> bytes:
    offset, size, _ = _dynamic(elf)
    assert 16 * (len(entries) + 1) <= size  # ld leaves spare DT_NULLs
    table = b"".join(struct.pack("<qQ", *entry) for entry in entries).ljust(size, b"\0")
    return elf[:offset] + table + elf[offset + size :]


def _tag(elf: bytes, tag: int) -> int:
    return dict(_dynamic(elf)[2])[tag]


def _refusal(modules, library: bytes) -> str:
    with pytest.raises(HxbFormatError) as error:
        load(hxb.encode(*modules.mlp(library)), "cpu")
    assert error.value.field == "cpu.libraries[0].library"
    prefix = "the CPU library for generic (blob 3) "
    assert error.value.reason.startswith(prefix)
    return error.value.reason[len(prefix) :]


HIDDEN_IFUNC = "#include <unistd.h>\nstatic void real(void) {}\n" \
               "static void (*pick(void))(void) { _exit(86); return real; }\n"  # kills pytest if run


RELOCATED = "#include <unistd.h>\nstatic void stop(void) { _exit(0); }\n" + KERNEL + \
            "void (*const volatile kept)(void) = stop;\nvoid (*const volatile ended)(int) = _exit;\n" \
            "void quit(void) { _exit(1); }\n"  # a RELATIVE, a symbol's and a PLT relocation


def test_a_repeated_dynamic_tag_cannot_hide_the_relocations_the_loader_reads(modules, tmp_path):
    """The loader keeps the last DT_RELA: a fake one before it must not be what is checked."""
    source = HIDDEN_IFUNC + "static void picked(void) __attribute__((ifunc(\"pick\")));\n" \
                            "void (*const volatile chosen)(void) = picked;\n" + KERNEL  # an IRELATIVE in DT_RELA
    library = _shared(tmp_path, "hidden", source, "-nostartfiles")
    assert _refusal(modules, library).startswith("has an IFUNC resolver (an IRELATIVE relocation)")
    entries = _dynamic(library)[2]
    fake = [[7, _tag(library, 23)]]  # DT_RELA at the PLT's relocations (a call to _exit, no IRELATIVE)
    assert _refusal(modules, _with_dynamic(library, fake + entries)) == \
        "is corrupt: its dynamic section has 2 entries of tag 7, not 1"
    plain = _shared(tmp_path, "plain", RELOCATED, "-nostartfiles")
    entries = _dynamic(plain)[2]
    needed = [entry for entry in entries if entry[0] == 1]  # DT_NEEDED alone may repeat
    cpu_device.check_library(memoryview(_with_dynamic(plain, needed + entries)), "needs.so")  # no error


def test_a_relocation_naming_a_symbol_the_hash_table_does_not_reach_is_refused(modules, tmp_path):
    """A LOCAL defined IFUNC symbol past DT_HASH's nchain: the loader runs its resolver for a
    relocation naming it (no lookup by name), while a scan of the hashed symbols misses it."""
    source = HIDDEN_IFUNC + "void picked(void) __attribute__((ifunc(\"pick\")));\n" \
                            "void *use(void) { return (void *)picked; }\n" + KERNEL
    # -fno-plt: _exit's GOT entry is relocated before picked's, so the resolver can call it
    elf = bytearray(_shared(tmp_path, "unhashed", source, "-nostartfiles", "-fno-plt", "-Wl,--hash-style=sysv"))
    symbols, strings = _at(elf, _tag(elf, 6)), _at(elf, _tag(elf, 5))
    nchain = _at(elf, _tag(elf, 4)) + 4
    hashed = int.from_bytes(elf[nchain : nchain + 4], "little")
    index = next(i for i in range(hashed) if elf[strings + int.from_bytes(elf[symbols + 24 * i :][:4], "little"):]
                 .startswith(b"picked\0"))
    elf[symbols + 24 * index + 4] = 10  # STB_LOCAL, STT_GNU_IFUNC
    assert _refusal(modules, bytes(elf)).startswith("defines an IFUNC symbol 'picked'")
    elf[nchain : nchain + 4] = index.to_bytes(4, "little")  # picked and any later symbol lie past the hash table
    assert re.fullmatch(rf"is corrupt: a relocation at 0x[0-9a-f]+ names symbol {index}, past the {index} its hash "
                        r"table counts", _refusal(modules, bytes(elf)))


def _entry(elf: bytes, tag: int, value: int | None) -> bytes:
    """The library with its `tag` entry's value changed (or the entry removed, for None)."""
    entries = [[t, value if t == tag else v] for t, v in _dynamic(elf)[2] if t != tag or value is not None]
    return _with_dynamic(elf, entries)


def _relocation(elf: bytes, i: int, target: int | None = None, kind: int | None = None, symbol: int | None = None):
    """The library with DT_RELA's relocation `i` changed."""
    at = _at(elf, _tag(elf, 7)) + 24 * i
    offset, info = struct.unpack_from("<QQ", elf, at)
    info = (info >> 32 if symbol is None else symbol) << 32 | (info & 0xFFFFFFFF if kind is None else kind)
    return elf[:at] + struct.pack("<QQ", offset if target is None else target, info) + elf[at + 16 :]


@pytest.mark.parametrize(("edit", "found"), [
    (lambda elf: _entry(elf, 9, 16), "is corrupt: its DT_RELAENT is 16, not 24"),
    (lambda elf: _entry(elf, 9, None), "is corrupt: its dynamic section has 0 entries of tag 9, not 1"),
    (lambda elf: _entry(elf, 11, 16), "is corrupt: its DT_SYMENT is 16, not 24"),
    (lambda elf: _entry(elf, 20, 17), "is corrupt: its DT_PLTREL is 17, not 7"),
    (lambda elf: _with_dynamic(elf, [[17 if t == 7 else t, v] for t, v in _dynamic(elf)[2]]),
     "has a DT_REL entry: a library's relocations may be only DT_RELA and DT_JMPREL ones"),
    (lambda elf: _with_dynamic(elf, [[36, _tag(elf, 7)], *_dynamic(elf)[2]]), "has a DT_RELR entry: "),
    (lambda elf: _entry(elf, 8, _tag(elf, 8) - 4), r"is corrupt: its relocation table of \d+ bytes is no whole "
                                                    r"number of 24-byte entries"),
    (lambda elf: _entry(elf, 0x6FFFFFF9, 3), r"is corrupt: its relocation 1 of type 1 lies among the first 3 "
                                              r"\(DT_RELACOUNT\), which must be relative ones"),
    (lambda elf: _relocation(elf, 0, target=1 << 40), "is corrupt: a relocation writes at 0x10000000000, outside "
                                                      "its writable loaded segments"),
    (lambda elf: _relocation(elf, 0, target=0x1000), "is corrupt: a relocation writes at 0x1000, outside "),
    (lambda elf: _relocation(elf, 1, kind=5), r"has a COPY relocation at 0x[0-9a-f]+, which would copy as many "
                                              r"bytes as a symbol says"),
    (lambda elf: _relocation(elf, 1, symbol=1000), r"is corrupt: a relocation at 0x[0-9a-f]+ names symbol 1000, "
                                                   r"past the \d+ its hash table counts"),
])
def test_relocations_the_loader_would_assert_on_or_write_outside_the_library_are_refused(modules, tmp_path, edit,
                                                                                          found):
    library = _shared(tmp_path, "relocated", RELOCATED, "-nostartfiles")
    cpu_device.check_library(memoryview(library), "relocated.so")  # no error as built
    assert re.match(found, _refusal(modules, edit(library)))
