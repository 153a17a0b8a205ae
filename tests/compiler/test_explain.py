"""The placement picture: `hexir.explain` and `hexir -emit=dot` give the same DOT text of the
placed graph, fused kernels as one node, devices as colours, transfers as edges with bytes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

import hexir
from hexir.explain import COLORS

REPO = Path(__file__).resolve().parents[2]
SPLIT = REPO / "examples" / "split.py"
rng = np.random.default_rng(3)
W1 = rng.standard_normal((8, 16)).astype(np.float32)
W2 = rng.standard_normal((16, 4)).astype(np.float32)


def nodes(text: str) -> dict[str, tuple[str, str]]:
    """node id -> (label, fill colour)."""
    return {m[1]: (m[2], m[3]) for m in re.finditer(r'^  (\w+) \[label="([^"]*)".*fillcolor="([^"]*)"', text, re.M)}


def edges(text: str) -> dict[tuple[str, str], str]:
    """(source, target) -> label ("" for an edge within a device)."""
    return {(m[1], m[2]): m[4] or "" for m in re.finditer(r'^  (\w+) -> (\w+)( \[label="([^"]*)")?', text, re.M)}


def test_a_fused_kernel_is_one_node_and_transfers_carry_bytes():
    @hexir.jit
    def f(x):
        with hexir.on("cuda"):
            h = hexir.relu(hexir.linear(x, W1))
        return hexir.linear(h, W2)

    text = hexir.explain(f, hexir.TensorSpec(("batch", 8), "float32"))
    assert text.startswith("digraph hexir {") and text.endswith("}\n")
    labels = {label: colour for label, colour in nodes(text).values()}
    assert labels == {"x\\nfloat32[batch, 8]": COLORS["cpu"],
                      "linear → max(a0, 0) (W1)\\nfloat32[batch, 16]": COLORS["cuda"],
                      "linear (W2)\\nfloat32[batch, 4]": COLORS["cpu"], "return": COLORS["cpu"]}
    by_label = {label.split("\\n")[0]: node for node, (label, _) in nodes(text).items()}
    assert edges(text) == {(by_label["x"], by_label["linear → max(a0, 0) (W1)"]): "batch × 32 B",
                           (by_label["linear → max(a0, 0) (W1)"], by_label["linear (W2)"]): "batch × 64 B",
                           (by_label["linear (W2)"], by_label["return"]): ""}


def test_static_shapes_give_byte_counts_and_placement_overrides():
    text = hexir.explain(lambda x: hexir.linear(x, W1), np.ones((4, 8), np.float32), placement="hexir.linear=cuda")
    assert set(edges(text).values()) == {"128 B", "256 B"}  # 4×8 floats in, 4×16 out


def test_the_command_prints_what_explain_returns():
    path = os.pathsep.join([str(REPO), str(REPO / "runtime"), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "hexir.cli", f"{SPLIT}:mlp", "-spec=x=batchx8xf32", "--emit=dot"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 0, done.stderr
    sys.path.insert(0, str(SPLIT.parent))
    try:
        import split
    finally:
        sys.path.pop(0)
    assert done.stdout == hexir.explain(split.mlp, hexir.TensorSpec(("batch", 8), "float32"))
    assert '"relu\\nfloat32[batch, 16]"' in done.stdout and "linear (W2, B2)" in done.stdout


def test_a_transfer_with_two_users_is_one_edge_with_its_bytes_that_fans_out():
    def f(x):
        with hexir.on("cuda"):
            h = hexir.relu(hexir.linear(x, W1))
        return hexir.linear(h, W2), hexir.relu(h)  # both on the cpu: h crosses once

    text = hexir.explain(f, hexir.TensorSpec(("batch", 8), "float32"))
    by_label = {label.split("\\n")[0]: node for node, (label, _) in nodes(text).items()}
    moved = {pair: label for pair, label in edges(text).items() if label}
    assert sorted(moved.values()) == ["batch × 32 B", "batch × 64 B"]  # x in, h back: one edge each
    ((source, junction),) = [pair for pair, label in moved.items() if label == "batch × 64 B"]
    assert source == by_label["linear → max(a0, 0) (W1)"] and junction not in nodes(text)
    assert {target for (start, target) in edges(text) if start == junction} == {by_label["linear (W2)"],
                                                                                by_label["relu"]}
