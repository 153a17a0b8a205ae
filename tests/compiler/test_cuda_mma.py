"""The tensor-core linear (`schedules/cuda_mma.py`) as PTX, checked without a GPU: the mma.sync
shape and types per dtype, ldmatrix (w, stored [K][N], transposed), cp.async of 16 or 4 bytes
(or none: K or N odd), float32 sums stored in the output's type, no local memory; and ptxas
accepts it with no spills. The kernel is built on its own (tests/compiler/kernel_build.py), as
lower-to-tir would build it for such a request."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from mlir import ir

from hexir.backend import cuda as cuda_backend
from hexir.dialects import hextir as ht
from hexir.schedules import Request
from hexir.schedules import cuda as cuda_schedule
from hexir.schedules.cuda_mma import linear_mma
from hexir.target import Target

from .conftest import filecheck
from .kernel_build import cuda_kernel

RELU = ["max", ["arg", 0], ["const", 0]]


def ptx(m, k, n, dtype: str, arch: str = "sm_90", **fields) -> str:
    shapes = [(m, k), (k, n)] + ([(n,)] if fields.get("bias") else []) + [(m, n)]
    module, context = cuda_kernel(linear_mma, shapes, dtype, archs=(arch,), **fields)
    with context:
        return cuda_backend.ptx_of(module, arch)


@pytest.mark.parametrize(("dtype", "ptx_type", "convert"), [("bfloat16", "bf16", "cvt.rn.bf16x2.f32"),
                                                            ("float16", "f16", "cvt.rn.f16x2.f32")])
def test_16bit_linear_is_mma_m16n8k16_fed_by_ldmatrix_and_16_byte_copies(dtype, ptx_type, convert):
    # a 128x128 tile of 8 warps, 64x32 each: per k slice of 32, 2 x (4 A + 2 B ldmatrix x4, 16 mma);
    # a thread's two columns of C converted together and stored as one 4-byte word
    filecheck(ptx(2048, 256, 1152, dtype), f"""
        CHECK: .extern .shared .align 1024 .b8 __dynamic_shmem__0[];
        CHECK: .entry k(
        CHECK-NOT: .local
        CHECK: cp.async.cg.shared.global [{{{{.*}}}}], [{{{{.*}}}}], 16, {{{{.*}}}};
        CHECK: cp.async.commit_group;
        CHECK: cp.async.wait_group 1;
        CHECK: ldmatrix.sync.aligned.m8n8.x4.shared.b16
        CHECK: ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16
        CHECK: mma.sync.aligned.m16n8k16.row.col.f32.{ptx_type}.{ptx_type}.f32
        CHECK: {convert}
        CHECK: st.global.b32
        """)
    text = ptx(2048, 256, 1152, dtype)  # (144 tiles: enough not to split K)
    assert text.count("mma.sync.aligned") == 32 and text.count("ldmatrix.sync") == 12


def test_tf32_linear_rounds_its_inputs_to_nearest_away_and_is_mma_m16n8k8():
    filecheck(ptx(2048, 256, 1152, "float32"), """
        CHECK: .entry k(
        CHECK-NOT: .local
        CHECK: cp.async.cg.shared.global [{{.*}}], [{{.*}}], 16, {{.*}};
        CHECK: cvt.rna.tf32.f32
        CHECK: mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32
        CHECK: st.global.v2.b32
        """)


@pytest.mark.parametrize(("k", "n", "copy"), [(36, 260, "4"), (33, 64, None), (64, 33, None)])
def test_ragged_16bit_rows_are_copied_4_bytes_at_a_time_or_through_registers(k, n, copy):
    text = ptx(100, k, n, "bfloat16")
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in text
    copies = {line.split(",")[-2].strip() for line in text.splitlines() if "cp.async." in line and "[" in line}
    assert copies == ({copy} if copy else set())


def test_bias_and_epilogue_are_computed_in_float32():
    filecheck(ptx(100, 64, 72, "bfloat16", bias=True, expr=RELU), """
        CHECK: mma.sync.aligned.m16n8k16
        CHECK: ld.global.b16
        CHECK: cvt.f32.bf16
        CHECK: add.rn.f32
        CHECK: max.NaN.f32
        CHECK: cvt.rn.bf16x2.f32
        """)


def test_the_ptx_assembles_without_spills(tmp_path):
    source = tmp_path / "mma.ptx"
    source.write_text(ptx(4096, 4096, 4096, "bfloat16"))
    ptxas = Path(cuda_backend.cuda_toolkit()) / "bin" / "ptxas"
    result = subprocess.run([str(ptxas), "-arch=sm_90", "-v", str(source), "-o", str(tmp_path / "mma.cubin")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "0 bytes spill stores, 0 bytes spill loads" in result.stderr


@pytest.mark.parametrize(("dtype", "k", "archs", "fields", "kernel"), [
    ("bfloat16", 256, ("sm_90",), {}, "mma"),
    ("float16", 256, ("sm_80", "sm_90"), {}, "mma"),
    ("bfloat16", 256, ("sm_90a",), {}, "wgmma"),
    ("bfloat16", 252, ("sm_90a",), {}, "mma"),            # x's rows not a multiple of 16 bytes: no TMA
    ("bfloat16", 256, ("sm_90a", "sm_90"), {}, "mma"),    # every target must have wgmma
    ("float32", 256, ("sm_90",), {"precision": "tf32"}, "tf32"),
    ("float32", 256, ("sm_90",), {}, None),               # float32 stays float32 unless TF32 is asked for
])
def test_the_linear_schedule_picks_the_tensor_core_kernel(dtype, k, archs, fields, kernel):
    module, context = cuda_kernel(cuda_schedule.linear, [(200, k), (k, 64), (200, 64)], dtype, archs=archs, **fields)
    with context:
        function = next(op for op in next(op for op in module.body.operations if op.operation.name == "gpu.module")
                        .regions[0].blocks[0].operations if op.operation.name == "gpu.func")
        chosen = function.operation.attributes[ht.VARIANT] if ht.VARIANT in function.operation.attributes else None
        assert (chosen and ir.StringAttr(chosen).value) == kernel
    assert cuda_schedule.native_16bit(Request("linear", dtype, Target(cuda_archs=archs)))
    assert not cuda_schedule.native_16bit(Request("linear", dtype, Target(cuda_archs=("sm_75", "sm_90"))))
    assert not cuda_schedule.native_16bit(Request("matmul", dtype, Target(cuda_archs=archs)))


@pytest.mark.parametrize(("target", "maps"), [("cpu:host,cuda:sm_90", False), ("cpu:host,cuda:sm_90a", True)])
def test_a_bfloat16_linear_on_cuda_keeps_its_16_bits_and_its_cpu_twin_computes_it(tmp_path, target, maps):
    """End to end: x[batch, 96] @ w + b, relu, in bfloat16 on cuda: the kernel takes the 16-bit
    buffers (wgmma's TMA maps where the target is sm_90a alone), and its cpu twin (what runs
    without a GPU) agrees with float64 within bfloat16's rounding of the result."""
    import hexir_runtime
    import ml_dtypes
    import numpy as np
    from hexir_runtime.cpu import CpuDevice

    import hexir

    from .conftest import manifest

    path = tmp_path / "m.hxb"
    hexir.export(lambda x, w, b: hexir.relu(hexir.linear(x, w, b)), path,
                 hexir.TensorSpec(("batch", 96), "bfloat16"), hexir.TensorSpec((96, 40), "bfloat16"),
                 hexir.TensorSpec((40,), "bfloat16"), placement="*=cuda", target=target)
    (kernel,) = [k for k in manifest(path.read_bytes())["kernels"] if k["device"] == "cuda"]
    assert [a["dtype"] for a in kernel["args"]] == ["bfloat16"] * 4
    assert ("tensor_maps" in kernel) == maps and kernel["cpu_fallback"]
    rng = np.random.default_rng(1)
    x, w, b = (rng.standard_normal(shape).astype(ml_dtypes.bfloat16) for shape in ((37, 96), (96, 40), (40,)))
    got = hexir_runtime.load(path, CpuDevice()).main(x, w, b)
    expected = np.maximum(x.astype(np.float64) @ w.astype(np.float64) + b.astype(np.float64), 0)
    assert got.dtype == ml_dtypes.bfloat16
    assert np.abs(got.astype(np.float64) - expected).max() <= 2.0 ** -8 * np.abs(expected).max()


def test_an_sm_90a_image_beside_the_sm_90_one_carries_the_wgmma_kernel_as_its_own_variant(tmp_path):
    """-target=cuda:sm_90,cuda:sm_90a: the kernel is mma.sync (in every image), and its variant of
    architecture sm_90a, the wgmma kernel with its tensor maps, is in the sm_90a CUBIN alone (the
    runtime runs it where that image is the one loaded: a GPU of compute capability 9.0)."""
    from hexir_runtime import format as hxb

    import hexir

    path = tmp_path / "m.hxb"
    hexir.export(lambda x, w: hexir.linear(x, w), path, hexir.TensorSpec(("batch", 64), "float16"),
                 hexir.TensorSpec((64, 64), "float16"), placement="*=cuda", target="cpu:host,cuda:sm_90,cuda:sm_90a")
    module = hxb.read(path)
    (kernel,) = module.json["kernels"]
    (variant,) = kernel["variants"]
    assert variant["arch"] == "sm_90a" and "below" not in variant and len(variant["tensor_maps"]) == 2
    assert "tensor_maps" not in kernel and set(kernel["images"]) == {"sm_90", "sm_90a", "compute_90"}
    image = {arch: bytes(module.blob(blob)) for arch, blob in kernel["images"].items()}
    assert all(kernel["symbol"].encode() in data for data in image.values())
    assert [arch for arch, data in image.items() if variant["symbol"].encode() in data] == ["sm_90a"]


def test_a_product_of_few_tiles_splits_k_and_its_last_block_adds_the_parts():
    """1000 x 1024 x 33: 16 tiles of 64x64 (MMA_NARROW: N <= 64); split-K (cuda.py's) gives the GPU
    128 blocks, each walking 128 k's, their f32 parts in a module global, the tile's last block
    (an atomic count) adding them."""
    text = ptx(1000, 1024, 33, "bfloat16")
    assert "atom.global.add.u32" in text and ".global .align 16 .b8 k_global0" in text
    module, context = cuda_kernel(linear_mma, [(1000, 1024), (1024, 33), (1000, 33)], "bfloat16")
    with context:
        kernel = next(op for op in next(op for op in module.body.operations if op.operation.name == "gpu.module")
                      .regions[0].blocks[0].operations if op.operation.name == "gpu.func")
        assert ht.record_of(kernel.operation).grid == (1, 16, 8)


def test_tf32_with_w_k_major_copies_w_transposed_16_bytes_at_a_time():
    """w^T [N, K] (a constant TF32 weight, pack-weights) is read as x is: N odd costs nothing,
    every copy of x and w^T is 16 bytes (K a multiple of 4); its B fragments, rows of w^T."""
    module, context = cuda_kernel(linear_mma, [(2048, 260), (1151, 260), (2048, 1151)], "float32",
                                  precision="tf32", w_kmajor=True)
    with context:
        text = cuda_backend.ptx_of(module, "sm_90")
    copies = {line.split(",")[-2].strip() for line in text.splitlines() if "cp.async." in line and "[" in line}
    assert copies == {"16"}
    filecheck(text, """
        CHECK: cvt.rna.tf32.f32
        CHECK: mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32
        """)
