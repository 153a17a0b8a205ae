"""`hexir` on the command line: every -emit stage from a Python function or a .mlir file, and the
exit codes: 0 success, 1 the input could not be compiled or read, 2 bad arguments."""

# IR lines are checked as printed: wrapping them would change what they check.
# ruff: noqa: E501

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from hexir.cli import main
from hexir.driver import STAGES

from .conftest import MLP, REPO, family_attrs, manifest

MAGIC = b"\x89HXB\r\n\x1a\n"
PYTHON_INPUT = [f"{MLP}:mlp", "-spec=x=2x8xf32"]

PROGRAM = f"""\
func.func @main(%arg0: tensor<2x8xf32>) -> tensor<2x4xf32> {{
  %0 = "hexir.constant"() {{device = "auto", name = "W", value = dense<0.25> : tensor<8x4xf32>}} : () -> tensor<8x4xf32>
  %1 = "hexir.linear"(%arg0, %0) {{device = "auto", operandSegmentSizes = array<i32: 1, 1, 0, 0, 0, 0, 0>}} : (tensor<2x8xf32>, tensor<8x4xf32>) -> tensor<2x4xf32>
  %2 = "hexir.relu"(%1) {{device = "auto", {family_attrs("relu")}}} : (tensor<2x4xf32>) -> tensor<2x4xf32>
  "hexir.print"(%2) : (tensor<2x4xf32>) -> ()
  return %2 : tensor<2x4xf32>
}}
"""
RELU = ["max", ["arg", 0], ["const", 0.0]]  # relu's tree: the expr of a linear it is fused into
PLAIN = ["arg", 0]  # a linear's sums as they are

# what the output of each text stage must show (and, for the first ones, must no longer show)
STAGE_SHOWS = {
    "mlir": (['"hexir.linear"', 'device = "auto"'], ["hexir.call"]),
    "mlir-hetero": (['"hexir.linear"', 'device = "cpu"'], ['"auto"', "hexir.call"]),
    "mlir-tir": (["hextir.kernel", '#hextir.loop<"parallel", "chunk">', '"hextir.chunk_end"', '"hexir.call"',
                  'hextir.work = {extent = "1", grain = 1 : i64, spans = true}'], ['"hexir.linear"']),
    "mlir-linalg": (["memref.load", 'hextir.work = {extent = "1", grain = 1 : i64, spans = true}'],
                    ["hextir.load", "hextir.schedule", "hextir.chunk_end"]),
    "mlir-gpu": (["memref.load", 'hextir.work = {extent = "1", grain = 1 : i64, spans = true}'], ["hextir.load"]),
    "llvm": (["define void @linear_", "(ptr noalias", "i64"], ["hexir"]),
    "ptx": (["// no cuda kernels"], [".entry"]),  # all on the cpu: see the test of -emit=ptx below
}


@pytest.fixture
def program(tmp_path):
    path = tmp_path / "prog.mlir"
    path.write_text(PROGRAM)
    return path


def _check_stage_output(stage: str, text: str) -> None:
    shows, hides = STAGE_SHOWS[stage]
    for needle in shows:
        assert needle in text, f"-emit={stage} lacks {needle!r}"
    for needle in hides:
        assert needle not in text, f"-emit={stage} still has {needle!r}"


@pytest.mark.parametrize("stage", STAGE_SHOWS)
def test_every_text_stage_from_python(stage, capsys):
    assert main([*PYTHON_INPUT, f"-emit={stage}"]) == 0
    _check_stage_output(stage, capsys.readouterr().out)


@pytest.mark.parametrize("stage", STAGE_SHOWS)
def test_every_text_stage_from_mlir(stage, program, capsys):
    assert main([str(program), f"-emit={stage}"]) == 0
    _check_stage_output(stage, capsys.readouterr().out)


def test_emit_ptx_prints_each_target_architectures_ptx(program, capsys):
    assert main([str(program), "-emit=ptx", "-placement=*=cuda", "-target=cuda:sm_80,cuda:sm_90a"]) == 0
    text = capsys.readouterr().out
    first, second = text.split("// ---- sm_90a\n")
    assert first.startswith("// ---- sm_80\n") and "\n.target sm_80\n" in first and ".entry linear_" in first
    assert "\n.target sm_90a\n" in second and ".entry linear_" in second


def test_stage_list_is_the_pipeline():
    assert list(STAGE_SHOWS) + ["hxb"] == [name for name, _ in STAGES]


@pytest.mark.parametrize("source", ["python", "mlir"])
def test_hxb_is_written_with_its_magic(source, program, tmp_path, capsys):
    output = tmp_path / "out" / "m.hxb"
    output.parent.mkdir()
    argv = PYTHON_INPUT if source == "python" else [str(program)]
    assert main([*argv, "-emit=hxb", "-o", str(output)]) == 0
    data = output.read_bytes()
    assert data.startswith(MAGIC)
    assert f"wrote {output}" in capsys.readouterr().err
    kernels = manifest(data)["kernels"]
    # both programs' relu is the only user of a linear on its device: fused into it
    expected = [("linear", RELU), ("linear", PLAIN)] if source == "python" else [("linear", RELU)]
    assert [(k["op"], k["expr"]) for k in kernels] == expected


def test_hxb_defaults_to_out_hxb(program, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([str(program), "-emit=hxb"]) == 0
    assert (tmp_path / "out.hxb").read_bytes().startswith(MAGIC)


def test_o_writes_the_text_instead_of_printing_it(program, tmp_path, capsys):
    output = tmp_path / "prog.tir.mlir"
    assert main([str(program), "-emit=mlir-tir", "-o", str(output)]) == 0
    assert capsys.readouterr().out == ""
    assert "hextir.kernel" in output.read_text()


def test_output_of_a_stage_is_valid_input(program, tmp_path, capsys):
    hetero = tmp_path / "hetero.mlir"
    assert main([str(program), "-emit=mlir-hetero", "-o", str(hetero)]) == 0
    assert main([str(hetero), "-emit=llvm"]) == 0
    assert re.search(r"^define void @linear_[0-9]+\(ptr noalias", capsys.readouterr().out, re.MULTILINE)


@pytest.mark.parametrize("saved", ["mlir", "mlir-hetero", "mlir-tir", "mlir-linalg", "mlir-gpu"])
def test_compilation_resumes_from_a_saved_stage(saved, tmp_path, capsys):
    middle = tmp_path / f"{saved}.mlir"
    assert main([*PYTHON_INPUT, f"-emit={saved}", "-o", str(middle)]) == 0
    assert main([str(middle), "-emit=hxb", "-o", str(tmp_path / "m.hxb")]) == 0, capsys.readouterr().err
    kernels = manifest((tmp_path / "m.hxb").read_bytes())["kernels"]
    # examples/mlp.py: relu(linear(x, W1)) is one fused kernel, then the second linear
    assert [(k["op"], k["expr"]) for k in kernels] == [("linear", RELU), ("linear", PLAIN)]
    assert [re.fullmatch(r"linear_[0-9]+", k["name"]) is not None for k in kernels] == [True, True]


def test_placement_and_target_options(program, tmp_path, capsys):
    assert main([str(program), "-emit=mlir-hetero", "-placement=hexir.linear=cuda", "-target=cuda:sm_80"]) == 0
    out = capsys.readouterr().out
    assert '"hexir.linear"' in out and 'device = "cuda"' in out
    assert '{source = "cpu", target = "cuda"}' in out


def test_unwritable_output_is_exit_1(program, tmp_path, capsys):
    assert main([str(program), "-emit=mlir", "-o", str(tmp_path / "missing" / "x.mlir")]) == 1
    assert "hexir: error: cannot write" in capsys.readouterr().err


# ---- exit 2: bad arguments --------------------------------------------------------------------

@pytest.mark.parametrize("extra, message", [
    (["-placement=hexir.conv=cuda"],
     r"placement: unknown op 'hexir.conv'; placeable ops are \* \(all\) and hexir.linear, hexir.add, .*hexir.relu"),
    (["-placement=hexir.linear=tpu"], r"placement: unknown device 'tpu' for hexir.linear; expected one of cpu, cuda"),
    (["-target=cuda:sm_1"], r"target 'cuda:sm_1': 'sm_1' is not a supported CUDA architecture; expected one of "),
    (["-target=tpu"], r"target 'tpu': unknown device 'tpu'; expected cpu or cuda"),
    (["-target=cpu:x86-64-v9"], r"target 'cpu:x86-64-v9': unknown cpu level 'x86-64-v9'; expected one of x86-64, "),
], ids=["unknown op", "unknown device", "cuda:sm_1", "tpu", "cpu level"])
def test_bad_option_is_exit_2(extra, message, program, capsys):
    assert main([str(program), "-emit=mlir", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hexir: error: ")
    assert re.search(message, err), err


@pytest.mark.parametrize("specs, message", [
    (["-spec=x=2x8xc64"], r"-spec 'x=2x8xc64': expected \[name=\]DIMSxDTYPE, e.g. x=2x8xf32"),
    (["-spec=x=2x8"], r"-spec 'x=2x8': expected \[name=\]DIMSxDTYPE"),
    (["-spec=y=2x8xf32"], r"-spec names 'y' where mlp has argument 'x'"),
    ([], r"mlp takes 1 argument\(s\) \(x\); give one -spec for each, e.g. -spec=x=2x8xf32"),
    (["-spec=2x8xf32", "-spec=2x8xf32"], r"mlp takes 1 argument\(s\) \(x\)"),
], ids=["dtype", "no dtype", "wrong name", "missing", "too many"])
def test_bad_spec_is_exit_2(specs, message, capsys):
    assert main([f"{MLP}:mlp", "-emit=mlir", *specs]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_spec_without_a_name_is_positional(capsys):
    assert main([f"{MLP}:mlp", "-emit=mlir", "-spec=3x8xf32"]) == 0
    assert "tensor<3x8xf32>" in capsys.readouterr().out


def test_unknown_stage_is_exit_2(program, capsys):
    with pytest.raises(SystemExit) as caught:
        main([str(program), "-emit=mlir-bogus"])
    assert caught.value.code == 2
    assert "argument -emit: invalid choice: 'mlir-bogus'" in capsys.readouterr().err


def test_input_that_is_neither_mlir_nor_python_function_is_exit_2(program, capsys):
    text = program.with_suffix(".txt")
    text.write_text(PROGRAM)
    assert main([str(text), "-emit=mlir"]) == 2
    assert capsys.readouterr().err == f"hexir: error: input '{text}': expected FILE.mlir or FILE.py:FUNCTION\n"


# ---- exit 1: the input cannot be compiled -----------------------------------------------------

def test_syntax_error_is_exit_1_naming_the_file(tmp_path, capsys):
    path = tmp_path / "broken.mlir"
    path.write_text(PROGRAM.replace("-> tensor<2x4xf32>\n  %2", "-> \n  %2"))
    assert main([str(path), "-emit=mlir"]) == 1
    err = capsys.readouterr().err
    assert f"hexir: error: {path}: not valid hexir IR:" in err
    assert "expected non-function type" in err


def test_irdl_violation_is_exit_1(tmp_path, capsys):
    path = tmp_path / "nodevice.mlir"
    path.write_text(PROGRAM.replace('"hexir.relu"(%1) {device = "auto", ', '"hexir.relu"(%1) {'))
    assert main([str(path), "-emit=mlir"]) == 1
    assert '\'hexir.relu\' op attribute "device" is expected but not provided' in capsys.readouterr().err


@pytest.mark.parametrize("name", ["missing.mlir", "missing.py:mlp"])
def test_missing_file_is_exit_1(name, tmp_path, capsys):
    assert main([str(tmp_path / name), "-emit=mlir", "-spec=x=2x8xf32"]) == 1
    err = capsys.readouterr().err
    assert f"hexir: error: cannot read '{tmp_path / name.split(':')[0]}'" in err


def test_missing_function_is_exit_1(capsys):
    assert main([f"{MLP}:nope", "-emit=mlir", "-spec=x=2x8xf32"]) == 1
    assert f"{MLP} defines no function 'nope'" in capsys.readouterr().err


def test_shape_error_in_python_is_exit_1_at_the_users_line(capsys):
    assert main([*PYTHON_INPUT[:1], "-spec=x=2x7xf32", "-emit=mlir"]) == 1
    err = capsys.readouterr().err
    line = next(n for n, text in enumerate(MLP.read_text().splitlines(), 1) if "hexir.linear(x, W1)" in text)
    assert f"{MLP}:{line}" in err
    assert "linear: inner dimensions differ: x is float32[2, 7] and w is float32[8, 16]" in err


def _shape_error_file(tmp_path):
    path = tmp_path / "shapes.mlir"
    path.write_text(PROGRAM.replace("tensor<2x8xf32>", "tensor<2x5xf32>"))
    return path


def test_shape_error_in_mlir_is_exit_1(tmp_path, capsys):
    assert main([str(_shape_error_file(tmp_path)), "-emit=mlir"]) == 1
    assert ":3:8: linear: inner dimensions differ: x is float32[2, 5] and w is float32[8, 4]; expected w to have " \
           "5 rows, got 8" in capsys.readouterr().err


def test_shape_error_in_mlir_names_the_file(tmp_path, capsys):
    path = _shape_error_file(tmp_path)
    assert main([str(path), "-emit=mlir"]) == 1
    assert f"hexir: error: {path}:3:8: linear: inner dimensions differ" in capsys.readouterr().err


# ---- the command itself --------------------------------------------------------------------------

def test_python_m_hexir_cli(tmp_path):
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "runtime"), str(REPO)]))
    done = subprocess.run([sys.executable, "-m", "hexir.cli", *PYTHON_INPUT, "-emit=mlir-hetero"],
                          capture_output=True, text=True, env=environment, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert '"hexir.linear"' in done.stdout and 'name = "W1"' in done.stdout
    bad = subprocess.run([sys.executable, "-m", "hexir.cli", *PYTHON_INPUT, "-emit=mlir", "-target=tpu"],
                         capture_output=True, text=True, env=environment, cwd=tmp_path)
    assert bad.returncode == 2
    assert "hexir: error: target 'tpu'" in bad.stderr
