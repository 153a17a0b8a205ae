"""Benchmark: the whole call path of an MLP, relu(x @ W1 + b1) @ W2 + b2, hexir against torch eager.

    python bench/mlp.py build bench/mlp_modules   # here: compile the modules (needs hexir), pack them
    PYTHONPATH=runtime python bench/mlp.py run bench/mlp_modules.tar.gz               # GPU machine
    PYTHONPATH=runtime python bench/mlp.py run bench/mlp_modules.tar.gz --device cpu  # runtime vs numpy
    python bench/mlp.py build bench/mlp_bf16 --bf16   # #26: the MLP in bfloat16 on cuda vs torch eager in bfloat16

`run` needs only the runtime, numpy, cuda-python and torch (no hexir, no MLIR); it takes the
directory or the .tar.gz that `build` packs it in. The weights are constants of the modules, and
`run` draws them again for torch (the outputs are compared before timing). Each row is the median of --repeats
calls after a warm-up, hexir and the baseline measured in the same run; speed = baseline time /
hexir time (above 1: hexir is faster).

cuda rows: `module.main(x)` numpy in, numpy out, against torch eager `torch.from_numpy(x).cuda()`
-> the MLP -> `.cpu().numpy()` (TF32 off). The device-resident row gives both a CUDA tensor and
keeps the output on the GPU (`outputs="device"`, taken by `torch.from_dlpack`), each call followed
by a synchronize. The overhead row is a one-kernel module's device-resident call time minus the
kernel's own time: CUDA events on the module's stream around launches queued behind a sleeping
kernel (so that the host's launch is not counted as the kernel's).
cpu rows: the 2x8 -> 16 -> 4 MLP through the runtime (and `@hexir.jit` where hexir is installed),
then 64x784x512x10 and 256x1024x1024x1024 (f32, f64), numpy in and out, each against numpy
evaluating the same expression.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tarfile
import time
from pathlib import Path

import numpy as np

CUDA_ROWS = [  # M, K, H, N, dtype
    (1, 784, 512, 10, "float32"), (64, 784, 512, 10, "float32"), (256, 1024, 1024, 1024, "float32"),
    (1024, 2048, 2048, 2048, "float32"), (1, 784, 512, 10, "float64"), (64, 784, 512, 10, "float64"),
    (256, 1024, 1024, 1024, "float64"), (1024, 2048, 2048, 2048, "float64"),
]
BF16_ROWS = [  # #26: the MLP in bfloat16 on cuda (tensor cores), against torch eager in bfloat16
    (1, 784, 512, 10, "bfloat16"), (64, 784, 512, 10, "bfloat16"), (256, 1024, 1024, 1024, "bfloat16"),
    (1024, 2048, 2048, 2048, "bfloat16"),
]
RESIDENT = {(64, 784, "float32"), (64, 784, "bfloat16"), (1024, 2048, "bfloat16")}
CPU_ROWS = [  # the jit call path's tiny MLP, then the CPU issue's two MLPs
    (2, 8, 16, 4, "float32"), (64, 784, 512, 10, "float32"), (64, 784, 512, 10, "float64"),
    (256, 1024, 1024, 1024, "float32"), (256, 1024, 1024, 1024, "float64"),
]
ONE_KERNEL = (64, 784, 512, "float32")  # relu(x @ W1 + b1): one fused kernel


def name_of(m: int, k: int, h: int, n: int, dtype: str, device: str) -> str:
    return f"mlp_{m}x{k}x{h}x{n}_{dtype}_{device}"


def weights(k: int, h: int, n: int, dtype: str) -> dict[str, np.ndarray]:
    """The MLP's weights, drawn again identically where `run` runs: small integers times a power
    of two near 1/sqrt(fan-in), exact in both dtypes and compressible (the modules travel packed)."""
    rng = np.random.default_rng(0)
    shapes = {"W1": (k, h), "b1": (h,), "W2": (h, n), "b2": (n,)}
    fan_in = {"W1": k, "b1": 1, "W2": h, "b2": 1}
    return {key: (rng.integers(-3, 4, shape) * 2.0 ** -round(np.log2(fan_in[key]) / 2 + 1)).astype(numpy_dtype(dtype))
            for key, shape in shapes.items()}


def numpy_dtype(dtype: str):
    """numpy's dtype of `dtype` (bfloat16: ml_dtypes')."""
    if dtype == "bfloat16":
        import ml_dtypes
        return ml_dtypes.bfloat16
    return np.dtype(dtype)


def to_torch(array: np.ndarray):
    """A torch CPU tensor sharing `array`'s memory (a bfloat16 array through an int16 view)."""
    import torch
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def to_numpy(tensor) -> np.ndarray:
    """A torch CPU tensor as numpy (bfloat16: ml_dtypes')."""
    import torch
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
    return tensor.numpy()


def mlp_of(w: dict[str, np.ndarray]):
    """The MLP with weights `w` as constants, in hexir."""
    import hexir

    def mlp(x):
        return hexir.linear(hexir.relu(hexir.linear(x, w["W1"], w["b1"])), w["W2"], w["b2"])
    return mlp


def build(out: Path, bf16: bool = False) -> None:
    import hexir

    out.mkdir(parents=True, exist_ok=True)
    rows = []
    chosen = [(row, "cuda") for row in BF16_ROWS] if bf16 else \
        [*((row, "cuda") for row in CUDA_ROWS), *((row, "cpu") for row in CPU_ROWS)]
    for (m, k, h, n, dtype), device in chosen:
        w = weights(k, h, n, dtype)
        name = name_of(m, k, h, n, dtype, device)
        placement = {"hexir.linear": device, "hexir.relu": device}
        hexir.export(mlp_of(w), out / f"{name}.hxb", hexir.TensorSpec((m, k), dtype), placement=placement,
                     target="cuda:sm_90,cuda:sm_90a" if bf16 else None)  # (sm_90a: the wgmma image)
        rows.append({"name": name, "shape": [m, k, h, n], "dtype": dtype, "device": device})
    m, k, h, dtype = ONE_KERNEL
    w = weights(k, h, 1, dtype)
    if not bf16:
        hexir.export(lambda x: hexir.relu(hexir.linear(x, w["W1"], w["b1"])), out / "one_kernel.hxb",
                     hexir.TensorSpec((m, k), dtype), placement={"hexir.linear": "cuda", "hexir.relu": "cuda"})
    (out / "modules.json").write_text(json.dumps(rows, indent=1))
    with tarfile.open(f"{out}.tar.gz", "w:gz") as archive:  # what travels to the GPU machine (< 64 MiB)
        archive.add(out, arcname=out.name)
    print(f"built {len(rows) + 1} modules in {out}, packed in {out}.tar.gz")


def median_us(fn, repeats: int, warmup: int = 20) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def row(what: str, hexir_us: float, base_us: float, base: str) -> str:
    return f"| {what} | {hexir_us:.1f} | {base_us:.1f} | {base_us / hexir_us:.2f} | {base} |"


HEADER = "| what | hexir µs | baseline µs | speed (baseline/hexir) | baseline |\n|---|---|---|---|---|"


def run_cuda(directory: Path, repeats: int, profile: bool = False) -> None:
    import torch
    from hexir_runtime import load

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, median of {repeats} calls\n")
    print(HEADER)
    rows = [r for r in json.loads((directory / "modules.json").read_text()) if r["device"] == "cuda"]
    for spec in rows:
        (m, k, _, _), dtype = spec["shape"], spec["dtype"]
        module = load(directory / f"{spec['name']}.hxb", "cuda")
        w = {key: to_torch(value).cuda() for key, value in weights(*spec["shape"][1:], dtype).items()}
        x = np.random.default_rng(1).standard_normal((m, k)).astype(numpy_dtype(dtype))

        def eager(x_gpu, w=w):
            return torch.relu(x_gpu @ w["W1"] + w["b1"]) @ w["W2"] + w["b2"]

        def torch_call(x=x, eager=eager):
            return to_numpy(eager(to_torch(x).cuda()).cpu())

        tolerance = {"float32": 1e-3, "float64": 1e-9, "bfloat16": 3e-2}[dtype]  # bf16: 8 bits, rounded twice
        np.testing.assert_allclose(module.main(x).astype(np.float32), torch_call().astype(np.float32),
                                   rtol=tolerance, atol=tolerance)
        ours, theirs = median_us(lambda x=x, module=module: module.main(x), repeats), median_us(torch_call, repeats)
        print(row(f"{spec['name']} numpy in/out", ours, theirs, "torch eager .cuda() ... .cpu().numpy()"), flush=True)
        if (m, k, dtype) in RESIDENT:
            resident(module, eager, x, repeats, spec["name"])
        module.close()
    if (directory / "one_kernel.hxb").exists():  # (not in a --bf16 build)
        overhead(directory / "one_kernel.hxb", repeats, profile)


def resident(module, eager, x: np.ndarray, repeats: int, name: str) -> None:
    """Torch CUDA tensors in and out, through DLPack, each call synchronized."""
    import torch

    x_gpu = to_torch(x).cuda()

    def ours():
        y = torch.from_dlpack(module.main(x_gpu, outputs="device"))
        torch.cuda.synchronize()
        return y

    def theirs():
        y = eager(x_gpu)
        torch.cuda.synchronize()
        return y

    tolerance = 3e-2 if x_gpu.dtype == torch.bfloat16 else 1e-3
    torch.testing.assert_close(ours().float(), theirs().float(), rtol=tolerance, atol=tolerance)
    print(row(f"{name} device-resident (DLPack in/out)", median_us(ours, repeats),
              median_us(theirs, repeats), "torch eager on CUDA tensors"), flush=True)


def overhead(path: Path, repeats: int, profile: bool = False) -> None:
    """A one-kernel module: its call time minus its kernel's time (CUDA events on its stream)."""
    import torch
    from hexir_runtime import load
    from linear import QUEUED, _queued  # bench/linear.py, beside this script

    module = load(path, "cuda")
    executor = module._executors["main"]
    program = executor.gpus[0]
    m, k, _, dtype = ONE_KERNEL
    x_gpu = torch.from_numpy(np.random.default_rng(2).standard_normal((m, k)).astype(dtype)).cuda()

    def call():
        module.main(x_gpu, outputs="device")
        program.synchronize()

    wall = median_us(call, repeats)
    views = next(iter(executor.plans.values())).views
    command = next(command for command in executor.entry.program if command.op == "call")
    launch = program.launcher(command.kernel, [views[arg] for arg in command.args], {})  # what a call launches
    # the kernel alone: launches queued behind a sleeping kernel, as bench/linear.py times its rows
    kernel_us = _queued(launch, torch.cuda.ExternalStream(int(program.stream))) * 1e6
    export = median_us(lambda: x_gpu.__dlpack__(stream=1), repeats)  # what torch spends lending x
    # what bounds it, in this run: the driver's own launch and wait for this launch (no runtime),
    # and torch eager computing the same relu(x @ W1 + b1) on CUDA tensors, each synchronized
    floor = median_us(lambda: (launch(), program.synchronize()), repeats)
    w = weights(k, ONE_KERNEL[2], 1, dtype)
    w1, b1 = torch.from_numpy(w["W1"]).cuda(), torch.from_numpy(w["b1"]).cuda()
    torch.testing.assert_close(torch.from_dlpack(module.main(x_gpu, outputs="device")),
                               torch.relu(torch.addmm(b1, x_gpu, w1)), rtol=1e-3, atol=1e-3)
    eager = median_us(lambda: (torch.relu(torch.addmm(b1, x_gpu, w1)), torch.cuda.synchronize()), repeats)
    print(f"\none-kernel module {m}x{k}x{ONE_KERNEL[2]} {dtype} relu(linear), device-resident: call "
          f"{wall:.1f} µs, kernel {kernel_us:.1f} µs (CUDA events, {QUEUED} launches queued), runtime overhead "
          f"{wall - kernel_us:.1f} µs\n  for scale, same run: the driver alone (this launch + cuStreamSynchronize "
          f"through cuda-python) {floor:.1f} µs = kernel + {floor - kernel_us:.1f}; hexir's own part "
          f"{wall - floor:.1f} µs; torch eager relu(addmm) + synchronize {eager:.1f} µs; "
          f"torch's x.__dlpack__(stream=1) {export:.1f} µs")
    if profile:  # where the host's time goes in those calls
        import cProfile
        import pstats
        profiler = cProfile.Profile()
        profiler.runcall(lambda: [call() for _ in range(repeats)])
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def run_cpu(directory: Path, repeats: int) -> None:
    from hexir_runtime import load

    print(HEADER)
    for m, k, h, n, dtype in CPU_ROWS:
        name = name_of(m, k, h, n, dtype, "cpu")
        module = load(directory / f"{name}.hxb", "cpu")
        w = weights(k, h, n, dtype)
        x = np.random.default_rng(1).standard_normal((m, k)).astype(dtype)
        out = np.empty((m, n), dtype)
        times = repeats if m * k * h < 2**20 else max(repeats // 50, 20)  # the big ones: ms a call

        def numpy_call(x=x, w=w):
            return np.maximum(x @ w["W1"] + w["b1"], 0) @ w["W2"] + w["b2"]

        np.testing.assert_allclose(module.main(x), numpy_call(), rtol=1e-4, atol=1e-4)
        time.sleep(0.3)  # OpenBLAS's threads, then hexir's, spin a while after their last call
        base = median_us(numpy_call, times)
        time.sleep(0.3)
        ours = median_us(lambda module=module, x=x: module.main(x), times)
        print(row(f"{name} module.main(x)", ours, base, "numpy"), flush=True)
        if (m, k, h, n, dtype) == CPU_ROWS[0]:  # the call path's own rows: out=, and the jit
            ours = median_us(lambda module=module, x=x, out=out: module.main(x, out=out), times)
            print(row(f"{name} module.main(x, out=y)", ours, base, "numpy"))
            try:
                import hexir
            except ImportError:
                continue
            mlp = hexir.jit(mlp_of(w))
            np.testing.assert_allclose(mlp(x), numpy_call(), rtol=1e-5, atol=1e-5)
            print(row(f"{name} @hexir.jit", median_us(lambda mlp=mlp, x=x: mlp(x), times), base, "numpy"), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["build", "run"])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--repeats", type=int, default=500)
    parser.add_argument("--profile", action="store_true", help="cProfile the one-kernel module's calls")
    parser.add_argument("--bf16", action="store_true", help="build: the bfloat16 rows on cuda only (#26)")
    args = parser.parse_args()
    if args.command == "build":
        return build(args.directory, args.bf16)
    from linear import unpacked  # bench/linear.py, beside this script
    if args.device == "cuda":
        run_cuda(unpacked(args.directory), args.repeats, args.profile)
    else:
        run_cpu(unpacked(args.directory), max(args.repeats, 10000))


if __name__ == "__main__":
    main()
