"""Benchmark (#25 target 3, compile time): how long a cold compile (no cache) takes, before
(the compiler of a git ref, from a detached worktree) and after (this tree), side by side.

    python bench/compile_time.py [--before-ref main] [--before /work/wt/compile-before] [--repeats 1]

Three modules: bench/block.py's transformer block (batch 8 x seq 512 x d 768, 12 heads, every op
on cuda: 17 ops, each kernel with a cpu twin; compilers before h25-rows built the twins for the 3
default x86-64 levels, later ones for the lowest alone), the same with one level in the target
(`block-v1`: target cpu:x86-64,cuda:sm_90; since h25-rows the same module as `block`), and
examples/transformer.py's 2-block decoder (on the cpu, symbolic batch and sequence), each
compiled to .hxb by `hexir.export` with HEXIR_CACHE_DIR= (nothing cached). Each compile runs in
a fresh process (imports not counted) with that compiler's own PYTHONPATH, before and after in
turns; each run's line shows its .hxb's size and hash (the same bytes every repeat: the build is
deterministic); a row gives the median wall seconds and CPU seconds (the process and the tools
it ran: opt, llc, cc, ptxas), which a loaded machine changes less than the wall. The `nproc`
and load average are printed with them.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MODELS = ("block", "block-v1", "transformer")


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one(model: str) -> None:
    """Compile `model` once with the hexir on sys.path; print {wall, cpu, bytes, sha256} as JSON."""
    import hexir
    target = None
    if model.startswith("block"):
        block = _load(HERE / "block.py", "block")
        fn, placement = block.block(hexir, block.weights()), "*=cuda"
        target = "cpu:x86-64,cuda:sm_90" if model == "block-v1" else None
        specs = (hexir.TensorSpec((block.BATCH, block.SEQ, block.DIM), "float32"),
                 hexir.TensorSpec((block.SEQ, block.SEQ), "float32"))
    else:
        example = _load(REPO / "examples" / "transformer.py", "transformer")
        fn, placement = example.decoder(example.weights()), None
        specs = (hexir.TensorSpec(("batch", "seq"), "int64"), hexir.TensorSpec(("seq",), "int64"),
                 hexir.TensorSpec(("seq", "seq"), "float32"))
    with tempfile.TemporaryDirectory(prefix="hexir-compile-time-") as scratch:
        before, started = os.times(), time.perf_counter()
        path = hexir.export(fn, Path(scratch) / f"{model}.hxb", *specs, placement=placement, target=target)
        wall, after = time.perf_counter() - started, os.times()
        data = path.read_bytes()
    cpu = sum(after[:4]) - sum(before[:4])  # user + system, the process's and its finished children's
    print(json.dumps({"wall": round(wall, 2), "cpu": round(cpu, 2), "bytes": len(data),
                      "sha256": hashlib.sha256(data).hexdigest()[:16]}))


def _measure(tree: Path, model: str) -> dict:
    env = {**os.environ, "HEXIR_CACHE_DIR": "", "PYTHONPATH": f"{tree}/runtime{os.pathsep}{tree}"}
    result = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--one", model], env=env, cwd=tree,
                            capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{model} with the compiler in {tree} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before-ref", default="main", help="the git ref whose compiler is 'before' (main)")
    parser.add_argument("--before", type=Path, default=Path("/work/wt/compile-before"),
                        help="its worktree (added, detached, if missing)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--one", choices=MODELS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        one(args.one)
        return 0
    if not args.before.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(args.before), args.before_ref],
                       check=True, capture_output=True)
    else:
        subprocess.run(["git", "-C", str(args.before), "checkout", "-q", "--detach", args.before_ref], check=True)
    commits = {name: subprocess.run(["git", "-C", str(tree), "log", "-1", "--format=%h %s"], capture_output=True,
                                    text=True).stdout.strip()[:70] for name, tree in (("before", args.before),
                                                                                       ("after", REPO))}
    print(f"nproc {os.cpu_count()}, load average at start {os.getloadavg()[0]:.1f}; cold compiles (HEXIR_CACHE_DIR=), "
          f"{args.repeats} each, before and after in turns")
    for name, commit in commits.items():
        print(f"  {name}: {commit}")
    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.repeats):
        for model in MODELS:
            for name, tree in (("before", args.before), ("after", REPO)):
                runs.setdefault((model, name), []).append(_measure(tree, model))
                print(f"  {model} {name}: {runs[(model, name)][-1]}", flush=True)
    print(f"{'module':>12} {'before wall s':>13} {'before CPU s':>12} {'after wall s':>12} {'after CPU s':>11} "
          f"{'wall ratio':>10} {'CPU ratio':>9}")
    for model in MODELS:
        (bw, bc), (aw, ac) = [[statistics.median(r[key] for r in runs[(model, name)]) for key in ("wall", "cpu")]
                              for name in ("before", "after")]
        print(f"{model:>12} {bw:13.1f} {bc:12.1f} {aw:12.1f} {ac:11.1f} {bw / aw:10.2f} {bc / ac:9.2f}")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
