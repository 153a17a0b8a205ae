"""Benchmark: hexir's linear (matrix product) against the baseline, measured in the same run.

    python bench/linear.py build bench/modules            # here: compile the modules (needs hexir)
    python bench/linear.py run bench/modules --device cpu --max-gflop 20  # hexir cpu vs numpy
    python bench/linear.py run bench/modules --device cuda # hexir cuda kernels vs cuBLAS (torch)
    python bench/linear.py run DIR --device cpu --threads 1 --sizes 1024x1024x1024  # hexir and numpy on 1 thread
    python bench/linear.py run DIR --device cpu --interleave  # variants in turns, each in two runners (twins)
    python bench/linear.py build DIR --const              # the CPU rows with w a constant, packed in DIR.tar.xz
    python bench/linear.py run DIR.tar.xz --device cpu    # there: those against numpy
    python bench/linear.py build DIR --device cpu --sizes 512x512x512,64x784x512  # a selection, in DIR.tar.xz
    python bench/linear.py run DIR.tar.xz --device cpu --interleave --passes 3     # three passes in one run
    python bench/linear.py build DIR --device cpu --sizes 96x128x64x128  # the batched row (B x M x K x N)
    python bench/linear.py build DIR --tensor-cores       # issue #26's rows: bf16/f16 and TF32 (packed in DIR.tar.xz)
    python bench/linear.py run DIR.tar.xz --device cuda   # there: those against torch.matmul in the same dtype

Weights are arguments, so the modules are small and the data is drawn where it runs; except
with `--const`: the CPU issue's products with w a compile-time constant (packed in panels by the
compiler, as a model's weights are; numpy gets the same w as an array already in memory), drawn
as small integers times a power of two so that the modules compress for the trip. Each row
times one kernel launch on buffers already on the device (warm-up first, then the median of
repeated runs): on the GPU with CUDA events on the module's stream around the launch, on the CPU
with the host clock around the call. On the GPU each row also gives the kernels' own time
("queued"): QUEUED launches queued behind a sleeping kernel, then timed by CUDA events as the
GPU runs them back to back, so that the host's launch cost (some 5 µs through cuda-python, 20-30
through torch) is left out; for small products it is most of the first time. The baseline is
timed the same way: numpy's `matmul` into a preallocated output, or `torch.matmul(out=...)`
between CUDA events (TF32 off: the same fp32 FMAs as hexir). Ratio = baseline time / hexir time
(above 1: hexir is faster). On the cpu the last four columns time the user's call: `m.main(x, w)`
(numpy arrays in, a new array out) against numpy's `x @ w`, and the call again on copies of x and w
that start at a multiple of 64 bytes (`call@64B`; numpy's big arrays start 16 bytes into a page).
The batched rows (`BATCHED`, cpu) time `a @ b` of rank-3 operands against numpy's batched matmul.
The `sym` rows run a module compiled
for a symbolic row count (`batch x K`) at the same size as the static row above them: their ratio
to the static kernel is the cost of not knowing the batch when compiling. A cuda row whose output differs from cuBLAS's
(relative to its largest element: 1e-4 in float32, 1e-10 in float64) is printed WRONG.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

SIZES = [(128, 128, 128), (512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096),
         (8192, 8192, 8192), (256, 256, 256), (1, 4096, 4096), (16, 4096, 4096), (4096, 1024, 33), (64, 784, 512)]
#: Rows also compiled with a symbolic batch (issue: a ?xK kernel as fast as the static one).
SYMBOLIC = [(64, 1024, 1024), (256, 1024, 1024), (4096, 1024, 1024)]
#: Rows also compiled as linear + bias + relu (one kernel: the epilogue should cost nothing).
FUSED = [(4096, 4096, 4096)]
#: cpu: batched products `a @ b` of rank-3 activations (batch, M, K, N; issue #29's row: attention's
#: q @ kᵀ at seq 128, d 64), timed against numpy's batched matmul; `--sizes` names them BxMxKxN.
BATCHED = [(96, 128, 64, 128)]


def product(row: dict) -> str:
    """A row's product as `--sizes` names it: MxKxN, or BxMxKxN (batched)."""
    return ("{batch}x" if row.get("batch") else "").format(**row) + f"{row['m']}x{row['k']}x{row['n']}"


def operands(row: dict, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """A row's x and w, drawn from `rng`, and its output's shape."""
    m, k, n, dtype, batch = row["m"], row["k"], row["n"], row["dtype"], row.get("batch")
    lead = (batch,) if batch else ()
    x = rng.standard_normal((*lead, m, k)).astype(dtype)
    w = const_weight(k, n, dtype) if row.get("const") else rng.standard_normal((*lead, k, n)).astype(dtype)
    return x, w, (*lead, m, n)


#: `build --tensor-cores`: issue #26's rows, (M, K, N, dtype, precision, target, variant): bf16 and f16
#: at 4096^3 and 8192^3 with wgmma (sm_90a) and with mma.sync (sm_90), the same product built for
#: sm_90 + sm_90a (the wgmma variant of the sm_90a image) beside the sm_90a-only one, the ragged
#: products (K or N odd: no TMA, mma.sync), TF32 at 4096^3, the bf16 MLP's 1024 x 2048 x 2048; a
#: variant other than "" is the product built with TC_VARIANTS' schedule constants. The modules of
#: one product (and torch) are timed in turns. Compared with torch.matmul in the same dtype (TF32:
#: with allow_tf32) and with a float64 product: relative to its largest element, within TOLERANCE * sqrt(K).
TENSOR_CORES = [(m, k, n, dtype, "highest", target, "") for m, k, n in ((4096, 4096, 4096), (8192, 8192, 8192))
                for dtype in ("bfloat16", "float16") for target in ("cuda:sm_90a", "cuda:sm_90")] + \
               [(4096, 4096, 4096, "bfloat16", "highest", "cuda:sm_90,cuda:sm_90a", ""),  # wgmma: the sm_90a image's
                (2048, 2048, 2048, "bfloat16", "highest", "cuda:sm_90a", ""),
                (2048, 2048, 2048, "bfloat16", "highest", "cuda:sm_90a", "wg256"),
                (1024, 2048, 2048, "bfloat16", "highest", "cuda:sm_90a", ""),
                (1024, 2048, 2048, "bfloat16", "highest", "cuda:sm_90,cuda:sm_90a", ""),
                (1000, 1000, 1032, "bfloat16", "highest", "cuda:sm_90a", ""),
                (4095, 4097, 4000, "bfloat16", "highest", "cuda:sm_90a", ""),
                (1000, 1024, 33, "bfloat16", "highest", "cuda:sm_90a", ""),
                (1000, 1024, 33, "bfloat16", "highest", "cuda:sm_90a", "mma128"),
                (4096, 4096, 4096, "float32", "tf32", "cuda:sm_90a", ""),  # w at run time: mma.sync
                (4096, 4096, 4096, "float32", "tf32", "cuda:sm_90a", "wt"),
                (4096, 4096, 4096, "float32", "tf32", "cuda:sm_90a", "wttrunc"),
                (4096, 4096, 4096, "float32", "tf32", "cuda:sm_90", "wt"),
                (4096, 4096, 4096, "float32", "tf32", "cuda:sm_90,cuda:sm_90a", "wt"),
                (1000, 1032, 1032, "float32", "tf32", "cuda:sm_90a", "wt"),  # ragged M, N, K: TMA's zeros, guards
                (1000, 1032, 1032, "float32", "tf32", "cuda:sm_90", "wt"),
                (8192, 8192, 8192, "float32", "tf32", "cuda:sm_90a", "wt")]
#: The variants' schedule constants, [(module, {name: value})]: "wg256" every product on 256x128
#: wgmma tiles, "mma128" every mma.sync product on 128x128; "wt": TF32 with w K-major as
#: pack-weights gives a constant's (here an argument: the run passes w^T, so square K x N only),
#: x rounded to TF32 by the consumers in shared memory, or not at all ("wttrunc": the tensor cores
#: truncate).
_KMAJOR = ("hexir.passes.lower_to_tir", {"_request": "kmajor"})
TC_VARIANTS = {"wg256": [("cuda_wgmma", {"WG_SMALL_TILE": (256, 128, 64)})],
               "mma128": [("cuda_mma", {"MMA_NARROW": (128, 128, 32, 2, 4)})],
               "wt": [_KMAJOR],
               "wttrunc": [_KMAJOR, ("cuda_wgmma", {"TF32_ROUND": False})]}
TOLERANCE = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -11}


def build_tensor_cores(out: Path) -> None:
    import hexir

    rows = []
    for m, k, n, dtype, precision, target, variant in TENSOR_CORES:
        name = f"linear_{m}x{k}x{n}_{dtype}_{precision}_{target.replace('cuda:', '').replace(',', '_')}{variant}"
        options = {"matmul_precision": precision} if precision != "highest" else {}
        with contextlib.ExitStack() as changes:
            for module, constants in TC_VARIANTS.get(variant, []):
                if constants.get("_request") == "kmajor":
                    constants = {"_request": _kmajor_request()}
                changes.enter_context(_schedule(module, constants))
            hexir.export(lambda x, w: hexir.linear(x, w), out / f"{name}.hxb", hexir.TensorSpec((m, k), dtype),
                         hexir.TensorSpec((k, n), dtype), placement={"hexir.linear": "cuda"},
                         target=f"cpu:host,{target}", **options)
        rows.append({"name": name, "m": m, "k": k, "n": n, "dtype": dtype, "device": "cuda", "precision": precision,
                     "target": target, "variant": variant, "tensor_cores": True})
    (out / "modules.json").write_text(json.dumps(rows, indent=1))
    print(f"built {len(rows)} modules in {out}")
    _pack(out)


def _kmajor_request():
    """lower-to-tir's `_request`, the linear's w K-major (as pack-weights marks a TF32 constant's)."""
    from dataclasses import replace

    from hexir.passes import lower_to_tir

    original = lower_to_tir._request

    def request(*args):
        made, record = original(*args)
        return replace(made, w_kmajor=made.op == "linear"), record
    return request


def run_tensor_cores(modules: Path, rows: list[dict], repeats: int) -> None:
    """Each product's modules and torch.matmul(out=) in the same dtype, on torch's tensors (the
    same x and w for all), timed in turns: 5 rounds, each `repeats` launches back to back
    between CUDA events; the median round of each."""
    import torch
    from hexir_runtime.cuda import CudaDevice, DeviceBuffer
    from hexir_runtime.format import numpy_dtype, read

    place = CudaDevice()
    print(f"device: {torch.cuda.get_device_name(0)}; baseline: cuBLAS (torch {torch.__version__}) in the same "
          f"dtype; {repeats} launches back to back, median of 5 rounds in turns")
    print(f"{'M x K x N':>20} {'dtype':>9} {'target':>13} {'hexir ms':>9} {'torch ms':>9} {'hexir TF/s':>10} "
          f"{'torch TF/s':>10} {'ratio':>6} {'rel err':>8} {'bound':>8} {'torch err':>9}")
    products: dict[tuple, list[dict]] = {}
    for row in rows:
        products.setdefault((row["m"], row["k"], row["n"], row["dtype"], row["precision"]), []).append(row)
    for (m, k, n, dtype, precision), group in products.items():
        torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
        kind = getattr(torch, dtype)
        g = torch.Generator(device="cuda").manual_seed(0)
        x, w = (torch.randn(shape, device="cuda", generator=g).to(kind) for shape in ((m, k), (k, n)))
        theirs = torch.empty((m, n), dtype=kind, device="cuda")
        runs = []  # (row, program, launch, out, stream)
        for row in group:
            out = torch.empty((m, n), dtype=kind, device="cuda")
            program = place.load(read(modules / f"{row['name']}.hxb"))
            given = w.t().contiguous() if row.get("variant", "").startswith("wt") else w  # (K-major)
            buffers = [DeviceBuffer(t.data_ptr(), tuple(t.shape), numpy_dtype(dtype)) for t in (x, given, out)]
            row["keep"] = given
            runs.append((row, program, program.launcher(0, buffers, {}), out,
                         torch.cuda.ExternalStream(int(program.stream))))

        def timed(fn, on) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(on)
            for _ in range(repeats):
                fn()
            end.record(on)
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / repeats
        def base_fn(x=x, w=w, theirs=theirs) -> None:
            torch.matmul(x, w, out=theirs)
        torch.cuda.synchronize()
        for _, _, launch, _, _ in runs:
            launch()
        base_fn()
        torch.cuda.synchronize()
        times: list[list[float]] = [[] for _ in range(len(runs) + 1)]
        for _ in range(5):
            for i, (_, _, launch, _, stream) in enumerate(runs):
                times[i].append(timed(launch, stream))
            times[-1].append(timed(base_fn, torch.cuda.current_stream()))
        torch.cuda.synchronize()
        reference = x.double() @ w.double()
        scale = float(reference.abs().max())
        torch_error = float((theirs.double() - reference).abs().max()) / scale
        base = statistics.median(times[-1])
        bound = TOLERANCE[dtype] * math.sqrt(k)
        flops = 2.0 * m * k * n
        for (row, program, _, out, _), mine in zip(runs, times, strict=False):
            ours = statistics.median(mine)
            error = float((out.double() - reference).abs().max()) / scale
            target = row["target"].replace("cuda:", "") + (f" {row['variant']}" if row.get("variant") else "")
            print(f"{m:>6} x{k:>5} x{n:>5} {dtype if precision == 'highest' else 'tf32':>9} "
                  f"{target:>13} {ours * 1e3:9.3f} {base * 1e3:9.3f} {flops / ours / 1e12:10.1f} "
                  f"{flops / base / 1e12:10.1f} {base / ours:6.3f} {error:8.1e} {bound:8.1e} {torch_error:9.1e}"
                  f"{'' if error <= bound else '  WRONG'}", flush=True)
            program.close()
        del reference, runs
        for row in group:
            row.pop("keep", None)
    torch.backends.cuda.matmul.allow_tf32 = False


#: `build --const`: the cpu products compiled with w a constant (rows "w const").
CONST = [(256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048), (1, 4096, 4096),
         (16, 4096, 4096), (4096, 1024, 33)]


def const_weight(k: int, n: int, dtype: str) -> np.ndarray:
    """A `--const` module's w, drawn again identically where it runs: integers -3..3 times a
    power of two near 1/sqrt(k) (exact in both dtypes; compressible)."""
    return (np.random.default_rng(7).integers(-3, 4, (k, n)) * 2.0 ** -round(np.log2(k) / 2 + 1)).astype(dtype)


def build(out: Path, const: bool = False, devices: tuple[str, ...] = ("cpu", "cuda"),
          sizes: list[str] | None = None, variants: list[str] | None = None, symbolic_too: bool = False) -> None:
    import hexir

    out.mkdir(parents=True, exist_ok=True)
    if const:
        return build_const(out)

    def linear(x, w):
        return hexir.linear(x, w)

    def fused(x, w, b):
        return hexir.relu(hexir.linear(x, w, b))

    rows = []
    for m, k, n in dict.fromkeys(SIZES + SYMBOLIC):
        if sizes and f"{m}x{k}x{n}" not in sizes:
            continue
        for device in devices:
            for dtype in ("float32", "float64"):
                for symbolic in ((False, True) if (m, k, n) in SYMBOLIC or symbolic_too else (False,)):
                    name = f"linear_{m}x{k}x{n}_{dtype}_{device}{'_sym' if symbolic else ''}"
                    hexir.export(linear, out / f"{name}.hxb", hexir.TensorSpec(("batch" if symbolic else m, k), dtype),
                                 hexir.TensorSpec((k, n), dtype), placement={"hexir.linear": device})
                    rows.append({"name": name, "m": m, "k": k, "n": n, "dtype": dtype, "device": device,
                                 "symbolic": symbolic})
                    if variants and device == "cpu":  # the schedule's variants, in turns
                        rows[-1]["variant"] = "sym" if symbolic else "chosen"
                        # (a symbolic batch never packs w once per call: only x's variants differ for it)
                        for variant in [v for v in variants if (not symbolic or "_x" in v and "packed" not in v)
                                        and not (symbolic and v in VARIANT_ROWS) and m <= VARIANT_ROWS.get(v, m)]:
                            with _schedule(VARIANTS[variant]):
                                hexir.export(linear, out / f"{name}_{variant}.hxb",
                                             hexir.TensorSpec(("batch" if symbolic else m, k), dtype),
                                             hexir.TensorSpec((k, n), dtype), placement={"hexir.linear": device})
                            rows.append({**rows[-1], "name": f"{name}_{variant}",
                                         "variant": f"sym {variant}" if symbolic else variant})
                if (m, k, n) in FUSED and device == "cuda":
                    name = f"linear_{m}x{k}x{n}_{dtype}_{device}_fused"
                    hexir.export(fused, out / f"{name}.hxb", hexir.TensorSpec((m, k), dtype),
                                 hexir.TensorSpec((k, n), dtype), hexir.TensorSpec((n,), dtype),
                                 placement={"hexir.linear": device, "hexir.relu": device})
                    rows.append({"name": name, "m": m, "k": k, "n": n, "dtype": dtype, "device": device,
                                 "symbolic": False, "variant": "+bias+relu", "fused": True})
    for batch, m, k, n in BATCHED if "cpu" in devices else ():
        if sizes and f"{batch}x{m}x{k}x{n}" not in sizes:
            continue
        for dtype in ("float32", "float64"):
            name = f"matmul_{batch}x{m}x{k}x{n}_{dtype}_cpu"
            hexir.export(lambda a, b: a @ b, out / f"{name}.hxb", hexir.TensorSpec((batch, m, k), dtype),
                         hexir.TensorSpec((batch, k, n), dtype), placement="*=cpu")
            rows.append({"name": name, "batch": batch, "m": m, "k": k, "n": n, "dtype": dtype, "device": "cpu",
                         "symbolic": False})
    (out / "modules.json").write_text(json.dumps(rows, indent=1))
    print(f"built {len(rows)} modules in {out}")
    if sizes or variants or devices != ("cpu", "cuda"):  # a selection: packed to travel
        _pack(out)


#: `build --variants`: the cpu schedule's choices for a w known at run time, each as the constants
#: of hexir/schedules/cpu.py it sets for its build ("chosen", the committed rule, is always built).
VARIANTS = {
    "pertile": {"packs_w": lambda *_: False},  # each tile packs its own block of w (before #29)
    "packed": {"PACK_ROWS": {"float32": 17, "float64": 17}},  # w packed once per call (static, > 16 rows)
    "pertile_x": {"packs_w": lambda *_: False, "PACK_X": {"float32": True, "float64": True}},  # + x per tile
    "packed_x": {"PACK_ROWS": {"float32": 17, "float64": 17}, "PACK_X": {"float32": True, "float64": True}},
    "packed_kc128": {"PACK_ROWS": {"float32": 17, "float64": 17}, "KC": 128},  # w's KC x NR slice: half the L1
    "stream64": {"STREAM_ROWS": 64},  # up to 64 rows stream w's rows (its rows 4 KiB apart at 64x784x512 f64)
    # no 12-row tiles: 24 rows, each tile packing its block of w (w read in place by 12-row tiles is
    # the caller's array, 16 bytes into a page: every vector of it spans two cache lines)
    "mc24": {"MC_CHOICES": (192, 96, 48, 24)},
}
#: The variants that only differ from the rule for products of at most so many rows.
VARIANT_ROWS = {"stream64": 64}


@contextlib.contextmanager
def _schedule(module: str, changes: dict | None = None):
    """The constants of hexir/schedules/`module`.py (default cpu) set to `changes` while a variant
    builds (the compile cache is off then: its key cannot see them)."""
    import importlib

    if changes is None:
        module, changes = "cpu", module
    cpu_schedule = importlib.import_module(module if "." in module else f"hexir.schedules.{module}")
    saved = {name: getattr(cpu_schedule, name) for name in changes}
    cache, os.environ["HEXIR_CACHE_DIR"] = os.environ.get("HEXIR_CACHE_DIR"), ""
    try:
        for name, value in changes.items():
            setattr(cpu_schedule, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(cpu_schedule, name, value)
        if cache is None:
            del os.environ["HEXIR_CACHE_DIR"]
        else:
            os.environ["HEXIR_CACHE_DIR"] = cache


def build_const(out: Path) -> None:
    import hexir

    rows = []
    for m, k, n in CONST:
        for dtype in ("float32", "float64"):
            name, w = f"linear_{m}x{k}x{n}_{dtype}_cpu_const", const_weight(k, n, dtype)
            hexir.export(_times(w), out / f"{name}.hxb", hexir.TensorSpec((m, k), dtype))
            rows.append({"name": name, "m": m, "k": k, "n": n, "dtype": dtype, "device": "cpu", "symbolic": False,
                         "variant": "w const", "const": True})
    (out / "modules.json").write_text(json.dumps(rows, indent=1))
    print(f"built {len(rows)} modules in {out}")
    _pack(out)


def _pack(out: Path) -> None:
    import tarfile

    with tarfile.open(f"{out}.tar.xz", "w:xz") as archive:  # what travels (the weights: < 64 MiB packed)
        archive.add(out, arcname=out.name)
    print(f"packed in {out}.tar.xz")


def _times(w: np.ndarray):
    """x -> x @ w, w a constant of the traced function (not a parameter: a default would be an input)."""
    import hexir

    return lambda x: hexir.linear(x, w)


def unpacked(path: Path) -> Path:
    """The module directory `path`, or the one packed in `path` (a .tar.gz or .tar.xz), extracted beside it."""
    import tarfile

    if path.is_dir():
        return path
    with tarfile.open(path) as archive:
        name = archive.getnames()[0].split("/")[0]
        archive.extractall(path.parent, filter="data")
    return path.parent / name


QUEUED = 20  # launches per queued measurement
QUEUED_FLOPS = 2e10  # products measured queued too: above, a launch's cost is lost in the kernel's


def _queued(launch, stream) -> float:
    """Seconds per launch on the GPU alone: QUEUED launches queued on `stream` (a torch stream)
    behind a sleeping kernel (long enough for the host to queue them all), timed by events."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    with torch.cuda.stream(stream):
        for _ in range(5):
            torch.cuda._sleep(4_000_000)  # ~2 ms at the H200's clock
            start.record(stream)
            for _ in range(QUEUED):
                launch()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / QUEUED)
    return statistics.median(times)


def _median_seconds(fn, repeats: int, budget: float = 2.0) -> float:
    fn()  # warm-up: module load, first-touch, JIT
    times = []
    deadline = time.perf_counter() + budget
    while len(times) < repeats and (len(times) < 3 or time.perf_counter() < deadline):
        times.append(fn())
    return statistics.median(times)


#: The clock of host timings: wall time, or (`--cpu-time`, with `--threads 1`) the process's CPU
#: time, which a machine shared with other work inflates far less than wall time.
CLOCK = time.perf_counter


def _host_timed(fn):
    def timed() -> float:
        start = CLOCK()
        fn()
        return CLOCK() - start
    return timed


def _kernel_runner(path: Path, device: str, arrays: list[np.ndarray], m: int, threads: int | None = None,
                   aligned: bool = False):
    """A function timing one launch of the module's one kernel on buffers already on `device`
    (a module's constant, its w as the compiler stored it, in place of arrays[1]); on the cpu,
    the launches of its program in turn (a w known at run time is packed by a kernel of its
    own, then read by the linear's), on buffers where np.empty puts them (16 bytes into a page,
    for big ones) or, `aligned`, at multiples of 64 bytes (`_aligned_cpu`)."""
    from hexir_runtime.format import read

    hxb = read(path)
    kernel = hxb.manifest.kernels[0]
    n = arrays[1].shape[1]
    if hxb.manifest.constants:
        constant = hxb.manifest.constants[0]
        arrays = [arrays[0], np.frombuffer(hxb.blob(constant.blob), constant.type.dtype).reshape(constant.type.shape)]
    if device == "cuda":
        from hexir_runtime.cuda import CudaDevice, check
        place = CudaDevice()
    else:
        place = _aligned_cpu(threads) if aligned else _cpu(threads)
    program = place.load(hxb)
    sizes = {symbol: m for symbol in kernel.integers if isinstance(symbol, str)}
    if device == "cpu":
        return _program_runner(hxb, place, program, arrays, sizes)
    shapes = [a.shape for a in arrays] + [(m, n)]  # the inputs (x, w[, bias]), then out
    buffers = [place.alloc(shape, arrays[0].dtype.name) for shape in shapes]
    for buffer, array in zip(buffers[:-1], arrays, strict=True):
        place.copy_in(buffer, array)
    driver = place.driver
    start, end = (check(driver.cuEventCreate(0), "cuEventCreate") for _ in range(2))

    place.make_current()
    launch = program.launcher(0, buffers, sizes)  # built once, as a call's plan does: only the launch is timed

    def timed(queued: bool = False) -> float:
        if queued:
            import torch
            return _queued(launch, torch.cuda.ExternalStream(int(program.stream)))
        check(driver.cuEventRecord(start, program.stream), "cuEventRecord")
        launch()
        check(driver.cuEventRecord(end, program.stream), "cuEventRecord")
        check(driver.cuEventSynchronize(end), "cuEventSynchronize")
        return check(driver.cuEventElapsedTime(start, end), "cuEventElapsedTime") / 1e3
    timed.result = lambda: place.copy_out(buffers[-1])  # what the launches computed
    return timed


def _cpu(threads: int | None):
    from hexir_runtime.cpu import CpuDevice
    return CpuDevice(threads=threads)


def _aligned_cpu(threads: int | None):
    """A CpuDevice whose buffers start at a multiple of 64 bytes (np.empty's big arrays start 16
    bytes into a page: every 64-byte vector of theirs spans two cache lines), each at another
    offset into its page (64 * (1 + 7i mod 63) for the i-th: not all alike, which would alias
    their elements in the 4 KiB that loads and stores are first compared on)."""
    from hexir_runtime.cpu import CpuDevice

    class Aligned(CpuDevice):
        made = 0

        def alloc(self, shape, dtype):
            size = int(np.prod(shape)) * np.dtype(dtype).itemsize
            raw = np.empty(size + 8192, np.uint8)
            start = -raw.ctypes.data % 4096 + 64 * (1 + 7 * self.made % 63)
            self.made += 1
            return raw[start:start + size].view(dtype).reshape(shape)
    return Aligned(threads=threads)


def _program_runner(hxb, place, program, arrays: list[np.ndarray], sizes: dict[str, int]):
    """`_kernel_runner` on the cpu: the entry's kernels launched in program order on buffers of
    their own, the inputs and constants copied in once."""
    entry, constants = hxb.manifest.entries[0], hxb.manifest.constants
    buffers = [place.alloc(buffer.type.concrete(sizes), buffer.type.dtype) for buffer in entry.buffers]
    launches = []
    for command in entry.program:
        if command.op == "input":
            place.copy_in(buffers[command.dst], arrays[command.index])
        elif command.op == "constant":
            constant = constants[command.constant]
            place.copy_in(buffers[command.dst], np.frombuffer(hxb.blob(constant.blob), constant.type.dtype)
                          .reshape(constant.type.shape))
        elif command.op == "call":
            go = program.launcher(command.kernel, [buffers[arg] for arg in command.args], sizes)
            launches += [go] if go is not None else []
        elif command.op == "return":
            result = buffers[command.srcs[0]]

    def launch() -> None:
        for go in launches:
            go()
    timed = _host_timed(launch)
    timed.result = lambda: result.copy()
    timed.buffers = buffers  # alive as long as the launches, which hold their addresses
    return timed


def _call_runner(path: Path, arrays: list[np.ndarray], threads: int | None = None):
    """A function timing the user's call `m.main(x, w)` (`m.main(x)`: w a constant) on the cpu
    (numpy in, a new array out)."""
    from hexir_runtime import load
    from hexir_runtime.cpu import CpuDevice

    module = load(path, CpuDevice(threads=threads))
    arrays = arrays[:len(module.signature("main").inputs)]
    return _host_timed(lambda: module.main(*arrays))


def run(modules: Path, device: str, repeats: int, max_gflop: float, threads: int | None = None,
        sizes: list[str] | None = None, interleave: bool = False, aligned: bool = False) -> None:
    rows = [r for r in json.loads((modules / "modules.json").read_text())
            if r["device"] == device and 2 * r.get("batch", 1) * r["m"] * r["k"] * r["n"] <= max_gflop * 1e9
            and (not sizes or product(r) in sizes)]
    if rows and all(r.get("tensor_cores") for r in rows):
        return run_tensor_cores(modules, rows, repeats)
    if threads and device == "cpu":  # numpy on as many threads (its BLAS's), for a scaling table
        try:
            from threadpoolctl import threadpool_limits
            threadpool_limits(threads, "blas")
        except ImportError:
            print("(no threadpoolctl: numpy's threads are as OPENBLAS_NUM_THREADS leaves them)")
    rng = np.random.default_rng(0)
    if device == "cuda":
        import torch
        baseline_name = f"cuBLAS (torch {torch.__version__})"
        where = torch.cuda.get_device_name(0)
        torch.backends.cuda.matmul.allow_tf32 = False  # same arithmetic as hexir: plain fp32 FMAs
    else:
        baseline_name = f"numpy {np.__version__}"
        where = f"cpu ({os.cpu_count()} cores)"
        try:
            from threadpoolctl import threadpool_info
            baseline_name += " on " + ", ".join(f"{i.get('internal_api')} {i.get('version')} "
                                                f"({i.get('architecture')}, {i.get('num_threads')} threads)"
                                                for i in threadpool_info() if i.get("user_api") == "blas")
        except ImportError:
            pass
    if threads:
        where += f", hexir and numpy on {threads} threads"
    print(f"device: {where}; baseline: {baseline_name}; median of up to {repeats} runs")
    queued = f" {'hexir q ms':>10} {'base q ms':>10} {'q ratio':>7}" if device == "cuda" else ""
    queued += f" {'twins':>7}" if interleave else ""
    queued += f" {'call ms':>9} {'x@w ms':>9} {'call ratio':>10} {'call@64B ms':>11}" if device == "cpu" else ""
    print(f"{'M x K x N':>22} {'dtype':>8} {'hexir ms':>10} {'base ms':>10} {'hexir GF/s':>11} {'base GF/s':>10} "
          f"{'ratio':>7}{queued}")
    if interleave:
        return _interleaved(rows, modules, repeats, threads, aligned)
    for row in rows:
        m, k, n, dtype = row["m"], row["k"], row["n"], row["dtype"]
        x, w, shape = operands(row, rng)
        inputs = [x, w, rng.standard_normal(n).astype(dtype)] if row.get("fused") else [x, w]
        runner = _kernel_runner(modules / f"{row['name']}.hxb", device, inputs, m, threads)
        if device == "cpu":  # OpenBLAS's threads spin for a while after each call (~0.1 s): the last
            time.sleep(0.3)  # row's numpy would otherwise take cores from this row's hexir
        hexir_time = _median_seconds(runner, repeats)
        if device == "cpu":  # and hexir's pool spins ~0.5 ms after its last chunk
            time.sleep(0.1)
        if device == "cuda":
            tx, tw = torch.from_numpy(x).cuda(), torch.from_numpy(w).cuda()
            tout = torch.empty((m, n), dtype=tx.dtype, device="cuda")
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

            def baseline(tx=tx, tw=tw, tout=tout, start=start, end=end) -> float:
                start.record()
                torch.matmul(tx, tw, out=tout)
                end.record()
                end.synchronize()
                return start.elapsed_time(end) / 1e3
        else:
            out = np.empty(shape, dtype)
            baseline = _host_timed(lambda x=x, w=w, out=out: np.matmul(x, w, out=out))
        base_time = _median_seconds(baseline, repeats)
        if device == "cpu":  # ours against numpy's, relative to the largest
            error = float(np.abs(runner.result() - out).max() / max(np.abs(out).max(), 1e-30))
            if not error < (1e-4 if dtype == "float32" else 1e-10):
                print(f"{m} x {k} x {n} {dtype} {row.get('variant', '')}: WRONG, relative error {error:.2e}")
        flops = 2.0 * row.get("batch", 1) * m * k * n
        if device == "cuda" and not row.get("fused"):  # ours against cuBLAS's, relative to the largest
            ours, theirs = runner.result(), tout.cpu().numpy()
            error = float(np.abs(ours - theirs).max() / max(np.abs(theirs).max(), 1e-30))
            if not error < (1e-4 if dtype == "float32" else 1e-10):
                print(f"{m} x {k} x {n} {dtype} {row.get('variant', '')}: WRONG, relative error {error:.2e}")
        label = (f"{row['batch']} x " if row.get("batch") else "") + f"{m} x {k} x {n}" \
            + (" sym" if row.get("symbolic") else "") + (f" {row['variant']}" if "variant" in row else "")
        queued = _calls(modules / f"{row['name']}.hxb", inputs, repeats, threads) if device == "cpu" else ""
        _record(label, dtype, hexir_time, base_time)
        if device == "cuda" and flops <= QUEUED_FLOPS:  # the kernels' own times (beyond: as the first)
            ours, theirs = runner(queued=True), _queued(lambda tx=tx, tw=tw, tout=tout: torch.matmul(tx, tw, out=tout),
                                                        torch.cuda.current_stream())
            queued = f" {ours * 1e3:10.4f} {theirs * 1e3:10.4f} {theirs / ours:7.3f}" + queued
        print(f"{label:>22} {dtype:>8} {hexir_time * 1e3:10.3f} {base_time * 1e3:10.3f} "
              f"{flops / hexir_time / 1e9:11.1f} {flops / base_time / 1e9:10.1f} {base_time / hexir_time:7.3f}"
              f"{queued}", flush=True)


def _calls(path: Path, inputs: list[np.ndarray], repeats: int, threads: int | None) -> str:
    """The user's call against numpy's: `m.main(x, w)` and `x @ w` (numpy arrays in, a new array
    out), numpy first (its threads spin after a call), as the row's last columns; then the call
    on copies of the inputs that start at a multiple of 64 bytes (`call@64B`: numpy puts a big
    array 16 bytes into a page, so each 64-byte vector a kernel reads of it in place spans two
    cache lines; the kernel columns run on the module's own buffers, which are aligned)."""
    from hexir_runtime.device import aligned_empty

    time.sleep(0.3)
    numpy = _median_seconds(_host_timed(lambda: inputs[0] @ inputs[1]), repeats)
    time.sleep(0.3)
    ours = _median_seconds(_call_runner(path, inputs, threads), repeats)
    aligned = [aligned_empty(array.shape, array.dtype) for array in inputs]
    for copy, array in zip(aligned, inputs, strict=True):
        copy[...] = array
    at_64 = _median_seconds(_call_runner(path, aligned, threads), repeats)
    CALLS.append((ours, numpy, at_64))
    return f" {ours * 1e3:9.3f} {numpy * 1e3:9.3f} {numpy / ours:10.3f} {at_64 * 1e3:11.3f}"


def turns(modules: Path, repeats: int, threads: int | None, sizes: list[str] | None) -> None:
    """cpu (`--turns`): per module, its kernel (on the module's buffers, as the table's kernel
    column), the user's call on numpy's arrays and the call on 64-byte aligned copies, timed in
    turns (kernel, call, call@64B, kernel, ...: the host's drift falls on all three alike), medians."""
    from hexir_runtime.device import aligned_empty

    print(f"{'product':>22} {'dtype':>8} {'kernel ms':>10} {'call ms':>9} {'call@64B ms':>11} {'call/kernel':>11} "
          f"{'call@64B/kernel':>15}  (in turns, median of {repeats})")
    for row in json.loads((modules / "modules.json").read_text()):
        if row["device"] != "cpu" or row.get("const") or row.get("fused") or (sizes and product(row) not in sizes):
            continue
        x, w, _ = operands(row, np.random.default_rng(0))
        aligned = [aligned_empty(a.shape, a.dtype) for a in (x, w)]
        for copy, array in zip(aligned, (x, w), strict=True):
            copy[...] = array
        path = modules / f"{row['name']}.hxb"
        runners = [_kernel_runner(path, "cpu", [x, w], row["m"], threads), _call_runner(path, [x, w], threads),
                   _call_runner(path, aligned, threads)]
        seen: list[list[float]] = [[] for _ in runners]
        for _ in range(repeats + 1):  # the first round: warm-up
            for runner, times in zip(runners, seen, strict=True):
                times.append(runner())
        kernel, call, at_64 = (statistics.median(times[1:]) for times in seen)
        print(f"{product(row):>22} {row['dtype']:>8} {kernel * 1e3:10.3f} {call * 1e3:9.3f} {at_64 * 1e3:11.3f} "
              f"{call / kernel:11.3f} {at_64 / kernel:15.3f}", flush=True)


#: Every row timed (label, dtype, kernel s, np.matmul(out=) s, call s, x @ w s), for `summary`;
#: CALLS: the last rows' call timings (call s, x @ w s, call on 64-byte aligned inputs s), which _record takes.
RESULTS: list[tuple[str, str, float, float, float | None, float | None, float | None]] = []
CALLS: list[tuple[float, float, float]] = []


def _record(label: str, dtype: str, kernel: float, base: float) -> None:
    call, numpy, aligned = CALLS.pop() if CALLS else (None, None, None)
    RESULTS.append((label, dtype, kernel, base, call, numpy, aligned))


def summary(passes: int) -> None:
    """The passes side by side, as issue #29's table: per product, numpy's time over hexir's
    (the kernel against np.matmul(out=); the user's call against x @ w), the call's time over
    the kernel's, and the call's on 64-byte aligned inputs over the kernel's, a figure a pass."""
    rows: dict[tuple[str, str], list[tuple]] = {}
    for label, dtype, kernel, base, call, numpy, aligned in RESULTS:
        rows.setdefault((label.strip(), dtype), []).append((kernel, base, call, numpy, aligned))
    print(f"\nsummary, {passes} passes (a figure a pass; ratio = numpy's time / hexir's, above 1: hexir faster)")
    print(f"{'product':>28} {'dtype':>8}  {'kernel / np.matmul(out=)':>24}  {'call / x @ w':>20}  "
          f"{'call ms / kernel ms':>20}  {'call@64B / kernel':>20}")

    def figures(values: list[float | None]) -> str:
        return " / ".join("-" if v is None else f"{v:.2f}" for v in values)
    for (label, dtype), timed in rows.items():
        print(f"{label:>28} {dtype:>8}  {figures([b / k for k, b, *_ in timed]):>24}  "
              f"{figures([n / c if c else None for _, _, c, n, _ in timed]):>20}  "
              f"{figures([c / k if c else None for k, _, c, _, _ in timed]):>20}  "
              f"{figures([a / k if a else None for k, *_, a in timed]):>20}")


def _interleaved(rows: list[dict], modules: Path, repeats: int, threads: int | None, aligned: bool = False) -> None:
    """cpu: the variants of one product timed in turns (A, B, C, A, B, C, ...), so that the
    host's drift, which moves single rows by up to 1.5x on a shared 16-core host, falls on all
    alike; numpy timed once per product, before them (its threads spin after each call). Each
    variant runs in two runners (twins: the same module, buffers of their own): the `twins`
    column is the slower twin's median over the faster's, what placement alone moves a row by
    (run 90 of bench/results/2026-12-01-h200.md: up to 1.2 on the H200's host), which a
    difference between variants must exceed to mean anything. `aligned`: each variant also on
    64-byte aligned buffers (rows "@64B", no call timed: `_aligned_cpu`), in the same turns."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["m"], row["k"], row["n"], row["dtype"]), []).append(row)
        if aligned:
            groups[row["m"], row["k"], row["n"], row["dtype"]].append(
                {**row, "variant": f"{row.get('variant', '')} @64B", "aligned": True})
    for (m, k, n, dtype), group in groups.items():
        rng = np.random.default_rng(0)
        x, w = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
        out = np.empty((m, n), dtype)
        base = _median_seconds(_host_timed(lambda x=x, w=w, out=out: np.matmul(x, w, out=out)), repeats)
        time.sleep(0.3)
        runners = [_kernel_runner(modules / f"{row['name']}.hxb", "cpu", [x, w], m, threads, row.get("aligned", False))
                   for row in group for _ in range(2)]
        for runner in runners:  # warm-up
            runner()
        seen: list[list[float]] = [[] for _ in runners]
        for _ in range(repeats):
            for runner, times in zip(runners, seen, strict=True):
                times.append(runner())
        flops = 2.0 * m * k * n
        for index, row in enumerate(group):  # each variant's output against numpy's, relative to the largest
            error = float(np.abs(runners[2 * index].result() - out).max() / max(np.abs(out).max(), 1e-30))
            if not error < (1e-4 if dtype == "float32" else 1e-10):
                print(f"{m} x {k} x {n} {dtype} {row.get('variant', '')}: WRONG, relative error {error:.2e}")
            twins = [statistics.median(times) for times in seen[2 * index: 2 * index + 2]]
            ours = statistics.median(seen[2 * index] + seen[2 * index + 1])
            label = f"{m} x {k} x {n} {row.get('variant', '')}"
            calls = "" if row.get("aligned") else _calls(modules / (row["name"] + ".hxb"), [x, w], repeats, threads)
            _record(label, dtype, ours, base)
            print(f"{label:>22} {dtype:>8} {ours * 1e3:10.3f} {base * 1e3:10.3f} {flops / ours / 1e9:11.1f} "
                  f"{flops / base / 1e9:10.1f} {base / ours:7.3f} {max(twins) / min(twins):7.3f}{calls}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build_parser = commands.add_parser("build")
    build_parser.add_argument("out", type=Path)
    build_parser.add_argument("--const", action="store_true",
                              help="only the CPU rows with w a compile-time constant, packed in OUT.tar.xz")
    build_parser.add_argument("--device", choices=("cpu", "cuda"),
                              help="only this device's modules (packed in OUT.tar.xz)")
    build_parser.add_argument("--sizes", help="only these products, e.g. 512x512x512,64x784x512,96x128x64x128 "
                                              "(packed in OUT.tar.xz)")
    build_parser.add_argument("--symbolic", action="store_true",
                              help="also each product (and its variants) with a symbolic row count")
    build_parser.add_argument("--tensor-cores", action="store_true",
                              help="only issue #26's bf16/f16/TF32 rows (cuda, sm_90a and sm_90), packed in OUT.tar.xz")
    build_parser.add_argument("--variants", help=f"cpu rows: also each under these variants of the schedule "
                                                 f"({', '.join(VARIANTS)}), for --interleave")
    run_parser = commands.add_parser("run")
    run_parser.add_argument("modules", type=Path)
    run_parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    run_parser.add_argument("--repeats", type=int, default=20)
    run_parser.add_argument("--threads", type=int, help="cpu: hexir's and numpy's BLAS threads (default: every core)")
    run_parser.add_argument("--sizes", help="only these products, e.g. 1024x1024x1024,1x4096x4096")
    run_parser.add_argument("--interleave", action="store_true",
                            help="cpu: time a product's variants (bench/cpu_tilings.py) in turns")
    run_parser.add_argument("--passes", type=int, default=1, help="run the table this many times")
    run_parser.add_argument("--aligned", action="store_true",
                            help="--interleave: each variant also on 64-byte aligned buffers (rows '@64B')")
    run_parser.add_argument("--turns", action="store_true",
                            help="cpu: each module's kernel, call and call on aligned inputs in turns (no numpy)")
    run_parser.add_argument("--cpu-time", action="store_true",
                            help="cpu, with --threads 1: time the process's CPU time rather than the wall clock")
    run_parser.add_argument("--fresh-outputs", action="store_true",
                            help="cpu: the user's call makes each output anew (the runtime's RECYCLE off)")
    run_parser.add_argument("--max-gflop", type=float, default=float("inf"),
                            help="skip products of more than this many GFLOP (the cpu's 8192^3 takes long)")
    args = parser.parse_args(argv)
    if args.command == "build" and args.tensor_cores:
        args.out.mkdir(parents=True, exist_ok=True)
        build_tensor_cores(args.out)
    elif args.command == "build":
        build(args.out, args.const, (args.device,) if args.device else ("cpu", "cuda"),
              args.sizes.split(",") if args.sizes else None, args.variants.split(",") if args.variants else None,
              args.symbolic)
    else:
        if not args.modules.exists():
            parser.error(f"{args.modules}: no such directory or archive (bench/linear.py build makes them)")
        args.modules = unpacked(args.modules)
        if args.interleave and args.device != "cpu":
            parser.error("--interleave times cpu variants (bench/cpu_tilings.py); use it with --device cpu")
        if args.sizes:
            listed = {product(r) for r in json.loads((args.modules / "modules.json").read_text())}
            unknown = sorted(set(args.sizes.split(",")) - listed)
            if unknown:
                parser.error(f"--sizes: {', '.join(unknown)} not among the modules' products "
                             f"({', '.join(sorted(listed))})")
        if args.cpu_time:
            if args.threads != 1:
                parser.error("--cpu-time measures one thread's work: use it with --threads 1")
            global CLOCK
            CLOCK = time.process_time
        if args.fresh_outputs:
            from hexir_runtime import executor
            executor.RECYCLE = False
        for number in range(args.passes):
            if args.passes > 1:
                print(f"pass {number + 1} of {args.passes}", flush=True)
            if args.turns:
                turns(args.modules, args.repeats, args.threads, args.sizes.split(",") if args.sizes else None)
                continue
            run(args.modules, args.device, args.repeats, args.max_gflop, args.threads,
                args.sizes.split(",") if args.sizes else None, args.interleave, args.aligned)
        if args.passes > 1 and not args.turns:
            summary(args.passes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
