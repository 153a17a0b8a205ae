"""The Hopper linear (`schedules/cuda_wgmma.py`, sm_90a) as PTX, checked without a GPU: TMA
loads into swizzled stages completing on mbarriers, wgmma m64n128k16 with f32 sums, the two
tensor maps as pointer parameters after the kernel's own, the launch (384 threads, a
persistent 1-D grid over 256x128 tiles) and the manifest's `tensor_maps`; and ptxas's register count (no spills)."""

# IR lines are checked as printed: wrapping them would change what they check.
# ruff: noqa: E501

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from hexir.backend import cuda as cuda_backend
from hexir.dialects import hextir as ht
from hexir.schedules import Request
from hexir.schedules.cuda_wgmma import linear_wgmma, uses_wgmma
from hexir.target import Target

from .conftest import filecheck
from .kernel_build import cuda_kernel


def build(m, k, n, dtype="bfloat16"):
    module, context = cuda_kernel(linear_wgmma, [(m, k), (k, n), (m, n)], dtype, archs=("sm_90a",))
    with context:
        kernel = next(iter(next(op for op in module.body.operations
                                if op.operation.name == "gpu.module").regions[0].blocks[0].operations))
        kernel = kernel.operation
        return cuda_backend.ptx_of(module, "sm_90a"), ht.record_of(kernel), ht.tensor_maps_of(kernel)


@pytest.mark.parametrize(("dtype", "ptx_type"), [("bfloat16", "bf16"), ("float16", "f16")])
def test_wgmma_linear_is_tma_and_mbarriers_feeding_wgmma(dtype, ptx_type):
    ptx, launch, maps = build("batch", 1000, 1032, dtype)
    filecheck(ptx, """
        CHECK: .target sm_90a
        CHECK: .extern .shared .align 1024 .b8 __dynamic_shmem__0[];
        CHECK: .entry k(
        CHECK-NEXT: .param .u64 {{.*}}_param_0,
        CHECK-NEXT: .param .u64 {{.*}}_param_1,
        CHECK-NEXT: .param .u64 {{.*}}_param_2,
        CHECK-NEXT: .param .u64 {{.*}}_param_3,
        CHECK-NEXT: .param .u64 {{.*}}_param_4,
        CHECK-NEXT: .param .u64 {{.*}}_param_5
        CHECK: .maxntid 384, 1, 1
        CHECK-NOT: .local
        CHECK: mbarrier.init.shared.b64
        CHECK: bar.sync 0
        """)
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+40;", ptx)  # the producer's registers to
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+232;", ptx)  # the consumers
    filecheck(ptx, f"""
        CHECK: mbarrier.try_wait.parity
        CHECK: wgmma.fence.sync.aligned
        CHECK: wgmma.mma_async.sync.aligned.m64n128k16.f32.{ptx_type}.{ptx_type}
        CHECK: wgmma.commit_group.sync.aligned
        CHECK: wgmma.wait_group.sync.aligned 1
        CHECK: mbarrier.arrive.shared.b64
        CHECK: wgmma.wait_group.sync.aligned 0
        CHECK: st.global.b32
        """)
    filecheck(ptx, """
        CHECK: mbarrier.try_wait.parity
        CHECK: mbarrier.arrive.expect_tx.shared.b64
        CHECK-COUNT-4: cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [{{.*}}], [%rd{{[0-9]+}}, {{.*}}], [{{.*}}]
        """)
    assert maps == [{"arg": 0, "box": [64, 128]}, {"arg": 1, "box": [64, 64]}]
    assert launch.block == (384, 1, 1) and launch.shared_bytes == 4 * (256 * 64 + 64 * 128) * 2
    assert launch.grid[0] == ("min", ("mul", ("ceildiv", "batch", 256), 9), 132)  # persistent: a block an SM at most


def test_wgmma_needs_sm_90a_alone_and_16_byte_rows():
    def request(dtype="bfloat16", archs=("sm_90a",)):
        return Request("linear", dtype, Target(cuda_archs=archs))
    assert uses_wgmma(request(), 1024, 1024) and uses_wgmma(request("float16"), 8, 8)
    assert not uses_wgmma(request(archs=("sm_90a", "sm_90")), 1024, 1024)
    assert not uses_wgmma(request(archs=("sm_90",)), 1024, 1024)
    assert not uses_wgmma(request("float32"), 1024, 1024)
    assert not uses_wgmma(request(), 1020, 1024) and not uses_wgmma(request(), 1024, 33)


def test_the_wgmma_ptx_assembles_without_spills(tmp_path):
    source = tmp_path / "wgmma.ptx"
    source.write_text(build(4096, 4096, 4096)[0])
    ptxas = Path(cuda_backend.cuda_toolkit()) / "bin" / "ptxas"
    result = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(source), "-o", str(tmp_path / "w.cubin")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "0 bytes spill stores, 0 bytes spill loads" in result.stderr


def test_tf32_wgmma_reads_x_and_w_k_major_and_rounds_x_to_nearest_away():
    """TF32 (w^T [N, K] from pack-weights): both operands' boxes are 32 k's (128 bytes) deep;
    each consumer rounds its rows of x with cvt.rna once the stage landed and hands them to the
    async proxy before 8 wgmma m64n128k8 (2 pieces x 4 k's) with K-major descriptors (no
    transpose immediates; 128-byte swizzling, 8-row groups 1024 bytes apart)."""
    module, context = cuda_kernel(linear_wgmma, [(4096, 4096), (4096, 4096), (4096, 4096)], "float32",
                                  archs=("sm_90a",), precision="tf32", w_kmajor=True)
    with context:
        kernel = next(iter(next(op for op in module.body.operations
                                if op.operation.name == "gpu.module").regions[0].blocks[0].operations)).operation
        ptx, launch, maps = cuda_backend.ptx_of(module, "sm_90a"), ht.record_of(kernel), ht.tensor_maps_of(kernel)
    filecheck(ptx, """
        CHECK: setmaxnreg.inc.sync.aligned.u32 232;
        CHECK: mbarrier.try_wait.parity
        CHECK: cvt.rna.tf32.f32
        CHECK: st.shared.v4.b32
        CHECK: fence.proxy.async.shared::cta;
        CHECK-NEXT: bar.sync
        CHECK: wgmma.fence.sync.aligned
        CHECK: or.b64 {{.*}}, 4611686293305360384;
        CHECK-COUNT-8: wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 {{{.*}}}, %rd{{[0-9]+}}, %rd{{[0-9]+}}, p, 1, 1;
        CHECK: wgmma.commit_group.sync.aligned
        CHECK: wgmma.wait_group.sync.aligned 1
        CHECK: st.global.v2.b32
        """)
    assert maps == [{"arg": 0, "box": [32, 128]}, {"arg": 1, "box": [32, 128]}]  # (k, rows): x and w^T K-major
    assert launch.shared_bytes == 4 * (256 + 128) * 32 * 4


def test_a_small_product_takes_the_128_row_tile():
    """1024 x 2048 x 2048 in 256x128 tiles is 64 blocks for 132 SMs: 128x128 tiles (one m64
    wgmma a consumer) give 128; a product of more than a wave of big tiles keeps them."""
    _, launch, maps = build(1024, 2048, 2048)
    assert launch.grid[0] == 128 and maps[0] == {"arg": 0, "box": [64, 64]}
    assert launch.shared_bytes == 4 * (128 + 128) * 64 * 2
    assert build(4096, 2048, 2048)[1].grid[0] == 132  # 256 tiles of 256x128: two waves, the big tile


@pytest.mark.parametrize(("dtype", "n", "precision", "constant", "added"), [
    ("bfloat16", 64, "highest", False, True), ("float16", 64, "highest", True, True),
    ("bfloat16", 60, "highest", False, False),  # w's rows not a multiple of 16 bytes: no TMA, no wgmma
    ("float32", 64, "highest", True, False), ("float32", 64, "tf32", True, True),
    ("float32", 64, "tf32", False, False),  # TF32 takes wgmma with a constant w alone (stored K-major)
])
def test_an_sm_90_target_gains_sm_90a_where_a_cuda_linear_takes_wgmma(dtype, n, precision, constant, added):
    import numpy as np

    import hexir
    from hexir.driver import Options, run_stage, with_wgmma
    from hexir.target import parse_target

    weight = np.ones((32, n), dtype)
    f = hexir.jit((lambda x: hexir.linear(x, weight)) if constant else (lambda x, w: hexir.linear(x, w)),
                  placement={"hexir.linear": "cuda"})
    module = run_stage(f.trace(*[hexir.TensorSpec((16, 32), dtype)] + ([] if constant else
                                                                        [hexir.TensorSpec((32, n), dtype)])),
                       "mlir-hetero", f.options)
    for target, expected in [("cuda:sm_90", ("sm_90", "sm_90a") if added else ("sm_90",)),
                             ("cuda:sm_80", ("sm_80",)), ("cuda:sm_90a", ("sm_90a",))]:
        options = Options(f.options.placement, parse_target(target), matmul_precision=precision)
        assert with_wgmma(module, options).target.cuda_archs == expected
