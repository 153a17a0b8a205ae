"""A small pre-LN decoder as people write one, compiled once and run as it generates.

Token and position embeddings (`hexir.take`), two blocks of causal multi-head self-attention
(`q @ k.transpose(...)`, a mask input, softmax over the keys) and a gelu MLP with residuals, a
final layer_norm and the logits. The weights are seeded, not trained: the point is that hexir
computes what the same model computes in numpy (and, where torch is installed, what
`torch.nn.functional` computes with the same weights).

    python examples/transformer.py [FOLDER] [--device cpu|cuda] [--torch]

exports transformer.hxb (symbolic batch and sequence: one module for every prompt length) to
FOLDER (default: next to this file), then generates 20 tokens greedily from a prompt of 5, the
sequence growing by one per step, each step's logits checked against the numpy reference (and
torch's with --torch) and the tokens equal. hexir-run serves the file too:

    hexir-run examples/transformer.hxb --input ids=... --input positions=... --input mask=...
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import hexir_runtime
import numpy as np

# hexir itself is imported where the model is compiled: on a machine with only the runtime,
# generate() and the references run a prebuilt .hxb.

VOCAB, DIM, HEADS, LAYERS, HIDDEN, MAX_SEQ = 96, 64, 4, 2, 256, 1024
HEAD = DIM // HEADS
DTYPE = np.float32


def weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded weights in GPT-2's shapes (w[in, out]: x @ w)."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int, std: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(DTYPE)

    w = {"tokens": normal(VOCAB, DIM, std=1.0), "positions": normal(MAX_SEQ, DIM, std=0.5),
         "ln_g": 1 + normal(DIM, std=0.1), "ln_b": normal(DIM), "out": normal(DIM, VOCAB, std=0.2)}
    for i in range(LAYERS):
        w |= {f"{i}.ln1_g": 1 + normal(DIM, std=0.1), f"{i}.ln1_b": normal(DIM),
              f"{i}.qkv": normal(DIM, 3 * DIM, std=0.15), f"{i}.qkv_b": normal(3 * DIM),
              f"{i}.proj": normal(DIM, DIM, std=0.1), f"{i}.proj_b": normal(DIM),
              f"{i}.ln2_g": 1 + normal(DIM, std=0.1), f"{i}.ln2_b": normal(DIM),
              f"{i}.fc": normal(DIM, HIDDEN, std=0.1), f"{i}.fc_b": normal(HIDDEN),
              f"{i}.fc2": normal(HIDDEN, DIM, std=0.05), f"{i}.fc2_b": normal(DIM)}
    return w


def causal_mask(seq: int) -> np.ndarray:
    """0 where a position may attend (itself and before), -inf after: added to the scores."""
    return np.triu(np.full((seq, seq), -np.inf, DTYPE), k=1)


def decoder(w: dict[str, np.ndarray]):
    """The model as a hexir function of ids[batch, seq] (int64), positions[seq] (int64) and the
    additive mask[seq, seq]: the logits[batch, seq, VOCAB]."""
    import hexir

    def forward(ids, positions, mask):
        batch, seq = ids.shape
        x = hexir.take(w["tokens"], ids) + hexir.take(w["positions"], positions)
        for i in range(LAYERS):
            h = hexir.layer_norm(x, w[f"{i}.ln1_g"], w[f"{i}.ln1_b"])
            qkv = hexir.linear(h, w[f"{i}.qkv"], w[f"{i}.qkv_b"])                       # [batch, seq, 3 * DIM]
            q, k, v = (qkv[..., j * DIM:(j + 1) * DIM].reshape(batch, seq, HEADS, HEAD).transpose(0, 2, 1, 3)
                       for j in range(3))                                                # [batch, HEADS, seq, HEAD]
            scores = q @ k.transpose(0, 1, 3, 2) * (1 / np.sqrt(HEAD)) + mask
            attended = hexir.softmax(scores, axis=-1) @ v                                # [batch, HEADS, seq, HEAD]
            merged = attended.transpose(0, 2, 1, 3).reshape(batch, seq, DIM)
            x = x + hexir.linear(merged, w[f"{i}.proj"], w[f"{i}.proj_b"])
            h = hexir.layer_norm(x, w[f"{i}.ln2_g"], w[f"{i}.ln2_b"])
            x = x + hexir.linear(hexir.gelu(hexir.linear(h, w[f"{i}.fc"], w[f"{i}.fc_b"])), w[f"{i}.fc2"],
                                 w[f"{i}.fc2_b"])
        return hexir.linear(hexir.layer_norm(x, w["ln_g"], w["ln_b"]), w["out"])
    return forward


def numpy_reference(w: dict[str, np.ndarray], ids: np.ndarray, positions: np.ndarray,
                    mask: np.ndarray) -> np.ndarray:
    """The same model in numpy, in float64 (so it checks hexir's float32, not the reverse)."""
    from math import erf, sqrt
    w = {k: v.astype(np.float64) for k, v in w.items()}

    def layer_norm(x, g, b):
        mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + 1e-5) * g + b

    def softmax(s):
        e = np.exp(s - s.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    gelu = np.vectorize(lambda v: 0.5 * v * (1 + erf(v / sqrt(2))), otypes=[np.float64])
    batch, seq = ids.shape
    x = w["tokens"][ids] + w["positions"][positions]
    for i in range(LAYERS):
        qkv = layer_norm(x, w[f"{i}.ln1_g"], w[f"{i}.ln1_b"]) @ w[f"{i}.qkv"] + w[f"{i}.qkv_b"]
        q, k, v = (qkv[..., j * DIM:(j + 1) * DIM].reshape(batch, seq, HEADS, HEAD).transpose(0, 2, 1, 3)
                   for j in range(3))
        attended = softmax(q @ k.transpose(0, 1, 3, 2) / np.sqrt(HEAD) + mask) @ v
        x = x + attended.transpose(0, 2, 1, 3).reshape(batch, seq, DIM) @ w[f"{i}.proj"] + w[f"{i}.proj_b"]
        h = layer_norm(x, w[f"{i}.ln2_g"], w[f"{i}.ln2_b"])
        x = x + gelu(h @ w[f"{i}.fc"] + w[f"{i}.fc_b"]) @ w[f"{i}.fc2"] + w[f"{i}.fc2_b"]
    return layer_norm(x, w["ln_g"], w["ln_b"]) @ w["out"]


def torch_reference(w: dict[str, np.ndarray], ids: np.ndarray, positions: np.ndarray, mask: np.ndarray,
                    device: str) -> np.ndarray:
    """The same model with torch.nn.functional (F.embedding, F.layer_norm, F.linear,
    F.scaled_dot_product_attention, F.gelu), float32 on `device`."""
    import torch
    import torch.nn.functional as F
    t = {k: torch.from_numpy(v).to(device) for k, v in w.items()}
    ids_t, pos_t = torch.from_numpy(ids).to(device), torch.from_numpy(positions).to(device)
    mask_t = torch.from_numpy(mask).to(device)
    batch, seq = ids.shape
    with torch.no_grad():
        x = F.embedding(ids_t, t["tokens"]) + F.embedding(pos_t, t["positions"])
        for i in range(LAYERS):
            h = F.layer_norm(x, (DIM,), t[f"{i}.ln1_g"], t[f"{i}.ln1_b"])
            qkv = F.linear(h, t[f"{i}.qkv"].T, t[f"{i}.qkv_b"])
            q, k, v = (qkv[..., j * DIM:(j + 1) * DIM].reshape(batch, seq, HEADS, HEAD).transpose(1, 2)
                       for j in range(3))
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_t)
            x = x + F.linear(attended.transpose(1, 2).reshape(batch, seq, DIM), t[f"{i}.proj"].T, t[f"{i}.proj_b"])
            h = F.layer_norm(x, (DIM,), t[f"{i}.ln2_g"], t[f"{i}.ln2_b"])
            x = x + F.linear(F.gelu(F.linear(h, t[f"{i}.fc"].T, t[f"{i}.fc_b"])), t[f"{i}.fc2"].T, t[f"{i}.fc2_b"])
        logits = F.linear(F.layer_norm(x, (DIM,), t["ln_g"], t["ln_b"]), t["out"].T)
    return logits.cpu().numpy()


def export(path: Path, device: str = "cpu") -> Path:
    """Compile the seeded model once, batch and sequence symbolic, into `path`."""
    import hexir
    specs = (hexir.TensorSpec(("batch", "seq"), "int64"), hexir.TensorSpec(("seq",), "int64"),
             hexir.TensorSpec(("seq", "seq"), "float32"))
    return hexir.export(decoder(weights()), path, *specs, placement="*=cuda" if device == "cuda" else None)


def generate(module, w, prompt: np.ndarray, steps: int, check_torch: str | None = None) -> np.ndarray:
    """Greedy generation with one module, the sequence growing by one token a step; each step's
    logits checked against the numpy reference (and torch's, on `check_torch`)."""
    ids = prompt
    for _ in range(steps):
        seq = ids.shape[1]
        positions, mask = np.arange(seq, dtype=np.int64), causal_mask(seq)
        logits = module.main(ids, positions, mask)
        reference = numpy_reference(w, ids, positions, mask)
        np.testing.assert_allclose(logits, reference, rtol=2e-4, atol=2e-4)
        if check_torch:
            np.testing.assert_allclose(logits, torch_reference(w, ids, positions, mask, check_torch),
                                       rtol=2e-4, atol=2e-4)
        chosen = logits[:, -1].argmax(-1)
        assert (chosen == reference[:, -1].argmax(-1)).all(), "hexir's next token differs from numpy's"
        ids = np.concatenate([ids, chosen[:, None].astype(np.int64)], axis=1)
    return ids


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", default=str(Path(__file__).parent))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--torch", action="store_true", help="also check against torch.nn.functional")
    args = parser.parse_args(argv)
    w = weights()
    path = Path(args.folder) / "transformer.hxb"
    started = time.perf_counter()
    export(path, args.device)
    compiled = time.perf_counter() - started
    module = hexir_runtime.load(path)
    prompt = np.array([[5, 17, 42, 8, 63], [1, 2, 3, 4, 5]], np.int64)
    torch_device = ("cuda" if args.device == "cuda" else "cpu") if args.torch else None
    ids = generate(module, w, prompt, 20, torch_device)
    print(f"compiled {path.name} in {compiled:.1f} s: {module.main.signature}")
    for row in ids:
        print("generated:", " ".join(map(str, row[prompt.shape[1]:])))
    print("every step's logits matched numpy's" + (" and torch's" if args.torch else "") + " (rtol 2e-4)")


if __name__ == "__main__":
    main(sys.argv[1:])
