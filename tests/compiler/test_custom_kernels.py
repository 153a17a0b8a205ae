"""Custom kernels: declaration, placement, IR, export-time builds and checks, and the cpu
variant end to end (the CUDA variant is built and inspected, not run: CI has no GPU)."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from pathlib import Path

import hexir_runtime
import hexir_runtime.cli
import numpy as np
import pytest

import hexir
from hexir.errors import CompileError, PlacementError, TraceError

from .conftest import manifest

KERNELS = Path(__file__).parent / "kernels"
SPEC = hexir.TensorSpec((3, 5), "float32")


def same_shape(x):
    return hexir.TensorSpec(x.shape, x.dtype)


def grid(x):
    return ((x.shape[0] * x.shape[1] + 127) // 128, 1, 1)


def scale2(**files):
    files = files or {"cpu": "kernels/scale2.c", "cuda": "kernels/scale2.cu"}
    return hexir.kernel("scale2", out=same_shape, grid=grid, block=(128, 1, 1), **files)


def calling(kernel):
    """A traceable function of one argument that calls `kernel` on it."""
    return lambda x: kernel(x)


def expected(x):
    return 2 * x + x.size


def export(tmp_path, fn, *specs, **options) -> dict:
    path = tmp_path / "m.hxb"
    hexir.export(fn, path, *specs, **options)
    return path


# ---- declaring -----------------------------------------------------------------------------

@pytest.mark.parametrize(("arguments", "message"), [
    ({"name": "2bad", "cpu": "k.c"}, r"hexir.kernel: the name must be the kernel's C symbol, got '2bad'"),
    ({"name": "k"}, r"hexir.kernel k: give at least one of cuda= or cpu="),
    ({"name": "k", "cuda": "k.c"}, r"hexir.kernel k: cuda='k.c' must be one of .cu, .ptx, .cubin, .fatbin "
                                   r"\(a .c file is cpu code\)"),
    ({"name": "k", "cpu": "k.ptx"}, r"hexir.kernel k: cpu='k.ptx' must be one of .c, .o, .so \(a .ptx file is cuda"),
    ({"name": "k", "cuda": "k.cu", "grid": None}, r"hexir.kernel k: a cuda kernel needs grid="),
    ({"name": "k", "cpu": "k.c", "block": (64, 32, 1)}, r"block=\(64, 32, 1\) has 2048 threads; a CUDA block "
                                                        r"has at most 1024"),
    ({"name": "k", "cpu": "k.c", "block": (0,)}, r"block= must be 1 to 3 positive integers, got \(0,\)"),
    ({"name": "k", "cpu": "k.c", "out": "nope"}, r"out= must be a function of the input specs"),
])
def test_declaration_errors(arguments, message):
    arguments = {"out": same_shape, "grid": grid, **arguments}
    with pytest.raises(TraceError, match=message) as error:
        hexir.kernel(arguments.pop("name"), **arguments)
    assert error.value.where.startswith(__file__)


# ---- tracing -------------------------------------------------------------------------------

def test_missing_file_names_the_folders_searched(tmp_path):
    kernel = hexir.kernel("k", cpu="nowhere/k.c", out=same_shape, search_path=[tmp_path])
    with pytest.raises(TraceError, match=rf"custom kernel k: cpu file 'nowhere/k.c' not found \(looked in "
                                         rf"{KERNELS.parent}/nowhere, {tmp_path}/nowhere\)"):
        hexir.jit(lambda x: kernel(x)).trace(SPEC)


def test_files_are_found_through_the_search_paths(tmp_path):
    (tmp_path / "lib").mkdir()
    shutil.copy(KERNELS / "scale2.c", tmp_path / "lib" / "moved.c")
    kernel = hexir.kernel("scale2", cpu="moved.c", out=same_shape)
    fn = hexir.jit(lambda x: kernel(x), kernel_search_path=[tmp_path / "lib"])
    assert f'cpu = "{tmp_path}/lib/moved.c"' in str(fn.trace(SPEC))


@pytest.mark.parametrize(("out", "message"), [
    (lambda x: (3, 5), r"custom kernel scale2: out= returned \(3, 5\); expected a hexir.TensorSpec"),
    (lambda x: hexir.TensorSpec((3, 5), "int8"),
     r"TensorSpec: dtype must be float32, float64, bfloat16 or float16 \(or int32, int64\), got int8"),
])
def test_a_bad_result_rule_is_an_error_at_the_call(out, message):
    kernel = hexir.kernel("scale2", cpu="kernels/scale2.c", out=out)
    with pytest.raises(TraceError, match=message) as error:
        hexir.jit(lambda x: kernel(x)).trace(SPEC)  # the call's line
    assert error.value.where.startswith(__file__)


def test_a_bad_grid_rule_is_an_error_at_the_call():
    kernel = hexir.kernel("scale2", cuda="kernels/scale2.cu", out=same_shape, grid=lambda x: (0, 1))
    with pytest.raises(TraceError, match=r"custom kernel scale2: grid must be 1 to 3 positive integers, got \(0, 1\)"):
        hexir.jit(lambda x: kernel(x)).trace(SPEC)


def test_the_graph_op_records_files_and_launch_geometry():
    text = str(hexir.jit(lambda x: scale2()(x)).trace(SPEC))
    assert '"hexir.custom_call"(%arg0)' in text
    assert f'objects = {{cpu = "{KERNELS}/scale2.c", cuda = "{KERNELS}/scale2.cu"}}' in text
    assert "block = array<i64: 128, 1, 1>" in text and "grid = array<i64: 1, 1, 1>" in text


# ---- placement -----------------------------------------------------------------------------

def test_a_cuda_only_kernel_cannot_be_placed_on_the_cpu(tmp_path):
    kernel = scale2(cuda="kernels/scale2.cu")

    def f(x):
        with hexir.on("cpu"):
            return kernel(x)
    with pytest.raises(PlacementError, match=r"custom kernel scale2 is placed on cpu but has no cpu file "
                                             r"\(it has: cuda\); it can only run on cuda"):
        export(tmp_path, f, SPEC)
    with pytest.raises(PlacementError, match="has no cpu file"):
        export(tmp_path, lambda x: kernel(x), SPEC, placement="hexir.custom_call=cpu")


def test_default_placement_prefers_the_cpu_file(tmp_path):
    both = manifest(export(tmp_path, lambda x: scale2()(x), SPEC).read_bytes())
    assert [k["device"] for k in both["kernels"]] == ["cpu"]
    cuda_only = manifest(export(tmp_path, lambda x: scale2(cuda="kernels/scale2.cu")(x), SPEC).read_bytes())
    assert [k["device"] for k in cuda_only["kernels"]] == ["cuda"]


def test_tir_declares_the_kernel_and_transfers_are_inserted():
    fn = hexir.jit(lambda x: scale2()(hexir.relu(x)), placement="hexir.custom_call=cuda")
    from hexir.driver import run_stage
    text = str(run_stage(fn.trace(SPEC), "mlir-tir", fn.options))
    (name,) = re.findall(r'func\.func private @(scale2_[0-9]+)\(memref<3x5xf32>, memref<3x5xf32>\) attributes '
                         r'\{hextir\.custom = .*#hextir\.kernel<"cuda", "custom">', text)
    assert f"func.func private @{name}_cpu(" in text and f"hextir.fallback_of = @{name}" in text
    assert '{source = "cpu", target = "cuda"}' in text and '{source = "cuda", target = "cpu"}' in text


# ---- the cpu variant, end to end --------------------------------------------------------------

def test_a_custom_cpu_kernel_runs_between_generated_ones(tmp_path):
    w = np.arange(20, dtype=np.float32).reshape(5, 4) / 10
    kernel = scale2()
    path = export(tmp_path, lambda x: hexir.linear(kernel(hexir.relu(x)), w), SPEC)
    x = np.linspace(-3, 3, 15, dtype=np.float32).reshape(3, 5)
    np.testing.assert_allclose(hexir_runtime.load(path, "cpu").main(x), expected(np.maximum(x, 0)) @ w, rtol=1e-6)
    kernels = manifest(path.read_bytes())["kernels"]
    assert kernels[1]["op"] == "custom" and kernels[1]["symbol"] == "scale2"
    assert kernels[1]["scalars"] == [3, 5, 3, 5] and kernels[1]["source"] == "scale2.c"


@pytest.mark.parametrize("kind", [".o", ".so"])
def test_prebuilt_cpu_objects_are_embedded(tmp_path, kind):
    built = tmp_path / f"scale2{kind}"
    flags = ["-c"] if kind == ".o" else ["-shared", "-nostartfiles"]  # docs/custom-kernels.md: no constructors
    subprocess.run(["cc", "-O2", "-fPIC", *flags, str(KERNELS / "scale2.c"), "-o", str(built)], check=True)
    kernel = hexir.kernel("scale2", cpu=built, out=same_shape, dtypes=("float32", "float32"))  # prebuilt
    path = export(tmp_path, lambda x: kernel(x), SPEC)
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    np.testing.assert_allclose(hexir_runtime.load(path, "cpu").main(x), expected(x), rtol=1e-6)
    assert ("library" in manifest(path.read_bytes())["kernels"][0]) == (kind == ".so")


def test_a_cuda_kernel_runs_as_its_cpu_file_without_a_gpu(tmp_path):
    path = export(tmp_path, lambda x: scale2()(x), SPEC, placement="hexir.custom_call=cuda")
    x = np.random.default_rng(1).standard_normal((3, 5)).astype(np.float32)
    np.testing.assert_allclose(hexir_runtime.load(path, "cpu").main(x), expected(x), rtol=1e-6)
    kernel = manifest(path.read_bytes())["kernels"][0]
    assert kernel["cpu_fallback"] == {"symbol": "scale2", "source": "scale2.c"}


# ---- the cuda variant, built and inspected ------------------------------------------------------

def test_a_cu_file_becomes_a_cubin_per_arch_and_ptx(tmp_path):
    path = export(tmp_path, lambda x: scale2(cuda="kernels/scale2.cu")(x), hexir.TensorSpec((300, 7), "float32"),
                  target="cuda:sm_80,cuda:sm_90")
    data = hexir_runtime.format.decode(path.read_bytes())
    kernel = data.json["kernels"][0]
    assert kernel["launch"] == {"grid": [-(-300 * 7 // 128), 1, 1], "block": [128, 1, 1], "shared_bytes": 0}
    assert sorted(kernel["images"]) == ["compute_80", "sm_80", "sm_90"]
    for arch in ("sm_80", "sm_90"):
        cubin = bytes(data.blob(kernel["images"][arch]))
        assert cubin[:4] == b"\x7fELF" and struct.unpack_from("<H", cubin, 18)[0] == 190
        assert (struct.unpack_from("<I", cubin, 48)[0] >> 8) & 0xFF == int(arch[3:])
    ptx = bytes(data.blob(kernel["images"]["compute_80"]))
    assert b".entry scale2(" in ptx and b".target sm_80" in ptx
    assert "cpu_fallback" not in kernel and "cpu" not in data.json


def test_ptx_and_cubin_files_are_taken(tmp_path):
    first = hexir_runtime.format.decode(export(tmp_path, lambda x: scale2(cuda="kernels/scale2.cu")(x),
                                               SPEC).read_bytes())
    images = first.json["kernels"][0]["images"]
    (tmp_path / "scale2.ptx").write_bytes(bytes(first.blob(images["compute_90"])))
    (tmp_path / "scale2.cubin").write_bytes(bytes(first.blob(images["sm_90"])))
    for name, keys in (("scale2.ptx", ["compute_90", "sm_90"]), ("scale2.cubin", ["sm_90"])):
        kernel = hexir.kernel("scale2", cuda=tmp_path / name, out=same_shape, grid=grid, dtypes=("float32", "float32"))
        data = manifest(export(tmp_path, calling(kernel), SPEC).read_bytes())
        assert sorted(data["kernels"][0]["images"]) == keys
    kernel = hexir.kernel("scale2", cuda=tmp_path / "scale2.cubin", out=same_shape, grid=grid,
                          dtypes=("float32", "float32"))
    with pytest.raises(CompileError, match=r"is a CUBIN for sm_90, but the module targets sm_80 "
                                           r"\(-target=cuda:sm_90 to build for it\)"):
        export(tmp_path, lambda x: kernel(x), SPEC, target="cuda:sm_80")


# ---- export-time errors -------------------------------------------------------------------------

@pytest.mark.parametrize(("file", "source", "message"), [
    ("bad.c", "void scale2(float *x { }",
     r"compiling custom kernel scale2 \(bad.c\) for x86-64-v4 failed \(exit 1\):\n(.*\n)*.*bad.c:1:22: error"),
    # the signature check, compiled with the file, finds no scale2
    ("other.c", "void something_else(void) {}",
     r"compiling custom kernel scale2 \(other.c\) for x86-64-v4 failed \(exit 1\):\n.*error: .scale2. undeclared"),
    ("bad.cu", "extern \"C\" __global__ void scale2(float *x) { undefined_thing(); }",
     r"NVRTC could not compile .*bad.cu for sm_90:\n.*undefined_thing"),
    ("mangled.cu", "__global__ void scale2(float *x) {}",
     r"NVRTC could not compile .*mangled.cu for sm_90:\n(.*\n)*.*custom kernel scale2: expected extern \"C\" "
     r"__global__ void scale2\(const float \*, float \*, long long, long long, long long, long long\)"),
])
def test_bad_sources_fail_at_export_with_the_tools_message(tmp_path, file, source, message):
    (tmp_path / file).write_text(source)
    device = "cuda" if file.endswith(".cu") else "cpu"
    kernel = hexir.kernel("scale2", **{device: tmp_path / file}, out=same_shape, grid=grid)
    with pytest.raises(CompileError, match=message):
        export(tmp_path, lambda x: kernel(x), SPEC)


def test_an_object_that_is_not_x86_64_elf_is_refused(tmp_path):
    (tmp_path / "scale2.o").write_bytes(b"not an object file at all, but long enough to have a header" * 2)
    kernel = hexir.kernel("scale2", cpu=tmp_path / "scale2.o", out=same_shape, dtypes=("float32", "float32"))
    with pytest.raises(CompileError, match=r"scale2.o is not a 64-bit ELF file"):
        export(tmp_path, lambda x: kernel(x), SPEC)


def test_info_lists_custom_kernels(tmp_path, capsys):
    path = export(tmp_path, lambda x: scale2()(x), SPEC, placement="hexir.custom_call=cuda")
    assert hexir_runtime.cli.main([str(path), "--info"]) == 0
    out = capsys.readouterr().out
    assert "scale2" in out and "scale2.cu" in out and "scale2.c" in out


def test_every_kernel_a_file_serves_is_checked_for_its_symbol(tmp_path):
    shutil.copy(KERNELS / "scale2.c", tmp_path / "ops.c")
    present = hexir.kernel("scale2", cpu=tmp_path / "ops.c", out=same_shape)
    missing = hexir.kernel("scale3", cpu=tmp_path / "ops.c", out=same_shape)
    with pytest.raises(CompileError, match=r"compiling custom kernels scale2, scale3 \(ops.c\) for x86-64-v4 "
                                           r"failed \(exit 1\):\n.*error: .scale3. undeclared"):
        export(tmp_path, lambda x: missing(present(x)), SPEC)
    object_file = tmp_path / "ops.o"  # a prebuilt file is checked with its symbol table
    subprocess.run(["cc", "-O2", "-fPIC", "-c", str(tmp_path / "ops.c"), "-o", str(object_file)], check=True)
    present, missing = (hexir.kernel(name, cpu=object_file, out=same_shape, dtypes=("float32", "float32"))
                        for name in ("scale2", "scale3"))
    with pytest.raises(CompileError, match=r"custom kernel scale3: .*ops.o does not define the symbol 'scale3'"):
        export(tmp_path, lambda x: missing(present(x)), SPEC)


# ---- several kernels per file, and jit's batch sizes ----------------------------------------------

TWO_KERNELS = """#include <stdint.h>
void scale2(const float *x, float *out, int64_t a, int64_t b, int64_t c, int64_t d) {
    for (int64_t i = 0; i < a * b; ++i) out[i] = 2.0f * x[i] + (float)(c * d);
}
void add(const float *x, const float *y, float *out, int64_t a, int64_t b, int64_t c, int64_t d, int64_t e,
         int64_t f) {
    for (int64_t i = 0; i < a * b; ++i) out[i] = x[i] + y[i];
}
"""


def test_one_c_file_serves_two_kernels_of_different_signatures(tmp_path, monkeypatch):
    (tmp_path / "ops.c").write_text(TWO_KERNELS)
    scale = hexir.kernel("scale2", cpu=tmp_path / "ops.c", out=same_shape)
    add = hexir.kernel("add", cpu=tmp_path / "ops.c", out=lambda x, y: same_shape(x))
    compiles = []
    real = hexir.backend.custom.run_tool
    monkeypatch.setattr(hexir.backend.custom, "run_tool",
                        lambda command, *rest: (compiles.append(command) if "-c" in command else None,
                                                real(command, *rest))[1])
    path = export(tmp_path, lambda x: add(scale(x), x), hexir.TensorSpec((3, 5), "float32"), target="cpu:x86-64-v3")
    assert len(compiles) == 1  # the file is compiled once, both kernels' signatures checked in it
    x = np.random.default_rng(2).standard_normal((3, 5)).astype(np.float32)
    np.testing.assert_allclose(hexir_runtime.load(path, "cpu").main(x), expected(x) + x, rtol=1e-6)


def test_two_calls_of_one_kernel_with_two_signatures_name_that_kernel(tmp_path):
    (tmp_path / "ops.c").write_text(TWO_KERNELS)
    scale = hexir.kernel("scale2", cpu=tmp_path / "ops.c", out=same_shape)
    add = hexir.kernel("add", cpu=tmp_path / "ops.c", out=lambda x, y: same_shape(x))
    with pytest.raises(CompileError, match=r"custom kernel scale2: ops.c is called with two signatures, "
                                           r"void scale2\(const float \*, float \*, int64_t, int64_t, int64_t, "
                                           r"int64_t\) and void scale2\(const float \*, float \*, int64_t, int64_t\)"):
        export(tmp_path, lambda x, v: (add(scale(x), x), scale(v)),
               hexir.TensorSpec((3, 5), "float32"), hexir.TensorSpec((4,), "float32"))


def test_jit_compiles_a_custom_kernel_per_batch_size_by_default():
    kernel = scale2(cpu="kernels/scale2.c")
    fn = hexir.jit(lambda x: hexir.relu(kernel(x)), cache=False)
    for rows in (3, 4, 7):
        x = np.random.default_rng(rows).standard_normal((rows, 5)).astype(np.float32)
        np.testing.assert_allclose(fn(x), np.maximum(expected(x), 0), rtol=1e-6)
    assert fn.trace_count == 3  # once per shape: no symbolic batch for a custom kernel


def test_a_custom_kernel_under_a_symbolic_batch_names_dynamic_false():
    kernel = scale2(cpu="kernels/scale2.c")
    fn = hexir.jit(lambda x: kernel(x), dynamic=True, cache=False)
    with pytest.raises(TraceError, match=r"custom kernel scale2: its inputs are float32\[batch, 5\]; custom kernels "
                                         r"take static shapes only .*dynamic=False") as error:
        fn(np.ones((3, 5), np.float32))
    assert error.value.where.startswith(__file__)


def test_one_cu_file_serves_two_kernels(tmp_path):
    add = """extern "C" __global__ void add(const float *x, const float *y, float *out, long long a, long long b,
                                       long long c, long long d, long long e, long long f) {
        long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
        if (i < a * b) out[i] = x[i] + y[i];
    }
    """
    (tmp_path / "ops.cu").write_text((KERNELS / "scale2.cu").read_text() + add)
    scale = hexir.kernel("scale2", cuda=tmp_path / "ops.cu", out=same_shape, grid=grid)
    plus = hexir.kernel("add", cuda=tmp_path / "ops.cu", out=lambda x, y: same_shape(x), grid=lambda x, y: grid(x))
    data = manifest(export(tmp_path, lambda x: plus(scale(x), x), SPEC, target="cuda:sm_90").read_bytes())
    assert [k["symbol"] for k in data["kernels"]] == ["scale2", "add"]
    assert data["kernels"][0]["images"] == data["kernels"][1]["images"]  # one build, both kernels in it
