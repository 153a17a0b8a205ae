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
