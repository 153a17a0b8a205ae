"""Benchmark (#25 targets 3 and 4): one pre-LN transformer block (batch 8 x seq 512 x d 768, 12
heads of 64, causal mask, gelu MLP of 3072, residuals) on the GPU: hexir against torch eager and
torch.compile (default mode) computing the same block with the same weights (float32, TF32 off);
on the cpu (`--device cpu`): hexir's cpu module against numpy computing the same block (its
matmuls on numpy's BLAS, its element-wise ops one temporary each; erf: scipy's, else torch's).

    python bench/block.py build DIR     # here (hexir): DIR/block.hxb.xz (its weights 32-level: 4:1), the compile time
    python bench/block.py run DIR [DIR2 ...]   # there (hexir_runtime, torch on cuda); DIR2: other builds beside
    python bench/block.py build DIR --device cpu && python bench/block.py run DIR --device cpu  # DIR/block_cpu.hxb.xz

Two columns: numpy in / numpy out (a user's call from host arrays, the time to a host result;
wall clock, median) and device-resident (torch CUDA tensors in, outputs on the GPU: hexir via
DLPack and outputs="device"; CUDA events around the call, median). The result of each is
checked against torch eager (WRONG if off by more than 1e-3 relative to the largest).
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

BATCH, SEQ, DIM, HEADS, HIDDEN = 8, 512, 768, 12, 3072
HEAD = DIM // HEADS


def weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def normal(*shape: int, std: float) -> np.ndarray:  # (32 levels: the module compresses 4:1 to travel)
        return (rng.integers(-16, 16, shape) * (std / 9.2)).astype(np.float32)

    return {"ln1_g": 1 + normal(DIM, std=0.1), "ln1_b": normal(DIM, std=0.02),
            "qkv": normal(DIM, 3 * DIM, std=0.03), "qkv_b": normal(3 * DIM, std=0.02),
            "proj": normal(DIM, DIM, std=0.03), "proj_b": normal(DIM, std=0.02),
            "ln2_g": 1 + normal(DIM, std=0.1), "ln2_b": normal(DIM, std=0.02),
            "fc": normal(DIM, HIDDEN, std=0.03), "fc_b": normal(HIDDEN, std=0.02),
            "fc2": normal(HIDDEN, DIM, std=0.02), "fc2_b": normal(DIM, std=0.02)}


def block(hexir, w):
    def forward(x, mask):
        batch, seq, _ = x.shape
        h = hexir.layer_norm(x, w["ln1_g"], w["ln1_b"])
        qkv = hexir.linear(h, w["qkv"], w["qkv_b"])
        q, k, v = (qkv[..., j * DIM:(j + 1) * DIM].reshape(batch, seq, HEADS, HEAD).transpose(0, 2, 1, 3)
                   for j in range(3))
        attended = hexir.softmax(q @ k.transpose(0, 1, 3, 2) * (1 / math.sqrt(HEAD)) + mask, axis=-1) @ v
        x = x + hexir.linear(attended.transpose(0, 2, 1, 3).reshape(batch, seq, DIM), w["proj"], w["proj_b"])
        h = hexir.layer_norm(x, w["ln2_g"], w["ln2_b"])
        return x + hexir.linear(hexir.gelu(hexir.linear(h, w["fc"], w["fc_b"])), w["fc2"], w["fc2_b"])
    return forward


def torch_block(torch, w):
    F = torch.nn.functional  # noqa: N806
    t = {k: torch.from_numpy(v).cuda() for k, v in w.items()}

    def forward(x, mask):
        batch, seq, _ = x.shape
        h = F.layer_norm(x, (DIM,), t["ln1_g"], t["ln1_b"])
        qkv = h @ t["qkv"] + t["qkv_b"]
        q, k, v = (qkv[..., j * DIM:(j + 1) * DIM].reshape(batch, seq, HEADS, HEAD).transpose(1, 2) for j in range(3))
        attended = torch.softmax(q @ k.transpose(-1, -2) * (1 / math.sqrt(HEAD)) + mask, dim=-1) @ v
        x = x + attended.transpose(1, 2).reshape(batch, seq, DIM) @ t["proj"] + t["proj_b"]
        h = F.layer_norm(x, (DIM,), t["ln2_g"], t["ln2_b"])
        return x + F.gelu(h @ t["fc"] + t["fc_b"]) @ t["fc2"] + t["fc2_b"]
    return forward


def numpy_block(w):
    """The block in numpy (float32; erf from scipy, else torch on the cpu: numpy has none)."""
    try:
        from scipy.special import erf
    except ImportError:
        import torch

        def erf(y):
            return torch.special.erf(torch.from_numpy(y)).numpy()

    def layer_norm(x, g, b):
        centred = x - x.mean(-1, keepdims=True)
        return centred / np.sqrt((centred * centred).mean(-1, keepdims=True) + np.float32(1e-5)) * g + b

    def forward(x, mask):
        batch, seq, _ = x.shape
        qkv = layer_norm(x, w["ln1_g"], w["ln1_b"]) @ w["qkv"] + w["qkv_b"]
        q, k, v = (qkv[..., j * DIM:(j + 1) * DIM].reshape(batch, seq, HEADS, HEAD).transpose(0, 2, 1, 3)
                   for j in range(3))
        scores = q @ k.transpose(0, 1, 3, 2) * np.float32(1 / math.sqrt(HEAD)) + mask
        e = np.exp(scores - scores.max(-1, keepdims=True))
        attended = (e / e.sum(-1, keepdims=True)) @ v
        x = x + attended.transpose(0, 2, 1, 3).reshape(batch, seq, DIM) @ w["proj"] + w["proj_b"]
        y = layer_norm(x, w["ln2_g"], w["ln2_b"]) @ w["fc"] + w["fc_b"]
        return x + (np.float32(0.5) * y * (1 + erf(y * np.float32(1 / math.sqrt(2))))) @ w["fc2"] + w["fc2_b"]
    return forward


def _name(device: str) -> str:
    return "block" if device == "cuda" else f"block_{device}"


def build(out: Path, device: str = "cuda") -> None:
    import hexir
    out.mkdir(parents=True, exist_ok=True)
    specs = (hexir.TensorSpec((BATCH, SEQ, DIM), "float32"), hexir.TensorSpec((SEQ, SEQ), "float32"))
    started, path = time.perf_counter(), out / f"{_name(device)}.hxb"
    hexir.export(block(hexir, weights()), path, *specs, placement=f"*={device}")
    seconds = time.perf_counter() - started
    (out / f"{path.name}.xz").write_bytes(lzma.compress(path.read_bytes(), preset=1))
    path.unlink()
    (out / f"{_name(device)}.json").write_text(json.dumps({"compile_seconds": seconds}))
    print(f"built {path} in {seconds:.1f} s (this machine)")


def _wall(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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


def run_cpu(out: Path, repeats: int) -> int:
    """hexir's cpu module against numpy, numpy in/out, wall clock (numpy first: its BLAS threads spin after a call)."""
    import hexir_runtime
    path = out / "block_cpu.hxb"
    if not path.exists():
        path.write_bytes(lzma.decompress((out / "block_cpu.hxb.xz").read_bytes()))
    x = np.random.default_rng(1).standard_normal((BATCH, SEQ, DIM)).astype(np.float32)
    mask = np.triu(np.full((SEQ, SEQ), -np.inf, np.float32), k=1)
    theirs = numpy_block(weights())
    module = hexir_runtime.load(path, "cpu")
    want, got = theirs(x, mask), module.main(x, mask)
    error = float(np.abs(got - want).max() / np.abs(want).max())
    print(f"hexir cpu vs numpy: max error {error:.1e} relative to the largest" + ("  WRONG" if error > 1e-3 else ""))
    compile_s = json.loads((out / "block_cpu.json").read_text())["compile_seconds"]
    base = _wall(lambda: theirs(x, mask), repeats)
    time.sleep(0.3)
    ours = _wall(lambda: module.main(x, mask), repeats)
    print(f"block on the cpu: batch {BATCH} x seq {SEQ} x d {DIM}, {HEADS} heads, float32; median of {repeats}; "
          f"hexir compiled in {compile_s:.1f} s (build machine)")
    print(f"{'':>16} {'hexir ms':>9} {'numpy ms':>9} {'numpy/hexir':>11}")
    print(f"{'numpy in/out':>16} {ours * 1e3:9.2f} {base * 1e3:9.2f} {base / ours:11.2f}")
    module.close()
    return int(error > 1e-3)


def run(out: Path, repeats: int, others: list[Path] = ()) -> int:
    """Time DIR's module (and each of `others`' builds: a row each, against the same torch runs)."""
    import hexir_runtime
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    w = weights()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((BATCH, SEQ, DIM)).astype(np.float32)
    mask = np.triu(np.full((SEQ, SEQ), -np.inf, np.float32), k=1)
    modules = {path.name: hexir_runtime.load(lzma.decompress((path / "block.hxb.xz").read_bytes()), "cuda")
               for path in (out, *others)}  # (DIR is only read)
    eager = torch_block(torch, w)
    compiled = torch.compile(eager)
    xt, mt = torch.from_numpy(x).cuda(), torch.from_numpy(mask).cuda()
    with torch.no_grad():
        want = eager(xt, mt).cpu().numpy()
        started = time.perf_counter()
        compiled(xt, mt)
        torch.cuda.synchronize()
        torch_compile_s = time.perf_counter() - started
        status = 0
        for label, module in modules.items():
            error = float(np.abs(module.main(x, mask) - want).max() / np.abs(want).max())
            print(f"hexir ({label}) vs torch eager: max error {error:.1e} relative to the largest"
                  + ("  WRONG" if error > 1e-3 else ""))
            status |= error > 1e-3
        rows = {
            "numpy in/out": (lambda module: module.main(x, mask),
                             lambda: eager(torch.from_numpy(x).cuda(), torch.from_numpy(mask).cuda()).cpu().numpy(),
                             lambda: compiled(torch.from_numpy(x).cuda(), torch.from_numpy(mask).cuda()).cpu().numpy(),
                             _wall),
            "device-resident": (lambda module: module.main(xt, mt, outputs="device"), lambda: eager(xt, mt),
                                lambda: compiled(xt, mt), lambda fn, r: _events(torch, fn, r)),
        }
        compile_s = json.loads((out / "block.json").read_text())["compile_seconds"]
        print(f"block: batch {BATCH} x seq {SEQ} x d {DIM}, {HEADS} heads, float32 (TF32 off); median of {repeats}; "
              f"hexir compiled in {compile_s:.1f} s (build machine), torch.compile's first {torch_compile_s:.1f} s")
        print(f"{'':>16} {'hexir ms':>9} {'eager ms':>9} {'eager/hexir':>11} {'compile ms':>10} {'compiled/hexir':>14}")
        for name, (ours, theirs, theirs_compiled, timer) in rows.items():
            b, c = (timer(fn, repeats) for fn in (theirs, theirs_compiled))
            for label, module in modules.items():
                a = timer(lambda module=module, ours=ours: ours(module), repeats)
                print(f"{name:>16} {a * 1e3:9.2f} {b * 1e3:9.2f} {b / a:11.2f} {c * 1e3:10.2f} {c / a:14.2f}"
                      + (f"  ({label})" if others else ""))
    for module in modules.values():
        module.close()
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("build", "run"))
    parser.add_argument("dir", type=Path)
    parser.add_argument("others", type=Path, nargs="*", help="run: other builds' DIRs, timed beside DIR's")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)
    if args.action == "build":
        build(args.dir, args.device)
        return 0
    return run_cpu(args.dir, args.repeats) if args.device == "cpu" else run(args.dir, args.repeats, args.others)


if __name__ == "__main__":
    sys.exit(main())
