"""Where a device-resident bf16 MLP call spends its time (H200): host time of main() alone,
GPU time of back-to-back calls (CUDA events), a synchronized call, torch.profiler's kernel
times and cProfile of 300 calls. Run there, after `ONLY=r7 bash bench/gpu_build.sh`:

    PYTHONPATH=.gpu/runtime python bench/mlp_profile.py    (reads .gpu/bench/mlp_bf16.tar.gz)
"""

import cProfile
import io
import pstats
import tarfile
import tempfile
import time
from pathlib import Path

import torch
from hexir_runtime import load

SHAPES = {"mlp_1024x2048x2048x2048_bfloat16_cuda": (1024, 2048), "mlp_64x784x512x10_bfloat16_cuda": (64, 784)}
CALLS = 300


def per_call(fn, calls: int = CALLS) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls


def main() -> None:
    folder = Path(tempfile.mkdtemp())
    with tarfile.open(".gpu/bench/mlp_bf16.tar.gz") as archive:
        archive.extractall(folder, filter="data")
    for name, (m, k) in SHAPES.items():
        module = load(folder / "mlp_bf16" / f"{name}.hxb", "cuda")
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")

        def call(module=module, x=x):
            module.main(x, outputs="device")

        def synchronized(call=call):
            call()
            torch.cuda.synchronize()

        per_call(call, 50)
        torch.cuda.synchronize()
        host = per_call(call)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(CALLS):
            call()
        end.record()
        end.synchronize()
        synced = per_call(synchronized)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            per_call(call, 20)
            torch.cuda.synchronize()
        print(f"== {name}: host {host * 1e6:.1f} us/call, back-to-back {start.elapsed_time(end) / CALLS * 1e3:.1f} "
              f"us/call, synchronized {synced * 1e6:.1f} us/call")
        print(profile.key_averages().table(sort_by="cuda_time_total", row_limit=8))
        profiler = cProfile.Profile()
        profiler.enable()
        per_call(call)
        profiler.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(14)
        print(text.getvalue()[-3500:])
        module.close()


if __name__ == "__main__":
    main()
