"""The examples a newcomer runs first: each runs, checks itself against numpy (the classifier
against scikit-learn), writes its files into the folder it is given (next to itself by default)
without touching another's, and the module it exports gives, through `hexir-run`, what the jit
call printed or returned; mlp.hxb and classifier.hxb serve any batch. (What `hexir.print` wrote
is compared number by number to float32's rounding: a cuda kernel's cpu fallback in an exported
module is built for baseline x86-64, without FMA, where the jit builds it for the host's level.)"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def run(command: list[str], cwd: Path) -> str:
    # the repository's packages first, whether installed or not (the examples run elsewhere)
    path = os.pathsep.join([str(REPO), str(REPO / "runtime"), os.environ.get("PYTHONPATH", "")])
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": path})
    assert result.returncode == 0, f"{command} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def hexir_run(*argv: str, cwd: Path) -> str:
    return run([sys.executable, "-m", "hexir_runtime", *argv], cwd)


@pytest.mark.parametrize(("example", "files"), [
    ("mlp.py", {"mlp.hxb", "mlp_x2.npy", "mlp_x5.npy"}),
    ("split.py", {"split.hxb", "split_x.npy"}),
])
def test_example_runs_and_hexir_run_prints_the_same(tmp_path, example, files):
    out, elsewhere = tmp_path / "out", tmp_path / "cwd"
    out.mkdir(), elsewhere.mkdir()
    printed = run([sys.executable, str(REPO / "examples" / example), str(out)], elsewhere)
    assert "matches numpy" in printed
    assert {p.name for p in out.iterdir()} == files and not list(elsewhere.iterdir())
    program_output = printed.split("matches numpy")[0]
    assert program_output.strip(), "the example's hexir.print printed nothing"
    module, x = sorted(files)[0], sorted(files)[1]
    _same_print(hexir_run(module, "--device=cpu", "--input", f"x={x}", "--quiet", cwd=out), program_output)


def _same_print(got: str, want: str) -> None:
    """The same text, its numbers equal to float32's rounding (1e-6 of the largest)."""
    def parts(text: str) -> tuple[list[str], list[float]]:
        words, numbers = [], []
        for token in text.split():
            try:
                numbers.append(float(token))
            except ValueError:
                words.append(token)
        return words, numbers
    (got_words, got_numbers), (want_words, want_numbers) = parts(got), parts(want)
    assert got_words == want_words and len(got_numbers) == len(want_numbers) > 0, (got, want)
    scale = max(map(abs, want_numbers))
    np.testing.assert_allclose(got_numbers, want_numbers, rtol=0, atol=1e-6 * scale + 2e-6)


def test_one_mlp_module_runs_two_batch_sizes(tmp_path):
    run([sys.executable, str(REPO / "examples" / "mlp.py"), str(tmp_path)], tmp_path)
    sys.path.insert(0, str(REPO / "examples"))
    try:
        from mlp import W1, W2
    finally:
        sys.path.pop(0)
    assert "main(x: float32[batch, 8]) -> float32[batch, 4]" in hexir_run("mlp.hxb", "--info", cwd=tmp_path)
    for rows in (2, 5):
        x = np.load(tmp_path / f"mlp_x{rows}.npy")
        assert x.shape == (rows, 8)
        printed = hexir_run("mlp.hxb", "--input", f"x=mlp_x{rows}.npy", "--output", "y.npz", cwd=tmp_path)
        assert f"float32[{rows}, 4]" in printed
        np.testing.assert_allclose(np.load(tmp_path / "y.npz")["output0"], np.maximum(x @ W1, 0) @ W2, rtol=1e-5)


def test_custom_kernel_example_runs(tmp_path):
    example = REPO / "examples" / "custom_kernel"
    for item in ("run.py", "kernels"):
        (tmp_path / item).symlink_to(example / item)
    assert "matches numpy" in run([sys.executable, str(tmp_path / "run.py")], tmp_path)
    assert (tmp_path / "custom.hxb").exists()
    info = hexir_run("custom.hxb", "--info", cwd=tmp_path)
    assert "source relu6.cu" in info and "from relu6.c" in info


def test_classifier_example_gives_scikit_learns_answers_through_hexir_run(tmp_path):
    pytest.importorskip("sklearn", reason="the classifier example needs scikit-learn (the dev install brings it)")
    out, elsewhere = tmp_path / "out", tmp_path / "cwd"
    out.mkdir(), elsewhere.mkdir()
    printed = run([sys.executable, str(REPO / "examples" / "classifier.py"), str(out)], elsewhere)
    assert {p.name for p in out.iterdir()} == {"classifier.hxb", "classifier_x.npy"} and not list(elsewhere.iterdir())
    # the example's own network: its training is deterministic, so importing it trains the same one
    spec = importlib.util.spec_from_file_location("classifier_example", REPO / "examples" / "classifier.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    net, x_test = example.net, example.x_test
    assert f"the first ten predicted {net.predict(x_test[:10]).tolist()}" in printed
    assert f"hexir float64: all {len(x_test)} predictions equal scikit-learn's" in printed

    info = hexir_run("classifier.hxb", "--info", cwd=out)
    assert "main(x: float64[batch, 64]) -> (int64[batch], float64[batch, 10])" in info
    x = np.load(out / "classifier_x.npy")
    np.testing.assert_array_equal(x, x_test[:5])
    shown = hexir_run("classifier.hxb", "--input", "x=classifier_x.npy", "--output", str(tmp_path / "y.npz"),
                      cwd=out)
    predicted = net.predict(x)
    assert f"output0: int64[5]\n{predicted}\n" in shown  # the class indices printed as integers
    assert "output1: float64[5, 10]" in shown
    y = np.load(tmp_path / "y.npz")
    assert y["output0"].dtype == np.int64
    np.testing.assert_array_equal(net.classes_[y["output0"]], predicted)
    np.testing.assert_allclose(y["output1"], net.predict_proba(x), rtol=1e-12, atol=0)


def test_transformer_example_generates_with_one_module_and_hexir_run_gives_its_logits(tmp_path):
    """examples/transformer.py exports one module (batch and sequence symbolic), generates 20
    tokens checking every step's logits against its numpy reference; hexir-run then gives the
    same logits for a prompt of another length from .npy files (int64 ids and positions)."""
    out, elsewhere = tmp_path / "out", tmp_path / "cwd"
    out.mkdir(), elsewhere.mkdir()
    printed = run([sys.executable, str(REPO / "examples" / "transformer.py"), str(out)], elsewhere)
    assert "every step's logits matched numpy's" in printed and printed.count("generated:") == 2
    assert {p.name for p in out.iterdir()} == {"transformer.hxb"} and not list(elsewhere.iterdir())
    from hexir_runtime import format as hxb
    module = hxb.decode((out / "transformer.hxb").read_bytes())
    kernels = [k["op"] for k in module.json["kernels"]]
    calls = [kernels[c.kernel] for entry in module.manifest.entries for c in entry.program if c.op == "call"]
    assert "matmul" not in kernels and kernels.count("attention") == 1  # (#25: fused; the blocks share it)
    moves = {k["expr"]["kind"] for k in module.json["kernels"] if k["op"] == "layout"}
    assert moves == {"take"}, moves  # (#25: q, k, v and the heads merged read and written in place)
    assert calls.count("attention") == 2  # one call a block
    spec = importlib.util.spec_from_file_location("transformer_example", REPO / "examples" / "transformer.py")
    model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model)
    ids = np.array([[3, 1, 4, 1, 5, 9, 2]], np.int64)
    positions, mask = np.arange(7, dtype=np.int64), model.causal_mask(7)
    for name, array in (("ids", ids), ("positions", positions), ("mask", mask)):
        np.save(out / f"{name}.npy", array)
    hexir_run("transformer.hxb", "--input", "ids=ids.npy", "--input", "positions=positions.npy",
              "--input", "mask=mask.npy", "--output", str(tmp_path / "logits.npz"), cwd=out)
    logits = np.load(tmp_path / "logits.npz")
    (got,) = [logits[k] for k in logits.files]
    np.testing.assert_allclose(got, model.numpy_reference(model.weights(), ids, positions, mask), rtol=2e-4, atol=2e-4)
