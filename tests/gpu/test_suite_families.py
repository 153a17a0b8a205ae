"""The GPU suite's op-family half (families.py) here, on the cpu: it covers the registry, its
numpy formulas agree with what hexir compiles, and its comparison catches a wrong value."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hexir_runtime
import numpy as np
from hexir_runtime import format as hxb

from hexir import ops

sys.path.insert(0, str(Path(__file__).resolve().parent))
import families  # noqa: E402
import suite  # noqa: E402


def test_every_registered_pointwise_and_reduce_op_is_a_case():
    covered = {(o["op"], g["dtype"]) for g in families.groups() for o in g["outputs"] if o["what"] == "op"}
    for name, definition in ops.REGISTRY.items():
        if definition.family in ("pointwise", "reduce"):
            assert {(name, "float32"), (name, "float64")} <= covered, name


def test_a_built_group_passes_on_the_cpu_and_a_wrong_value_fails(tmp_path, monkeypatch):
    chosen = [g for g in families.groups() if g["label"] == "chains linear_gelu" or
              (g["label"] == "reduce ops, middle axis of rank 3, keepdims" and g["dtype"] == "float32")]
    monkeypatch.setattr(families, "groups", lambda: chosen)
    suite.build(tmp_path, 0, "families")
    cases = json.loads((tmp_path / "cases.json").read_text())
    assert len(cases) == 2
    checked, failures, used = suite.run_families(tmp_path, cases, ("cpu",), np.random.default_rng(0))
    assert not failures and checked == len(families.BATCHES) * sum(len(c["outputs"]) for c in cases)
    assert 0 < used["cpu"] <= 1
    output = cases[0]["outputs"][-1]  # (a float result: the sum)
    arrays = families.draw(cases[0], np.random.default_rng(1), 7)
    want = families.expected(output, arrays)
    wrong = want.copy()
    wrong.flat[3] += 10 * sum(families.tolerance(output, cases[0]["dtype"])) * (1 + abs(wrong.flat[3]))
    assert families.compare(output, cases[0]["dtype"], want, want) is None
    assert "1 of" in families.compare(output, cases[0]["dtype"], wrong, want)


def test_the_matmul_chains_pass_on_the_cpu(tmp_path, monkeypatch):
    """#24's matmul chains (batched, broadcast, a 1-D operand, attention) as the H200 runs them."""
    chosen = [g for g in families.groups() if "matmul_rows" in g["label"] and g["dtype"] == "float32"]
    assert len(chosen) == 1 and any(o["name"] == "attention_129" for o in chosen[0]["outputs"])
    monkeypatch.setattr(families, "groups", lambda: chosen)
    monkeypatch.setattr(families, "BATCHES", [0, 1, 7])  # (the H200 runs 129 and 1000 too)
    suite.build(tmp_path, 0, "families")
    cases = json.loads((tmp_path / "cases.json").read_text())
    checked, failures, _ = suite.run_families(tmp_path, cases, ("cpu",), np.random.default_rng(0))
    assert not failures and checked == 3 * len(cases[0]["outputs"])


def test_attention_over_a_symbolic_sequence_passes_on_the_cpu(tmp_path, monkeypatch):
    """q[3, seq, 64] with the sequence the symbol, at lengths 1, 7, 129 and 1000, as the H200 runs it;
    unfused (kT given) and fused (#25: k given, head size 128)."""
    chosen = [g for g in families.groups() if g["label"] == "chains attention_seq, attention_fused_seq"
              and g["dtype"] == "float32"]
    monkeypatch.setattr(families, "groups", lambda: chosen)
    suite.build(tmp_path, 0, "families")
    cases = json.loads((tmp_path / "cases.json").read_text())
    checked, failures, _ = suite.run_families(tmp_path, cases, ("cpu",), np.random.default_rng(0))
    assert not failures and checked == 2 * len(families.SEQUENCES)
    kernels = hxb.decode((tmp_path / f"{cases[0]['name']}.hxb").read_bytes()).json["kernels"]
    assert [k["op"] for k in kernels if k["device"] == "cuda"] == ["matmul", "reduce", "matmul", "attention"]


def test_the_layout_groups_pass_on_the_cpu_and_an_id_out_of_range_is_refused(tmp_path, monkeypatch):
    chosen = [g for g in families.groups() if g["label"] in ("layout ops", "take, an id out of range")]
    assert len(chosen) == 3  # layout ops in float32 and float64, and the bad id
    monkeypatch.setattr(families, "groups", lambda: chosen)
    suite.build(tmp_path, 0, "families")
    cases = json.loads((tmp_path / "cases.json").read_text())
    checked, failures, _ = suite.run_families(tmp_path, cases, ("cpu",), np.random.default_rng(0))
    assert not failures and checked == 2 * len(families.BATCHES) * len(families.LAYOUTS)
    bad = next(c for c in cases if "bad_id" in c)  # (the run above refused its id on the cpu and the reference)
    bad["inputs"][1]["ids"] = 5  # an id of 5 is in range for the table's 11 rows: the check must say so
    module = hexir_runtime.load(tmp_path / f"{bad['name']}.hxb", device="cpu")
    assert suite._bad_id(bad, {"cpu": module}, np.random.default_rng(0), "case") == [
        "case on cpu: an id out of range was not refused"]


def test_the_16_bit_groups_pass_on_the_cpu(tmp_path, monkeypatch):
    """#26: bfloat16 and float16, every registered op and the fused chains of each kind (the
    linears' and matmuls' between casts), computed in float32, within families.TOL."""
    chosen = [{**g, "outputs": [o for o in g["outputs"] if o["what"] != "op" or hasattr(families.NUMPY, o["op"])]}
              for g in families.groups() if g["dtype"] in families.HALVES and "long" not in g["label"]]
    chosen = [g for g in chosen if g["outputs"]]  # (the built-in ops: other tests register ops of their own)
    assert {(o["op"], g["dtype"]) for g in chosen for o in g["outputs"] if o["what"] == "op"} >= {
        (name, dtype) for name, d in ops.REGISTRY.items() if d.family in ("pointwise", "reduce")
        and hasattr(families.NUMPY, name) for dtype in families.HALVES}
    monkeypatch.setattr(families, "groups", lambda: chosen)
    monkeypatch.setattr(families, "BATCHES", [0, 7])  # (the H200 runs 1, 129 and 1000 too)
    suite.build(tmp_path, 0, "families")
    cases = json.loads((tmp_path / "cases.json").read_text())
    checked, failures, used = suite.run_families(tmp_path, cases, ("cpu",), np.random.default_rng(0))
    assert not failures and checked == 2 * sum(len(c["outputs"]) for c in cases)
    assert 0 < used["cpu"] <= 1
