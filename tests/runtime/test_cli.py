"""`hexir-run`: output format, --quiet, --info, --input/--output, and the exit codes 0, 1, 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hexir_runtime import format as hxb
from hexir_runtime.cli import main

RUNTIME = str(Path(__file__).parents[2] / "runtime")
MATMUL = "8.000000 17.000000 \n12.000000 14.000000 \n"


@pytest.fixture
def matmul_inputs(tmp_path) -> list[str]:
    np.save(tmp_path / "a.npy", np.array([[10, -1], [-8, 10]], np.float32))
    np.save(tmp_path / "b.npy", np.array([[1, 2], [2, 3]], np.float32))
    return ["--entry=matmul", "--input", f"a={tmp_path / 'a.npy'}", "--input", f"b={tmp_path / 'b.npy'}"]


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(arg) for arg in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_header_then_program_output(capsys, mlp_file, matmul_inputs):
    code, out, err = run(capsys, mlp_file, *matmul_inputs)
    assert (code, err) == (0, "")
    assert out == (
        f"module        : {mlp_file}\nversion       : 5\nentry         : matmul\ndevice        : cpu\n--\n{MATMUL}"
        "output0: float32[2, 2]\n[[ 8. 17.]\n [12. 14.]]\n"
    )


def test_quiet_prints_only_the_program_output(capsys, mlp_file, matmul_inputs):
    assert run(capsys, mlp_file, *matmul_inputs, "--quiet", "--device=reference") == (0, MATMUL, "")


def test_main_entry_and_output_file(capsys, modules, mlp_file, tmp_path):
    x = np.linspace(0, 1, 16, dtype=np.float32).reshape(2, 8)
    np.save(tmp_path / "x.npy", x)
    code, out, _ = run(capsys, mlp_file, "--input", f"x={tmp_path / 'x.npy'}", "--output", tmp_path / "y.npz")
    assert code == 0
    expected = modules.mlp_numpy(x, modules.weights())
    with np.load(tmp_path / "y.npz") as saved:
        assert list(saved) == ["output0"]
        np.testing.assert_allclose(saved["output0"], expected, rtol=1e-5, atol=1e-6)
        # main prints what it returns, as C's %f (the C kernels' float32 rounding, not numpy's)
        assert out.split("--\n")[1].startswith("4.375632 -0.167747 -3.236929 -7.340654 \n"
                                                "10.811172 0.169738 -1.262020 -12.383718 \noutput0: float32[2, 4]\n")
    code, _, _ = run(capsys, mlp_file, "--entry", "layers", "--input", f"x={tmp_path / 'x.npy'}",
                     "--output", tmp_path / "both.npz", "--quiet")
    with np.load(tmp_path / "both.npz") as saved:
        assert (code, list(saved)) == (0, ["output0", "output1"])


def test_info_checks_the_format_and_loads_no_code(capsys, modules, tmp_path):
    path = tmp_path / "fake.hxb"
    hxb.write(path, *modules.mlp(b"not a shared object"))  # cannot be loaded, can be described
    code, out, err = run(capsys, path, "--info")
    assert (code, err) == (0, "")
    for line in [f"module        : {path}", "version       : 5", "producer      : hexir-tests",
                 "entry main(x: float32[2, 8]) -> float32[2, 4]", "%0 = input x",
                 "%3 = call k0_linear_bias(%0, %1, %2)", "# float32[2, 16] on cpu", "print %6", "return %6",
                 "[1] k1_relu: cpu pointwise(read float32[2, 16], write", "computes max(a0, 0)",
                 "[0] k0_linear_bias: cpu linear(read float32[2, 8]", "computes a0 + a1",
                 "symbol relu_2x16_2x16_float32, work extent 2", "[0] W1: float32[8, 16] in blob 0",
                 "[3] cpu.so: 19 bytes at", "constants", "blobs"]:
        assert line in out, line
    code, _, err = run(capsys, path)
    assert code == 1 and err == (f"hexir-run: {path}: cpu.libraries[0].library: the CPU library for generic (blob 3) "
                                 "is not a 64-bit little-endian ELF shared object\n")


def test_info_describes_cuda_kernels(capsys, modules, tmp_path):
    hxb.write(tmp_path / "cuda.hxb", *modules.cuda())
    code, out, _ = run(capsys, tmp_path / "cuda.hxb", "--info")
    assert code == 0
    assert "%1 = transfer %0" in out and "# float32[2, 3, 4] on cuda" in out
    assert "grid [2, 1, 1], block [32, 1, 1], shared 0 bytes" in out
    assert "images: sm_90 in blob 0, compute_90 in blob 1" in out
    assert "cpu fallback: relu_2x3x4_2x3x4_float32, work extent 2" in out


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--input", "z={dir}/a.npy"], "hexir-run: matmul(): no argument named 'z' (arguments: a, b)"),
        (["--input", "a={dir}/a.npy"], "hexir-run: matmul(): missing --input for b"),
        (["--input", "a={dir}/a.npy", "--input", "a={dir}/a.npy"], "hexir-run: --input a is given twice"),
        (["--input", "a={dir}/a.npy", "--input", "b={dir}/wrong.npy"],
         "hexir-run: matmul(): argument 'b' expects float32[2, 2], got float64[3]"),
        (["--input", "a={dir}/a.npy", "--input", "b={dir}/missing.npy"], "missing.npy: No such file or directory"),
        (["--input", "a={dir}/a.npy", "--input", "b={dir}/text.npy"], "hexir-run: --input b: "),
        (["--input", "a={dir}/a.npy", "--input", "b={dir}/b.npy", "--device=cuda"],
         "hexir-run: this module has no CUDA kernels"),
        (["--entry=nope"], "hexir-run: the module has no entry 'nope' (entries: main, layers, matmul)"),
    ],
)
def test_run_failures_exit_1(capsys, mlp_file, matmul_inputs, tmp_path, arguments, message):
    np.save(tmp_path / "wrong.npy", np.zeros(3))
    (tmp_path / "text.npy").write_text("not numpy")
    arguments = ["--entry=matmul", *(argument.format(dir=tmp_path) for argument in arguments)]
    code, out, err = run(capsys, mlp_file, *arguments)
    assert code == 1 and "Traceback" not in err
    assert message in err and err.count("\n") == 1, err


def test_unreadable_modules_exit_1(capsys, tmp_path):
    code, _, err = run(capsys, tmp_path / "missing.hxb")
    assert code == 1 and err == f"hexir-run: {tmp_path / 'missing.hxb'}: No such file or directory\n"
    (tmp_path / "notes.txt").write_text("hello\n")
    for extra in ([], ["--info"]):
        code, _, err = run(capsys, tmp_path / "notes.txt", *extra)
        assert code == 1
        assert err == f"hexir-run: {tmp_path / 'notes.txt'}: header.magic: not a hexir module (bad magic)\n"


@pytest.mark.parametrize("argv", [[], ["m.hxb", "--device=gpu"], ["m.hxb", "--input", "x.npy"], ["m.hxb", "--bogus"]])
def test_bad_arguments_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "usage: hexir-run" in capsys.readouterr().err


def test_help_documents_exit_codes(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    out = capsys.readouterr().out
    assert exited.value.code == 0
    assert "exit codes:" in out and "2  bad command-line arguments" in out
    assert "--device {auto,cpu,cuda,reference}" in out


def test_exit_codes_of_the_real_process(mlp_file, matmul_inputs, tmp_path):
    environment = {**os.environ, "PYTHONPATH": RUNTIME + os.pathsep + os.environ.get("PYTHONPATH", "")}
    command = [sys.executable, "-m", "hexir_runtime", str(mlp_file)]
    ok = subprocess.run([*command, *matmul_inputs, "--quiet"], capture_output=True, text=True, env=environment)
    assert (ok.returncode, ok.stdout, ok.stderr) == (0, MATMUL, "")
    failed = subprocess.run([*command, "--entry=matmul"], capture_output=True, text=True, env=environment)
    assert (failed.returncode, failed.stdout) == (1, "")
    assert failed.stderr == "hexir-run: matmul(): missing --input for a, b\n"
    usage = subprocess.run([*command, "--device=tpu"], capture_output=True, text=True, env=environment)
    assert usage.returncode == 2 and "invalid choice: 'tpu'" in usage.stderr


@pytest.mark.parametrize("extra", [[], ["--quiet"], ["--info"]])
def test_a_closed_stdout_stops_the_process_quietly(mlp_file, matmul_inputs, extra):
    """`hexir-run m.hxb | head -1`: the reader is gone; that is no error of the module's."""
    environment = {**os.environ, "PYTHONPATH": RUNTIME + os.pathsep + os.environ.get("PYTHONPATH", "")}
    reader, writer = os.pipe()
    os.close(reader)  # every write to the pipe fails with EPIPE
    try:
        result = subprocess.run([sys.executable, "-m", "hexir_runtime", str(mlp_file), *matmul_inputs, *extra],
                                stdout=writer, stderr=subprocess.PIPE, text=True, env=environment)
    finally:
        os.close(writer)
    assert (result.returncode, result.stderr) == (1, "")


# --- issue 13: outputs printed, --full, --version, paths checked before any work ---------------


def hexir_run_process(*argv, cwd=None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": RUNTIME + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "hexir_runtime", *map(str, argv)], capture_output=True, text=True,
                          env=environment, cwd=cwd)


def test_outputs_are_printed_summarised_or_in_full(modules, tmp_path, c_library):
    hxb.write(tmp_path / "batched.hxb", *modules.batched(c_library))
    np.save(tmp_path / "x.npy", np.ones((300, 8), np.float32))
    summary = hexir_run_process(tmp_path / "batched.hxb", "--input", f"x={tmp_path / 'x.npy'}")
    assert summary.returncode == 0 and summary.stderr == ""
    body = summary.stdout.split("--\n", 1)[1]
    assert body.startswith("output0: float32[300, 4]\n[[") and "...\n" in body and body.count("\n") < 20
    full = hexir_run_process(tmp_path / "batched.hxb", "--input", f"x={tmp_path / 'x.npy'}", "--full")
    assert "..." not in full.stdout and full.stdout.count("\n") > 300
    quiet = hexir_run_process(tmp_path / "batched.hxb", "--input", f"x={tmp_path / 'x.npy'}", "--quiet")
    assert (quiet.returncode, quiet.stdout) == (0, "")


def test_version():
    result = hexir_run_process("--version")
    assert result.returncode == 0 and result.stdout.startswith("hexir-run (hexir_runtime) 0.")


def test_paths_are_checked_before_any_work_and_named_for_what_they_are(mlp_file, tmp_path):
    a = tmp_path / "a.npy"
    np.save(a, np.eye(2, dtype=np.float32))
    np.savez(tmp_path / "ab.npz", a=np.eye(2, dtype=np.float32), b=np.ones((2, 2), np.float32))
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    (tmp_path / "pickled.npy").write_bytes(b"\x80\x04\x95pickle")
    (tmp_path / "empty.hxb").write_bytes(b"")
    (tmp_path / "empty.npy").write_bytes(b"")
    cases = {
        (tmp_path / "empty.hxb",): "empty file (not a hexir module)",
        ("--input", f"a={mlp_file}"): f"--input a: {mlp_file} is a hexir module (.hxb), not a .npy array",
        ("--input", f"a={tmp_path / 'ab.npz'}"): "is an .npz archive (arrays: a, b): use a=FILE.npz:KEY",
        ("--input", f"a={tmp_path / 'ab.npz'}:c"): "is an .npz archive (arrays: a, b): no array 'c' in it",
        ("--input", f"a={tmp_path / 'objects.npy'}"): "holds an object array (pickled data)",
        ("--input", f"a={tmp_path / 'pickled.npy'}"): "holds pickled Python data, not a .npy array",
        ("--input", f"a={tmp_path / 'empty.npy'}"): "empty file (expected a .npy array)",
        ("--input", f"a={a}", "--output", tmp_path / "no" / "such" / "o"): "the folder",
    }
    for arguments, message in cases.items():
        argv = arguments if arguments[0] == tmp_path / "empty.hxb" else (mlp_file, "--entry=matmul", *arguments)
        result = hexir_run_process(*argv)
        assert result.returncode == 1 and result.stdout == "", (arguments, result)
        assert message in result.stderr and result.stderr.count("\n") == 1, (arguments, result.stderr)
    # the .npz spelling works, and --output writes exactly the name it is given
    ok = hexir_run_process(mlp_file, "--entry=matmul", "--input", f"a={tmp_path / 'ab.npz'}:a", "--input",
                           f"b={tmp_path / 'ab.npz'}:b", "--output", tmp_path / "o", "--quiet")
    assert ok.returncode == 0, ok.stderr
    assert not (tmp_path / "o.npz").exists()
    with np.load(tmp_path / "o") as saved:
        np.testing.assert_array_equal(saved["output0"], np.ones((2, 2), np.float32))


def test_control_characters_from_the_file_are_escaped_in_messages(modules, c_library, tmp_path):
    manifest, blobs = modules.mlp(c_library)
    manifest["kernels"][1]["name"] = "evil\x1b[2J"
    manifest["kernels"][1]["symbol"] = "no_such_kernel"
    hxb.write(tmp_path / "evil.hxb", manifest, blobs)
    np.save(tmp_path / "x.npy", np.ones((2, 8), np.float32))
    result = hexir_run_process(tmp_path / "evil.hxb", "--input", f"x={tmp_path / 'x.npy'}")
    assert result.returncode == 1 and "\x1b" not in result.stderr and "evil\\x1b[2J" in result.stderr
    assert result.stderr.count("\n") == 1
