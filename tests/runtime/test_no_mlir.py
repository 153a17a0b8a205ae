"""The runtime stands alone: it imports and runs a module in a Python where `import mlir` and
`import hexir` are impossible."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

RUNTIME = Path(__file__).parents[2] / "runtime"

# Setting a module to None in sys.modules makes every later import of it raise ImportError.
BLOCK = "import sys\nfor name in ('mlir', 'hexir'):\n    sys.modules[name] = None\n"

PROGRAM = BLOCK + """
try:
    import mlir
except ImportError:
    pass
else:
    raise SystemExit('mlir was importable')
import numpy as np
import hexir_runtime
module = hexir_runtime.load(sys.argv[1], device='cpu')
print(module.main(np.load(sys.argv[2])).shape)
import runpy
sys.argv = ['hexir-run', sys.argv[1], '--quiet', '--input', 'x=' + sys.argv[2]]
try:
    runpy.run_module('hexir_runtime', run_name='__main__')
except SystemExit as exit:
    assert exit.code == 0, exit.code
leaked = sorted(name for name in sys.modules if name.split('.')[0] in ('mlir', 'hexir') and sys.modules[name])
assert not leaked, leaked
"""


def test_runs_where_mlir_cannot_be_imported(mlp_file, tmp_path):
    np.save(tmp_path / "x.npy", np.ones((2, 8), np.float32))
    environment = {**os.environ, "PYTHONPATH": str(RUNTIME) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(mlp_file), str(tmp_path / "x.npy")],
        capture_output=True, text=True, env=environment,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 5 and lines[2] == "(2, 4)"  # main() prints 2 rows, then the shape, then hexir-run


def test_no_source_file_imports_the_compiler():
    for path in sorted((RUNTIME / "hexir_runtime").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            assert not [name for name in names if name.split(".")[0] in ("mlir", "hexir")], path
