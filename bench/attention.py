"""Benchmark (#25 target 2): fused attention, softmax(q @ kᵀ / sqrt(d) + mask) @ v, on the GPU:
hexir's fused kernel (recognised from the user's ops) against torch's scaled_dot_product_attention
on float32 inputs (TF32 off) and hexir's unfused form (kᵀ given, so the three kernels stay:
matmul, softmax, matmul), at [8, 12, 512, 64], [1, 16, 4096, 64], [4, 16, 1024, 128], with and
without a causal (additive -inf) mask; before it, the fused kernels' results on small and odd
shapes against numpy (float64).

    python bench/attention.py build DIR [--tilings 4,4,16 8,4,8]   # here (hexir): DIR/*.hxb.xz
    python bench/attention.py run DIR       # there (hexir_runtime, torch on cuda)

--tilings builds only the fused kernels of the timed shapes, once per tiling of
schedules/cuda_attention.py's TILINGS (rows, keys a thread, threads along the rows), each
alone in the table (into the DIR of a plain build), and the run times every one it finds (the
tuning runs of docs/tuning.md); a tiling ending in `pad` (`4,4,16pad`) is built without
cuda_attention.SWIZZLE (the weights' tile padded). --shapes limits the timed shapes (`x128`: d 128).

Times are CUDA events around a device-resident call (torch tensors in via DLPack, outputs on the
GPU), median of --repeats. Memory: torch's peak allocation for SDPA; for hexir, the device
memory the module holds after a call (cuMemGetInfo before and after: its buffers stay).
"""

from __future__ import annotations

import argparse
import lzma
import os
import statistics
import sys
from pathlib import Path

import numpy as np

SHAPES = ((8, 12, 512, 64), (1, 16, 4096, 64), (4, 16, 1024, 128))
#: (name, q shape, k rows, dtype, mask shape or None): the correctness cases ("S" a symbolic seq)
CASES = [(f"{dtype}-d{d}-s{s}-{'mask' if m else 'none'}", (2, 3, s, d), s, dtype, (s, s) if m else None)
         for dtype in ("float32",) for d in (64, 128, 40) for s in (1, 7, 129, 300) for m in (True, False)]
CASES += [("float64-d64-s129-mask", (2, 3, 129, 64), 129, "float64", (129, 129)),
          ("float32-d64-q5-k300-mask-b", (2, 1, 5, 64), 300, "float32", (2, 1, 1, 300)),
          ("float32-d64-symbolic", (2, 3, "seq", 64), "seq", "float32", ("seq", "seq"))]


def attention(hexir, scale: float, masked: bool, transposed: bool):
    def fused(q, k, v, mask=None):
        kt = k if transposed else k.transpose(0, 1, 3, 2)
        scores = q @ kt * scale
        return hexir.softmax(scores + mask if masked else scores, axis=-1) @ v
    if masked:
        return lambda q, k, v, mask: fused(q, k, v, mask)
    return lambda q, k, v: fused(q, k, v)


def build(out: Path, tilings: list[str], shapes: str = "") -> None:
    os.environ["HEXIR_CACHE_DIR"] = ""  # (the cache's key does not see a tiling set here)
    import hexir
    from hexir.schedules import cuda_attention
    out.mkdir(parents=True, exist_ok=True)

    def export(name, function, specs):
        path = out / f"{name}.hxb"
        hexir.export(function, path, *specs, placement="*=cuda")
        (out / f"{name}.hxb.xz").write_bytes(lzma.compress(path.read_bytes(), preset=6))
        path.unlink()

    for name, q, k_rows, dtype, mask in [] if tilings else CASES:
        d = q[-1]
        specs = [hexir.TensorSpec(s, dtype) for s in (q, (*q[:2], k_rows, d), (*q[:2], k_rows, d), mask) if s]
        export(f"case-{name}", attention(hexir, 1 / np.sqrt(d), mask is not None, False), specs)
    for shape in SHAPES:
        b, h, s, d = shape
        for masked in (True, False):
            tag = f"{b}x{h}x{s}x{d}-{'mask' if masked else 'none'}"
            extra = [hexir.TensorSpec((s, s), "float32")] if masked else []
            if not tilings:
                export(f"fused-{tag}", attention(hexir, 1 / np.sqrt(d), masked, False),
                       [hexir.TensorSpec(shape, "float32")] * 3 + extra)
                export(f"unfused-{tag}", attention(hexir, 1 / np.sqrt(d), masked, True),
                       [hexir.TensorSpec(shape, "float32"), hexir.TensorSpec((b, h, d, s), "float32"),
                        hexir.TensorSpec(shape, "float32")] + extra)
            table, swizzle = cuda_attention.TILINGS, cuda_attention.SWIZZLE
            for tiling in tilings if shapes in tag else ():  # (each alone in the table)
                cuda_attention.TILINGS = (tuple(int(n) for n in tiling.removesuffix("pad").split(",")),)
                cuda_attention.SWIZZLE = not tiling.endswith("pad")
                export(f"fused-{tag}-t{tiling.replace(',', 'x')}", attention(hexir, 1 / np.sqrt(d), masked, False),
                       [hexir.TensorSpec(shape, "float32")] * 3 + extra)
            cuda_attention.TILINGS, cuda_attention.SWIZZLE = table, swizzle
    print(f"built {len(list(out.glob('*.hxb.xz')))} modules in {out}")


def _load(hexir_runtime, directory: Path, name: str):
    return hexir_runtime.load(lzma.decompress((directory / f"{name}.hxb.xz").read_bytes()), "cuda")


def reference(q, k, v, mask, scale):
    scores = q.astype(np.float64) @ np.swapaxes(k, -1, -2) * scale + (0 if mask is None else mask)
    with np.errstate(invalid="ignore"):
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        return weights / weights.sum(-1, keepdims=True) @ v


def check(hexir_runtime, directory: Path) -> int:
    rng, failures = np.random.default_rng(0), 0
    for name, q_shape, k_rows, dtype, mask_shape in CASES:
        if not (directory / f"case-{name}.hxb.xz").exists():  # (a tuning build has none)
            print(f"check {name}: not built, skipped")
            continue
        module = _load(hexir_runtime, directory, f"case-{name}")
        for seq in ((1, 70, 257) if "symbolic" in name else (None,)):
            size = {"seq": seq}
            q_s = tuple(size.get(x, x) for x in q_shape)
            rows = size.get(k_rows, k_rows)
            q = rng.standard_normal(q_s).astype(dtype)
            k, v = (rng.standard_normal((*q_s[:2], rows, q_s[-1])).astype(dtype) for _ in range(2))
            args = [q, k, v]
            mask = None
            if mask_shape is not None and len(mask_shape) == 4:  # padding: keys masked per batch index
                mask = np.zeros(mask_shape, dtype)
                mask[0, ..., 250:], mask[1, ..., :70] = -np.inf, -np.inf
                args.append(mask)
            elif mask_shape is not None:
                mask = np.triu(np.full((q_s[-2], rows), -np.inf, dtype), k=1 + rows - q_s[-2])
                if q_s[-2] > 3:
                    mask[2, :] = -np.inf  # a fully masked row: NaN, as the unfused softmax gives
                args.append(mask)
            got = module.main(*args)
            want = reference(q, k, v, mask, 1 / np.sqrt(q_s[-1]))
            same_nan = bool((np.isnan(got) == np.isnan(want)).all())
            error = float(np.nanmax(np.abs(got - want))) if not np.isnan(want).all() else 0.0
            bad = not same_nan or error > (1e-4 if dtype == "float32" else 1e-10)
            failures += bad
            print(f"check {name}{'' if seq is None else f' seq={seq}'}: max error {error:.1e}, NaNs "
                  f"{'as numpy' if same_nan else 'DIFFER'}{'  WRONG' if bad else ''}")
        module.close()
    return failures


def _events(torch, fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _compare(torch, hexir_runtime, directory: Path, shape: tuple, tensors: list, repeats: int) -> int:
    """One row: hexir fused and unfused, torch SDPA; 1 if hexir's result is off."""
    (b, h, s, d), (q, k, v, kt, *extra) = shape, tensors
    tag = f"{b}x{h}x{s}x{d}-{'mask' if extra else 'none'}"
    held = []
    for name, key in ((f"fused-{tag}", k), (f"unfused-{tag}", kt)):
        torch.cuda.synchronize()
        free = torch.cuda.mem_get_info()[0]
        module = _load(hexir_runtime, directory, name)

        def call(module=module, key=key):
            return module.main(q, key, v, *extra, outputs="device")
        result = call()
        torch.cuda.synchronize()
        held.append(((free - torch.cuda.mem_get_info()[0]) / 2**20, module, call, result))
    (fused_mib, fused, fused_call, got), (unfused_mib, unfused, unfused_call, _) = held
    variants = sorted(p.name[:-len(".hxb.xz")] for p in directory.glob(f"fused-{tag}-t*.hxb.xz"))
    F = torch.nn.functional  # noqa: N806

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=extra[0] if extra else None)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    want = sdpa()
    torch.cuda.synchronize()
    sdpa_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
    got = got if isinstance(got, torch.Tensor) else torch.from_dlpack(got)
    error = float((got - want).abs().max() / want.abs().max())
    a, c, u = (_events(torch, fn, repeats) for fn in (fused_call, sdpa, unfused_call))
    print(f"{'x'.join(map(str, shape)):>18} {'yes' if extra else 'no':>5} {a * 1e3:9.3f} {c * 1e3:8.3f} "
          f"{c / a:10.2f} {u * 1e3:10.3f} {4 * b * h * s * s * d / a / 1e12:7.1f} {error:8.1e}"
          f"{'  WRONG' if error > 1e-4 else ''} {fused_mib:9.0f} {sdpa_mib:8.0f} {unfused_mib:11.0f}")
    fused.close()
    unfused.close()
    bad = int(error > 1e-4)
    for name in variants:  # the tuning variants: time, error
        try:
            module = _load(hexir_runtime, directory, name)
        except Exception as error:  # (one bad file must not stop the run)
            print(f"{'':>18} {name.rsplit('-', 1)[1]:>5} not loaded: {error}")
            continue
        result = module.main(q, k, v, *extra, outputs="device")
        result = result if isinstance(result, torch.Tensor) else torch.from_dlpack(result)
        error = float((result - want).abs().max() / want.abs().max())
        t = _events(torch, lambda module=module: module.main(q, k, v, *extra, outputs="device"), repeats)
        print(f"{'':>18} {name.rsplit('-', 1)[1]:>5} {t * 1e3:9.3f} {c * 1e3:8.3f} {c / t:10.2f} {'':>10} "
              f"{4 * b * h * s * s * d / t / 1e12:7.1f} {error:8.1e}{'  WRONG' if error > 1e-4 else ''}")
        bad += error > 1e-4
        module.close()
    return bad


def run(directory: Path, repeats: int) -> int:
    import hexir_runtime
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    failures = check(hexir_runtime, directory)
    rng = np.random.default_rng(1)
    print(f"{'shape':>18} {'mask':>5} {'hexir ms':>9} {'sdpa ms':>8} {'sdpa/hexir':>10} {'unfused ms':>10} "
          f"{'TFLOP/s':>7} {'error':>8} {'hexir MiB':>9} {'sdpa MiB':>8} {'unfused MiB':>11}")
    for shape in SHAPES:
        b, h, s, d = shape
        q, k, v = (torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).cuda() for _ in range(3))
        kt = k.transpose(-1, -2).contiguous()
        mask = torch.triu(torch.full((s, s), float("-inf"), device="cuda"), diagonal=1)
        for masked in (True, False):
            failures += _compare(torch, hexir_runtime, directory, shape, [q, k, v, kt] + ([mask] if masked else []),
                                 repeats)
    print(f"failures: {failures}")
    return int(failures > 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("build", "run"))
    parser.add_argument("dir", type=Path)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tilings", nargs="*", default=[], help="rows,keys,threads[pad]: fused variants to time")
    parser.add_argument("--shapes", default="", help="the tilings' shapes: those whose tag holds this text")
    args = parser.parse_args(argv)
    if args.action == "build":
        build(args.dir, args.tilings, args.shapes)
        return 0
    return run(args.dir, args.repeats)


if __name__ == "__main__":
    sys.exit(main())
