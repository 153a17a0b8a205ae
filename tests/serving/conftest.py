"""Models for the serving tests, compiled once per session by hexir:

- `mlp_model`: mlp.hxb, `main(x: float32[batch, 784]) -> float32[batch, 10]` (relu(x @ W1) @ W2,
  and a hexir.print that a served call must leave out); `mlp_reference(x)` computes it in numpy;
- `static_model`: static.hxb, `main(x: float64[3, 5]) -> float64[3, 4]` (no symbol: each request
  runs alone); `static_reference(x)`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import hexir

_rng = np.random.default_rng(27)
W1 = (_rng.standard_normal((784, 64)) * 0.05).astype(np.float32)
W2 = (_rng.standard_normal((64, 10)) * 0.1).astype(np.float32)
W3 = _rng.standard_normal((5, 4))


def mlp_reference(x: np.ndarray) -> np.ndarray:
    return np.maximum(x @ W1, 0) @ W2


def static_reference(x: np.ndarray) -> np.ndarray:
    return np.maximum(x @ W3, 0)


@hexir.jit
def _mlp(x):
    y = hexir.linear(hexir.relu(hexir.linear(x, W1)), W2)
    hexir.print(y)
    return y


@hexir.jit
def _static(x):
    return hexir.relu(hexir.linear(x, W3))


@pytest.fixture(scope="session")
def models_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("served")
    hexir.export(_mlp, folder / "mlp.hxb", hexir.TensorSpec(("batch", 784), "float32"))
    hexir.export(_static, folder / "static.hxb", hexir.TensorSpec((3, 5), "float64"))
    return folder


@pytest.fixture(scope="session")
def mlp_model(models_folder) -> Path:
    return models_folder / "mlp.hxb"


@pytest.fixture(scope="session")
def static_model(models_folder) -> Path:
    return models_folder / "static.hxb"
