"""The cpu attention kernel (schedules/cpu_attention.py) against numpy (float64) over the shapes
its tiles meet: one query row or key, rows not a multiple of a work item's rows, keys not a
multiple of a block or of a mask tile, head sizes not a multiple of a vector; every kind of
mask (per row and key with rows masked whole: NaN, as the unfused softmax gives; per key,
broadcast over rows; per row, broadcast over keys; one element); float32 and float64. Then a
module built for several x86-64 levels (the widest level's tiles fix the work record every
level's kernel walks) and the AVX-512 tiles run on this host's level."""

from __future__ import annotations

import numpy as np
import pytest
from hexir_runtime import format as hxb
from hexir_runtime import load

import hexir
from hexir import TensorSpec
from hexir.driver import Options, parse_placement
from hexir.jit import JitFunction
from hexir.schedules import cpu
from hexir.target import host_level, parse_target

RNG = np.random.default_rng(9)


def _mask(kind: str, batch: tuple, sq: int, sk: int, dtype: str) -> np.ndarray | None:
    if kind == "causal":  # the last key rows see, and rows 1 and sq - 2 masked whole
        mask = np.triu(np.full((sq, sk), -np.inf, dtype), k=1 + max(sk - sq, 0))
        mask[[1, sq - 2] if sq > 2 else []] = -np.inf
        return mask
    if kind == "padding":  # keys past a length per batch index
        mask = np.zeros((batch[0], 1, 1, sk), dtype)
        mask[0, ..., sk // 2 + 1:] = -np.inf
        return mask
    shapes = {"rows": (sq, 1), "keys": (sk,), "one": (1,)}
    return RNG.standard_normal(shapes[kind]).astype(dtype) if kind in shapes else None


def _run(batch, sq, sk, d, dv, dtype, kind, target="cpu:host"):
    mask = _mask(kind, batch, sq, sk, dtype)
    q = RNG.standard_normal((*batch, sq, d)).astype(dtype)
    k = RNG.standard_normal((*batch, sk, d)).astype(dtype)
    v = RNG.standard_normal((*batch, sk, dv)).astype(dtype)
    axes = (*range(len(batch)), len(batch) + 1, len(batch))

    def function(q, k, v, mask=None):
        scores = q @ k.transpose(*axes) * (1 / np.sqrt(d))
        return hexir.softmax(scores if mask is None else scores + mask, axis=-1) @ v

    args = [q, k, v] + ([] if mask is None else [mask])
    data = JitFunction(function, Options(placement=parse_placement(None), target=parse_target(target))).compile(
        *[TensorSpec(a.shape, dtype) for a in args])
    assert [k["op"] for k in hxb.decode(data).json["kernels"]] == ["attention"]
    scores = q.astype(np.float64) @ np.swapaxes(k, -1, -2) / np.sqrt(d) + (0 if mask is None else mask)
    with np.errstate(invalid="ignore"):
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        want = weights / weights.sum(-1, keepdims=True) @ v
    got = load(data, "cpu").main(*args)
    assert (np.isnan(got) == np.isnan(want)).all() and np.isnan(want).any() == (kind == "causal" and sq > 2)
    tight = dtype == "float64"
    np.testing.assert_allclose(got, want, rtol=1e-12 if tight else 2e-5, atol=1e-13 if tight else 2e-6)


@pytest.mark.parametrize("batch, sq, sk, d, dv, dtype, kind", [
    ((1, 1), 1, 1, 64, 64, "float32", "none"),
    ((2, 3), 1, 300, 64, 64, "float32", "padding"),
    ((2, 2), 97, 97, 64, 64, "float32", "causal"),
    ((1, 2), 200, 193, 128, 128, "float32", "causal"),
    ((2,), 50, 5, 40, 24, "float32", "causal"),
    ((3, 1), 33, 100, 16, 40, "float32", "rows"),
    ((2, 2), 17, 130, 64, 72, "float32", "keys"),
    ((1, 3), 9, 9, 8, 8, "float32", "one"),
    ((2, 2), 70, 250, 64, 64, "float64", "causal"),
    ((1, 1), 129, 97, 128, 40, "float64", "padding"),
    ((2, 1), 3, 7, 24, 24, "float64", "none"),
])
def test_attention_is_numpys_at_every_edge_of_the_tiles(batch, sq, sk, d, dv, dtype, kind):
    _run(batch, sq, sk, d, dv, dtype, kind)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_module_for_several_levels_walks_the_widest_levels_items_on_each(dtype):
    """The work record is the module's, one for its libraries of every level: each level's kernel
    must cover the same query rows an item (the AVX-512 NR's), whichever one this host runs."""
    _run((2, 3), 200, 150, 64, 64, dtype, "causal", target="cpu:x86-64-v4,cpu:x86-64-v3,cpu:x86-64")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_avx512_tiles_on_this_hosts_level(monkeypatch, dtype):
    """The widest tiles (NR x NR mask tiles, 32 x 32 in float32), built and run at this host's level."""
    monkeypatch.setitem(cpu.MICRO, (host_level(), dtype), cpu.MICRO["x86-64-v4", dtype])
    _run((2, 1), 100, 150, 64, 40, dtype, "causal")
