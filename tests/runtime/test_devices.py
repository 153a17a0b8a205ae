"""Device conformance: every device computes what numpy computes; the CPU device's own duties
(host checks, loading the library without files, splitting launches over threads)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import tempfile
import threading
import warnings
from dataclasses import replace

import numpy as np
import pytest
from hexir_runtime import DeviceError, HxbFormatError, load
from hexir_runtime import cpu as cpu_device
from hexir_runtime import format as hxb
from hexir_runtime.cpu import CpuDevice, pick_library
from hexir_runtime.format import Cpu, CpuLibrary
from hexir_runtime.reference import ReferenceDevice

DEVICES = ["reference", "cpu"]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture
def library(device, request) -> bytes | None:
    """The real kernels for the cpu device; the reference device never looks at them."""
    return request.getfixturevalue("c_library") if device == "cpu" else None


def test_mlp_matches_numpy(modules, device, library):
    module = load(hxb.encode(*modules.mlp(library)), device)
    x = np.random.default_rng(5).standard_normal((2, 8)).astype(np.float32)
    y = module.main(x)
    assert y.dtype == np.float32 and y.shape == (2, 4)
    np.testing.assert_allclose(y, modules.mlp_numpy(x, modules.weights()), rtol=1e-5, atol=1e-5)
    hidden, y2 = module.layers(x)
    np.testing.assert_array_equal(y2, y)
    np.testing.assert_allclose(hidden, np.maximum(x @ modules.weights()["W1"] + modules.weights()["b1"], 0), rtol=1e-5)


def test_devices_agree_on_float64(modules, c_library):
    data = hxb.encode(*modules.big(c_library))
    x = np.random.default_rng(2).standard_normal((300, 96))
    reference, native = load(data, "reference").main(x), load(data, "cpu").main(x)
    assert native.dtype == np.float64
    np.testing.assert_allclose(native, reference, rtol=1e-12, atol=1e-12)
    constants = hxb.decode(data).json["constants"]
    w, b = (np.frombuffer(hxb.decode(data).blob(c["blob"]), c["dtype"]).reshape(c["shape"]) for c in constants)
    np.testing.assert_allclose(native, np.maximum(x @ w + b, 0), rtol=1e-12, atol=1e-12)


@pytest.fixture
def fresh_pool(monkeypatch):
    """The process has no worker pool yet (neither the Python one nor a library's native one:
    these tests' hand-written libraries have none); the one the test starts is shut down after it."""
    monkeypatch.setattr(cpu_device, "_pool", None)
    monkeypatch.setattr(cpu_device, "_native", None)
    yield
    if cpu_device._pool is not None:
        cpu_device._pool.shutdown()


@pytest.mark.parametrize("threads", [1, 3])
def test_a_split_launch_takes_four_chunks_a_thread_one_if_it_walks_spans(modules, c_library, threads):
    """Chunks for balance (CHUNKS_PER_THREAD a thread, the threads taking them in turn); a
    kernel whose work record has `spans` walks its chunk as one span: one a thread; one thread
    never splits."""
    module = load(hxb.encode(*modules.big(c_library)), CpuDevice(threads=threads, split_bytes=0))
    program = module._executors["main"].programs[0]
    buffers = [np.zeros(shape) for shape in ((300, 96), (96, 64), (64,), (300, 64))]
    function, work, integers = program.kernels[0]
    assert (work.extent, work.grain, work.spans) == (300, 1, False)
    ranges = program.prepare(0, buffers, {})[3]
    assert len(ranges) == (1 if threads == 1 else threads * cpu_device.CHUNKS_PER_THREAD)
    assert [first for first, _ in ranges[1:]] == [last for _, last in ranges[:-1]]  # in order, no gap
    assert ranges[0][0] == 0 and ranges[-1][1] == 300
    program.kernels[0] = (function, replace(work, spans=True), integers)
    assert len(program.prepare(0, buffers, {})[3]) == threads


@pytest.mark.parametrize("threads", [2, 4, 7])
def test_parallel_split_gives_identical_results(modules, c_library, threads, fresh_pool):
    data = hxb.encode(*modules.big(c_library))
    x = np.random.default_rng(3).standard_normal((300, 96))
    inline = load(data, CpuDevice(threads=1)).main(x)
    assert cpu_device._pool is None
    split = load(data, CpuDevice(threads=threads, split_bytes=0)).main(x)
    np.testing.assert_array_equal(split, inline)
    assert cpu_device._pool is not None  # the split really happened


def test_small_launches_run_inline(modules, c_library, fresh_pool):
    device = CpuDevice(threads=4)  # default threshold: 1 MiB of arguments
    load(hxb.encode(*modules.mlp(c_library)), device).main(np.ones((2, 8), np.float32))
    assert cpu_device._pool is None


def test_modules_share_one_pool_of_worker_threads(modules, c_library):
    data = hxb.encode(*modules.big(c_library))
    x = np.random.default_rng(3).standard_normal((300, 96))
    loaded = [load(data, CpuDevice(split_bytes=0)) for _ in range(8)]  # as 8 jit signatures would keep them
    for module in loaded:
        module.main(x)
    workers = [thread for thread in threading.enumerate() if thread.name.startswith("hexir-cpu")]
    assert 0 < len(workers) <= (os.cpu_count() or 1)


def test_reference_runs_cuda_kernels(modules, capsys):
    module = load(hxb.encode(*modules.cuda()), "reference")
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4) - 12
    np.testing.assert_array_equal(module.main(x), np.maximum(x, 0))
    assert capsys.readouterr().out.splitlines()[3] == "0.000000 1.000000 2.000000 3.000000 "


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_cuda_kernels_run_as_their_cpu_fallbacks(modules, c_library, device, no_gpu):
    module = load(hxb.encode(*modules.cuda(c_library)), device)
    assert module.device_name == "cpu"
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4) - 12
    np.testing.assert_array_equal(module.main(x), np.maximum(x, 0))


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_cuda_kernels_without_fallback_need_a_gpu(modules, device, no_gpu):
    with pytest.raises(DeviceError, match=r"^kernels\[0\] \(k0_relu\) runs on cuda and has no cpu_fallback: run this "
                                          r"module with --device=cuda on a GPU \(or with --device=reference, in "
                                          r"numpy\)$"):
        load(hxb.encode(*modules.cuda(fallback=False)), device)
    load(hxb.encode(*modules.cuda(fallback=False)), "reference")  # as the advice says


def test_cuda_device_needs_cuda_python(modules, monkeypatch):
    import hexir_runtime.module

    monkeypatch.setattr(hexir_runtime.module, "_cuda_devices", [])
    for name in ("cuda", "cuda.bindings", "cuda.bindings.driver"):
        monkeypatch.setitem(sys.modules, name, None)  # an import of cuda-python fails
    monkeypatch.setattr(hexir_runtime.module, "has_cuda_driver", lambda: True)
    with pytest.raises(DeviceError, match=r"CUDA support needs cuda-python: pip install 'hexir-runtime\[cuda\]'"):
        load(hxb.encode(*modules.cuda()), "cuda")
    monkeypatch.setattr(hexir_runtime.module, "has_cuda_driver", lambda: False)  # no GPU at all: say that
    with pytest.raises(DeviceError, match=r"^no CUDA driver on this machine \(libcuda.so.1 cannot be loaded\)$"):
        load(hxb.encode(*modules.cuda()), "cuda")


def test_the_no_gpu_notice_is_given_once_per_process(modules, c_library, no_gpu):
    data = hxb.encode(*modules.cuda(c_library))
    with pytest.warns(RuntimeWarning, match=r"no usable GPU \(no CUDA device \(made unusable by the test\)\)"):
        load(data, "auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second module, or the same again: no second notice
        load(data, "auto")


def test_the_cuda_kernel_table_is_checked_before_gpu_code_loads(modules, c_library, monkeypatch):
    """A fake GPU device that only counts loads: the table is checked first, field by field."""
    import hexir_runtime.module

    class Gpu:
        name, kinds = "cuda (fake)", ("cuda",)

        def load(self, hxb):
            raise AssertionError("GPU code was loaded before the table was checked")

    monkeypatch.setattr(hexir_runtime.module, "_cuda_device", Gpu)
    manifest, blobs = modules.cuda(c_library)
    for edit, field in [(lambda m: m["kernels"][0]["launch"].update(block=[64, 1, 1]), "kernels[0].launch"),
                        (lambda m: m["kernels"][0]["args"][0].update(shape=[4, 3, 2]), "kernels[0].args"),
                        (lambda m: m["kernels"][0].update(symbol="system"), "kernels[0].symbol"),
                        (lambda m: m.pop("cuda"), "cuda")]:
        changed = copy.deepcopy(manifest)
        edit(changed)
        if field == "kernels[0].args":
            changed["kernels"][0]["args"][1].update(shape=[4, 3, 2])
            changed["entries"][0]["buffers"] = [dict(b, shape=[4, 3, 2]) for b in changed["entries"][0]["buffers"]]
            changed["entries"][0]["inputs"][0]["shape"] = changed["entries"][0]["outputs"][0]["shape"] = [4, 3, 2]
        with pytest.raises(HxbFormatError) as error:
            load(hxb.encode(changed, blobs), "cuda")
        assert error.value.field == field, error.value


def test_cuda_device_needs_cuda_kernels(modules):
    with pytest.raises(DeviceError, match="this module has no CUDA kernels"):
        load(hxb.encode(*modules.mlp()), "cuda")
    with pytest.raises(DeviceError, match="unknown device 'gpu'"):
        load(hxb.encode(*modules.mlp()), "gpu")


def test_missing_symbol(modules, c_library):
    manifest, blobs = modules.mlp(c_library)
    manifest["kernels"][1]["symbol"] = "no_such_kernel"
    message = r"kernels\[1\].symbol: k1_relu: symbol 'no_such_kernel' is not in the kernel table of the CPU library"
    with pytest.raises(HxbFormatError, match=message):
        load(hxb.encode(manifest, blobs), "cpu")
    load(hxb.encode(manifest, blobs), "reference")  # the oracle needs no symbols


def test_wrong_architecture(modules, c_library):
    manifest, blobs = modules.mlp(c_library)
    manifest["cpu"]["arch"] = "riscv64"
    with pytest.raises(DeviceError, match="the module's CPU code is for riscv64, but this machine is"):
        load(hxb.encode(manifest, blobs), "cpu")


def test_missing_cpu_features(modules, c_library, monkeypatch):
    manifest, blobs = modules.mlp(c_library)
    manifest["cpu"]["libraries"][0]["features"] += ["avx9000", "quantum"]
    data = hxb.encode(manifest, blobs)
    if cpu_device._cpu_flags() is not None:
        with pytest.raises(DeviceError, match="needs CPU features this machine lacks: avx9000, quantum"):
            load(data, "cpu")
    monkeypatch.setattr(cpu_device, "_cpu_flags", lambda: None)  # /proc/cpuinfo unreadable: not checked
    assert load(hxb.encode(*modules.mlp(c_library)), "cpu").main(np.ones((2, 8), np.float32)).shape == (2, 4)
    # the manifest's word is checked against the library's own record (its kernel table)
    with pytest.raises(HxbFormatError, match=r'^cpu\.libraries\[0\]\.features: the manifest says \["sse", "sse2", '
                                             r'"avx9000", "quantum"\], the kernel table of the CPU library for generic '
                                             r'\(blob 3\) says \["sse", "sse2"\]$'):
        load(data, "cpu")


def test_pick_library_normalises_architectures_and_takes_the_best_that_fits(monkeypatch):
    v3, v1 = CpuLibrary("x86-64-v3", ("avx2", "fma"), 0), CpuLibrary("x86-64", ("sse2",), 1)
    section = Cpu("x86_64", (v3, v1))
    assert pick_library(section, machine="AMD64", flags={"avx2", "fma", "sse2"}) == v3
    assert pick_library(replace(section, arch="amd64"), machine="x86_64", flags={"sse2", "avx2"}) == v1
    monkeypatch.setattr(cpu_device, "_cpu_flags", lambda: None)
    assert pick_library(section, machine="x86_64") == v1  # features unknown: the most basic build
    with pytest.raises(DeviceError, match="x86-64-v3 needs CPU features this machine lacks: avx2, fma; "
                                          "x86-64 needs CPU features this machine lacks: sse2"):
        pick_library(section, machine="x86_64", flags={"sse"})
    with pytest.raises(DeviceError, match="for x86_64, but this machine is aarch64"):
        pick_library(section, machine="aarch64", flags=None)


def test_library_leaves_no_files(modules, c_library, monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(cpu_device, "_libraries", {})
    load(hxb.encode(*modules.mlp(c_library)), "cpu")
    assert list(tmp_path.iterdir()) == []


def test_library_from_a_deleted_temporary_file(modules, c_library, monkeypatch, tmp_path):
    """Without memfd_create the library goes through a temporary file deleted right after dlopen."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(cpu_device, "_libraries", {})
    monkeypatch.delattr(os, "memfd_create", raising=False)
    module = load(hxb.encode(*modules.mlp(c_library)), "cpu")
    assert list(tmp_path.iterdir()) == []
    assert module.matmul(np.eye(2, dtype=np.float32), np.eye(2, dtype=np.float32)).tolist() == [[1, 0], [0, 1]]


def test_two_libraries_in_one_process(modules, c_library, tmp_path, monkeypatch):
    """Each module gets its own library, even when the first module is gone before the second
    loads (the dynamic loader knows libraries by path, and /proc/self/fd/N paths repeat)."""
    source = tmp_path / "other.c"
    builder = modules.Builder()
    kernel = builder.kernel("relu", [[2, 16], [2, 16]])
    builder.kernels[kernel]["symbol"] = "doubled"
    source.write_text("#include <stdint.h>\nvoid doubled(const float *x, float *out, int64_t first, int64_t last)"
                      " { for (int64_t i = first * 16; i < last * 16; ++i) out[i] = 2 * x[i]; }\n"
                      + modules.table_c(builder.kernels))
    subprocess.run(["cc", "-shared", "-fPIC", "-nostartfiles", "-o", str(tmp_path / "other.so"), str(source)],
                   check=True)
    monkeypatch.setattr(cpu_device, "_libraries", {})
    first = load(hxb.encode(*modules.mlp(c_library)), "cpu")
    del first
    entry = builder.entry()
    entry.ret(entry.call(kernel, entry.input("x", [2, 16])))
    second = load(hxb.encode(*builder.build((tmp_path / "other.so").read_bytes())), "cpu")
    x = np.arange(32, dtype=np.float32).reshape(2, 16)
    np.testing.assert_array_equal(second.main(x), 2 * x)


def test_every_device_has_the_same_shape():
    for device in (ReferenceDevice(), CpuDevice()):
        for method in ("alloc", "free", "copy_in", "copy_out", "copy_out_into", "synchronize", "load"):
            assert callable(getattr(device, method)), (device, method)
        assert isinstance(device.name, str) and set(device.kinds) == {"cpu", "cuda"}
    assert CpuDevice(fallbacks=False).kinds == ("cpu",)


def test_the_reference_runs_pack_panels_and_the_checks_count_the_panels(modules):
    """`pack_panels` (docs/hxb-format.md): a w given at run time laid out as linear_panels reads
    it (40 columns in 2 panels of 32, zeros past N), then read by it; a panel count that does not
    cover N, a K that is not w's, or a dynamic extent is refused when the file is read."""
    rng = np.random.default_rng(6)
    x, w = rng.standard_normal((3, 8)).astype(np.float32), rng.standard_normal((8, 40)).astype(np.float32)
    builder = modules.Builder()
    pack = builder.kernel("relu", [[8, 40], [2, 8, 32]])
    builder.kernels[pack].update(op="pack_panels")
    del builder.kernels[pack]["expr"]
    linear = builder.kernel("linear", [[3, 8], [2, 8, 32], [3, 40]])
    builder.kernels[linear]["op"] = "linear_panels"
    entry = builder.entry()
    x_buffer, w_buffer = entry.input("x", [3, 8]), entry.input("w", [8, 40])
    panels = entry.call(pack, w_buffer)
    entry.ret(entry.call(linear, x_buffer, panels), panels)
    manifest, blobs = builder.build()
    product, packed = load(hxb.encode(manifest, blobs), "reference").main(x, w)
    np.testing.assert_allclose(product, x @ w, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(packed[1, :, :8], w[:, 32:])
    np.testing.assert_array_equal(packed[1, :, 8:], 0)
    for shapes in (([8, 40], [1, 8, 32]), ([8, 40], [2, 7, 32]), ([8, 40], [2, 8, 0]), (["k", 40], [2, "k", 32])):
        bad = copy.deepcopy(manifest)
        for arg, shape in zip(bad["kernels"][pack]["args"], shapes, strict=True):
            arg["shape"] = shape
        with pytest.raises(HxbFormatError, match=r"kernels\[0\]\.args: pack_panels expects w\[K, N\], "
                                                 r"out\[P, K, L\] \(P = ceil\(N / L\)\)"):
            hxb.encode(bad, blobs)


def test_the_reference_runs_linear_panels_and_the_checks_count_the_panels(modules):
    """`linear_panels` (docs/hxb-format.md): w's 40 columns in 2 panels of 32, K-major, zeros
    past N; the reference device unpacks them; a panel count that does not cover N, or covers it
    with a panel to spare, is refused when the file is read."""
    rng = np.random.default_rng(5)
    x, w, b = (rng.standard_normal(shape).astype(np.float32) for shape in ((3, 8), (8, 40), (40,)))
    padded = np.zeros((8, 64), np.float32)
    padded[:, :40] = w
    builder = modules.Builder()
    constants = builder.constant("W.panels", padded.reshape(8, 2, 32).transpose(1, 0, 2)), builder.constant("b", b)
    kernel = builder.kernel("linear_bias", [[3, 8], [2, 8, 32], [40], [3, 40]])
    builder.kernels[kernel]["op"] = "linear_panels"
    entry = builder.entry()
    entry.ret(entry.call(kernel, entry.input("x", [3, 8]), *(entry.constant(c) for c in constants)))
    manifest, blobs = builder.build()
    np.testing.assert_allclose(load(hxb.encode(manifest, blobs), "reference").main(x), x @ w + b, rtol=1e-5, atol=1e-5)
    empty = copy.deepcopy(manifest)  # K = 0: the bias alone
    empty["kernels"][kernel]["args"][:2] = [{**arg, "shape": shape} for arg, shape in
                                            zip(empty["kernels"][kernel]["args"], ([3, 0], [2, 0, 32]), strict=False)]
    empty["constants"][0]["shape"] = [2, 0, 32]
    for buffer in empty["entries"][0]["buffers"][:2]:
        buffer["shape"] = [3, 0] if buffer["shape"] == [3, 8] else [2, 0, 32]
    empty["entries"][0]["inputs"][0]["shape"] = [3, 0]
    blobs_empty = [(name, b"" if name == "constant:W.panels" else data) for name, data in blobs]
    result = load(hxb.encode(empty, blobs_empty), "reference").main(np.ones((3, 0), np.float32))
    np.testing.assert_array_equal(result, np.broadcast_to(b, (3, 40)))
    for panels in ([1, 8, 32], [3, 8, 32], [2, 8, 0], [2, 7, 32]):
        bad = copy.deepcopy(manifest)
        bad["kernels"][kernel]["args"][1]["shape"] = panels
        with pytest.raises(HxbFormatError, match=r"kernels\[0\]\.args: linear_panels expects x\[\.\.\., K\], "
                                                 r"w\[P, K, L\] \(P = ceil\(N / L\)\), epilogue inputs "
                                                 r"\(leading axes out.s, or 1\), out\[\.\.\., N\]"):
            hxb.encode(bad, blobs)


def test_the_reference_runs_linear_t_and_the_checks_want_w_transposed(modules):
    """`linear_t` (docs/hxb-format.md): w given as w^T [N, K] (a TF32 weight for cuda's wgmma);
    the reference device transposes it back; w as [K, N] is refused when the file is read."""
    rng = np.random.default_rng(6)
    x, w, b = (rng.standard_normal(shape).astype(np.float32) for shape in ((3, 8), (8, 40), (40,)))
    builder = modules.Builder()
    constants = builder.constant("W.tf32t", np.ascontiguousarray(w.T)), builder.constant("b", b)
    kernel = builder.kernel("linear_bias", [[3, 8], [40, 8], [40], [3, 40]])
    builder.kernels[kernel]["op"] = "linear_t"
    entry = builder.entry()
    entry.ret(entry.call(kernel, entry.input("x", [3, 8]), *(entry.constant(c) for c in constants)))
    manifest, blobs = builder.build()
    np.testing.assert_allclose(load(hxb.encode(manifest, blobs), "reference").main(x), x @ w + b, rtol=1e-5, atol=1e-5)
    manifest["kernels"][kernel]["args"][1]["shape"] = [8, 40]
    with pytest.raises(HxbFormatError, match=r"kernels\[0\]\.args: linear_t expects x\[\.\.\., K\], w\[N, K\], "):
        hxb.encode(manifest, blobs)
