"""The examples a newcomer runs first: each runs, checks itself against numpy, and the module
it exports gives, through `hexir-run`, what the jit call printed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run(command: list[str], cwd: Path) -> str:
    # the repository's packages first, whether installed or not (the examples run elsewhere)
    path = os.pathsep.join([str(REPO), str(REPO / "runtime"), os.environ.get("PYTHONPATH", "")])
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": path})
    assert result.returncode == 0, f"{command} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.mark.parametrize(("example", "module", "argument"), [
    ("mlp.py", "mlp.hxb", "x=x.npy"),
    ("split.py", "split.hxb", "x=x.npy"),
])
def test_example_runs_and_hexir_run_prints_the_same(tmp_path, example, module, argument):
    printed = run([sys.executable, str(REPO / "examples" / example)], tmp_path)
    assert "matches numpy" in printed
    program_output = printed.split("matches numpy")[0]
    assert program_output.strip(), "the example's hexir.print printed nothing"
    assert run([sys.executable, "-m", "hexir_runtime", module, "--device=cpu", "--input", argument, "--quiet"],
               tmp_path) == program_output


def test_custom_kernel_example_runs(tmp_path):
    example = REPO / "examples" / "custom_kernel"
    for item in ("run.py", "kernels"):
        (tmp_path / item).symlink_to(example / item)
    assert "matches numpy" in run([sys.executable, str(tmp_path / "run.py")], tmp_path)
    assert (tmp_path / "custom.hxb").exists()
    info = run([sys.executable, "-m", "hexir_runtime", "custom.hxb", "--info"], tmp_path)
    assert "source relu6.cu" in info and "from relu6.c" in info
