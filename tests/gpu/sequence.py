"""The GPU ≡ CPU suite's sequence cases (#24): the transformer of examples/transformer.py (two
pre-LN blocks of causal multi-head attention and a gelu MLP, embeddings by `take`, symbolic
batch and sequence), built here and run there at odd sequence lengths, its logits on cuda and
on the cpu against the float64 numpy reference (and torch.nn.functional's with --torch), then
20 greedy tokens generated on cuda with one module as the sequence grows.

    python tests/gpu/sequence.py build DIR          # here (hexir): DIR/transformer_cuda.hxb
    python tests/gpu/sequence.py run DIR [--torch]  # there (hexir_runtime, numpy; torch if asked)

Prints one line per (device, batch, seq) with the largest error relative to the tolerance, and
FAIL for any above it; exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import transformer as model  # noqa: E402

SEQUENCES = (1, 7, 129, 1000)
RTOL = ATOL = 2e-4  # float32 through two blocks, against float64


def build(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.export(out / "transformer_cuda.hxb", "cuda")
    print(f"built {out / 'transformer_cuda.hxb'}")


def run(cases: Path, use_torch: bool) -> int:
    import hexir_runtime
    w = model.weights()
    failures = 0
    rng = np.random.default_rng(24)
    for device in ("cuda", "cpu"):
        module = hexir_runtime.load(cases / "transformer_cuda.hxb", device)
        for batch, seq in [(2, s) for s in SEQUENCES] + [(1, 64)]:
            ids = rng.integers(0, model.VOCAB, (batch, seq), dtype=np.int64)
            positions, mask = np.arange(seq, dtype=np.int64), model.causal_mask(seq)
            got = module.main(ids, positions, mask)
            oracles = [("numpy", model.numpy_reference(w, ids, positions, mask))]
            if use_torch and device == "cuda":
                oracles.append(("torch", model.torch_reference(w, ids, positions, mask, "cuda")))
            for name, want in oracles:
                error = float(np.max(np.abs(got - want) / (ATOL + RTOL * np.abs(want))))
                verdict = "ok" if error <= 1 else "FAIL"
                failures += verdict == "FAIL"
                print(f"{verdict:4} {device:4} batch {batch} seq {seq:4} vs {name:5}: "
                      f"at most {error:.3f} of the tolerance")
        if device == "cuda":
            prompt = np.array([[5, 17, 42, 8, 63], [1, 2, 3, 4, 5]], np.int64)
            ids = model.generate(module, w, prompt, 20, "cuda" if use_torch else None)
            print(f"ok   cuda generated 20 tokens a row, each step checked: {ids[:, prompt.shape[1]:].tolist()}")
        module.close()
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("build", "run"))
    parser.add_argument("dir", type=Path)
    parser.add_argument("--torch", action="store_true")
    args = parser.parse_args(argv)
    if args.action == "build":
        build(args.dir)
        return 0
    return run(args.dir, args.torch)


if __name__ == "__main__":
    sys.exit(main())
