"""The compiler's import graph runs downward only (docs/architecture.md, "Layers").

Each module of `hexir/` belongs to a layer; a module may import modules of its own layer or
of layers below, never above. A module of no layer fails the test, so a new file must be
placed on purpose.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hexir"

#: Lowest first. A prefix names a module or a package (every module inside it).
LAYERS = [
    ("base", ("hexir.version", "hexir.errors", "hexir.target")),
    ("dialects", ("hexir.dialects",)),
    ("schedules", ("hexir.schedules",)),
    ("ops", ("hexir.ops",)),
    ("frontend, passes, backends", ("hexir.frontend", "hexir.passes", "hexir.backend")),
    ("driver", ("hexir.driver",)),
    ("api", ("hexir.jit", "hexir.cache", "hexir.explain", "hexir.cli", "hexir")),
]


def layer_of(module: str) -> int:
    for rank, (_, prefixes) in enumerate(LAYERS):
        if module in prefixes or any(module.startswith(p + ".") for p in prefixes if p != "hexir"):
            return rank
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def hexir_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of a hexir module in `path`, top level or inside functions."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            # `from hexir.dialects import hextir` imports the module hexir.dialects.hextir
            target = next((n for n in reversed(names) if (PACKAGE.parent / n.replace(".", "/")).with_suffix(".py")
                           .exists() or (PACKAGE.parent / n.replace(".", "/")).is_dir()), node.module)
            found.append((node.lineno, target))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
    return [(line, name) for line, name in found if name == "hexir" or name.startswith("hexir.")]


def test_every_import_points_down():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = module_name(path)
        for line, imported in hexir_imports(path):
            if imported == "hexir" and importer != "hexir":
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports the hexir package itself")
            elif layer_of(imported) > layer_of(importer):
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {importer} "
                              f"({LAYERS[layer_of(importer)][0]}) imports {imported} ({LAYERS[layer_of(imported)][0]})")
    assert not upward, "imports that point up a layer:\n" + "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path):
    bad = PACKAGE / "passes" / "zz_upward_probe.py"
    bad.write_text("from hexir.driver import Options\n")
    try:
        assert any(name == "hexir.driver" for _, name in hexir_imports(bad))
        assert layer_of("hexir.driver") > layer_of(module_name(bad))
    finally:
        bad.unlink()


def test_no_cycles_at_import_time():
    """Every module imports on its own in a fresh interpreter (a cycle fails here)."""
    import subprocess
    import sys

    modules = sorted({module_name(p) for p in PACKAGE.rglob("*.py")})
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    for module in modules:
        result = subprocess.run([sys.executable, "-c", code, module], capture_output=True, text=True)
        assert result.returncode == 0, f"importing {module} alone failed:\n{result.stderr[-2000:]}"
