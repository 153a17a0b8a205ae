"""Issue 12: nothing in a .hxb is trusted. Sizes that overflow int64, sources that are no file,
kernel symbols that resolve outside the module's own library, libraries that leak fds or alias
each other, files left behind, and libraries whose dlerror text is not UTF-8."""

from __future__ import annotations

import os
import signal
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
void answer(float *out, int64_t first, int64_t last) { out[0] = (float)(salt & 0xffffff); }
"""


def answer_module(modules) -> tuple[dict, list]:
    """`main() -> float32[1]`: one native kernel `answer` writing its library's salt."""
    builder = modules.Builder()
    builder.kernels.append({"name": "answer", "op": "answer", "epilogues": [], "device": "cpu", "symbol": "answer",
                            "args": [{"shape": [1], "dtype": "float32", "access": "write"}], "sizes": [],
                            "work": {"extent": 1, "grain": 1}})
    entry = builder.entry()
    entry.ret(entry.call(0))
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


def test_the_best_cpu_library_this_host_runs_is_loaded(modules, answer_library, monkeypatch):
    manifest, blobs = answer_module(modules)
    build = manifest["cpu"]["libraries"][0]
    blobs.append(("cpu-future.so", salted(answer_library, 7)))
    future = {"cpu": "future", "features": ["sse2", "avx9000"], "library": len(blobs) - 1}
    blobs.append(("cpu-fast.so", salted(answer_library, 8)))
    fast = {"cpu": "fast", "features": build["features"], "library": len(blobs) - 1}
    manifest["cpu"]["libraries"] = [future, fast, build]
    monkeypatch.setattr(cpu_device, "_cpu_flags", lambda: set(build["features"]))
    assert load(hxb.encode(manifest, blobs), "cpu").main().tolist() == [8]
    monkeypatch.setattr(cpu_device, "_cpu_flags", lambda: set())
    if build["features"]:  # x86: the baseline needs sse2 too
        with pytest.raises(DeviceError, match="no CPU library of the module runs on this machine: future needs"):
            load(hxb.encode(manifest, blobs), "cpu")


def test_a_non_utf8_dlerror_is_one_clean_device_error(tmp_path, modules, compile_c):
    (tmp_path / "dep.c").write_text("int dep(void) { return 1; }\n")
    soname = b"libhexir\xff\xfe.so"
    subprocess.run([b"cc", b"-shared", b"-fPIC", b"-Wl,-soname," + soname, b"-o", bytes(tmp_path / "dep.so"),
                    bytes(tmp_path / "dep.c")], check=True)
    (tmp_path / "main.c").write_text("int dep(void);\nint use(void) { return dep(); }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", tmp_path / "main.so", tmp_path / "main.c", tmp_path / "dep.so"],
                   check=True)
    manifest, blobs = modules.mlp((tmp_path / "main.so").read_bytes())
    with pytest.raises(DeviceError, match=r"^cannot load the CPU library for generic \(blob 3\): libhexir\ufffd\ufffd"):
        load(hxb.encode(manifest, blobs), "cpu")


def test_the_fallback_file_is_removed_whether_dlopen_succeeds_or_not(modules, c_library, monkeypatch, tmp_path):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setattr(cpu_device, "_libraries", {})
    monkeypatch.delattr(os, "memfd_create", raising=False)
    load(hxb.encode(*modules.mlp(c_library)), "cpu")
    with pytest.raises(DeviceError, match="file too short"):
        load(hxb.encode(*modules.mlp(b"\x7fELF")), "cpu")
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
