"""The CPU ≡ GPU suite on a real GPU: `tests/gpu/suite.py run` over the cases in bench/gpu_cases.

The GPU machine has no MLIR, so nothing is compiled here: the cases are built beforehand where
hexir is installed (`python tests/gpu/suite.py build bench/gpu_cases`), and this file imports
only `hexir_runtime`. The tests marked `gpu` skip, saying why, where cuda-python or a usable
GPU is missing or the cases have not been built; the unmarked one checks, on any machine, that
this file and the suite's `run` half work in a Python that cannot import `hexir` or `mlir`.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hexir_runtime import DeviceError

REPO = Path(__file__).resolve().parents[2]
SUITE = REPO / "tests" / "gpu" / "suite.py"
CASES = REPO / "bench" / "gpu_cases"
ENVIRONMENT = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "runtime"), os.environ.get("PYTHONPATH", "")])}


def gpu_unavailable() -> str | None:
    """Why this process cannot run CUDA kernels, or None if it can."""
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError as error:
        return f"cuda-python is not installed: cannot import cuda.bindings ({error})"
    from hexir_runtime.cuda import CudaDevice

    try:
        CudaDevice()
    except DeviceError as error:
        return f"no usable GPU: {error}"
    return None


@pytest.fixture(scope="module")
def gpu() -> None:
    reason = gpu_unavailable()
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.gpu
def test_the_runtime_sees_the_gpu(gpu):
    from hexir_runtime.cuda import CudaDevice

    device = CudaDevice()
    assert device.name.startswith("cuda (") and device.name.endswith(")")
    assert device.capability >= (7, 5)


@pytest.mark.gpu
def test_cuda_agrees_with_the_cpu_and_numpy_on_every_case(gpu):
    if not (CASES / "cases.json").is_file():
        pytest.skip(f"no cases in {CASES}: build them where hexir is installed with "
                    "`python tests/gpu/suite.py build bench/gpu_cases`")
    result = subprocess.run([sys.executable, str(SUITE), "run", str(CASES)], cwd=REPO, env=ENVIRONMENT,
                            capture_output=True, text=True, timeout=1800)
    report = f"{SUITE.name} run {CASES} exited with {result.returncode}:\n{result.stdout}{result.stderr}"
    assert result.returncode == 0, report
    assert "FAIL" not in result.stdout, report


BLOCK_THE_COMPILER = """
import runpy, sys
for name in ("mlir", "hexir"):
    sys.modules[name] = None  # every import of them now raises ImportError
runpy.run_path(sys.argv[1])
suite = runpy.run_path(sys.argv[2])
sys.exit(suite["main"](["run", sys.argv[3], "--devices", "cpu"]))
"""


def test_this_file_and_the_suite_run_half_need_no_compiler(tmp_path):
    for node in ast.walk(ast.parse(Path(__file__).read_text())):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        assert not [name for name in names if name.split(".")[0] in ("mlir", "hexir")], ast.unparse(node)
    (tmp_path / "cases.json").write_text(json.dumps([]))
    result = subprocess.run([sys.executable, "-c", BLOCK_THE_COMPILER, __file__, str(SUITE), str(tmp_path)],
                            cwd=REPO, env=ENVIRONMENT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "cases         : 0" in result.stdout
