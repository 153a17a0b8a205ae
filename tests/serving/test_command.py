"""`hexir-run serve`: what it checks before Ray starts, and what it says without Ray. No cluster."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hexir_runtime.cli import main
from hexir_runtime.serving import command as serve_command

RUNTIME = str(Path(__file__).parents[2] / "runtime")
ENVIRONMENT = {**os.environ, "PYTHONPATH": RUNTIME + os.pathsep + os.environ.get("PYTHONPATH", "")}

# Setting a module to None in sys.modules makes every later import of it raise ImportError.
WITHOUT_RAY = """
import sys
sys.modules['ray'] = None
import hexir_runtime, hexir_runtime.serving
from hexir_runtime.cli import main
code = main(['serve', sys.argv[1]])
assert not [name for name in sys.modules if name.split('.')[0] == 'ray' and sys.modules[name]]
sys.exit(code)
"""


def test_without_ray_it_says_what_to_install(mlp_model):
    result = subprocess.run([sys.executable, "-c", WITHOUT_RAY, str(mlp_model)], capture_output=True, text=True,
                            env=ENVIRONMENT, timeout=300)
    assert result.returncode == 1, result.stderr
    assert "hexir-run serve needs Ray Serve: pip install 'hexir-runtime[serve]'" in result.stderr


def test_the_runtime_and_its_serving_protocol_do_not_import_ray():
    program = "import sys, hexir_runtime, hexir_runtime.serving, hexir_runtime.cli; print('ray' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=ENVIRONMENT,
                            timeout=300)
    assert result.stdout.strip() == "False", result.stderr


@pytest.mark.parametrize("make, extra, message", [
    (lambda d, m: d / "missing.hxb", [], "missing.hxb: No such file or directory"),
    (lambda d, m: (d / "bad.hxb").write_bytes(b"HXB?junk") and d / "bad.hxb", [], "bad.hxb: "),
    (lambda d, m: (d / "has space.hxb").write_bytes(m.read_bytes()) and d / "has space.hxb", [],
     "the model's name 'has space' (the file's stem) must be letters"),
    (lambda d, m: m, ["--num-gpus", "1", "--device", "cpu"], "--num-gpus 1.0 runs replicas on cuda, not --device cpu"),
    (lambda d, m: m, ["--device", "cuda"], "--device cuda needs --num-gpus > 0"),
    (lambda d, m: m, ["--replicas", "1000"], "1 model(s) x 1000 replica(s) x 1 CPU(s) need 1000 CPUs"),
])
def test_bad_models_and_options_fail_before_ray_starts(tmp_path, capsys, mlp_model, make, extra, message):
    assert main(["serve", str(make(tmp_path, mlp_model)), *extra]) == 1
    err = capsys.readouterr().err
    assert err.startswith("hexir-run serve: ") and message in err, err


def test_a_port_in_use_fails_before_ray_starts(capsys, mlp_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", str(mlp_model), "--port", str(port)]) == 1
    assert f"cannot listen on 127.0.0.1 port {port}: Address already in use" in capsys.readouterr().err


def test_two_models_with_one_name(tmp_path, capsys, mlp_model):
    (tmp_path / "mlp.hxb").write_bytes(mlp_model.read_bytes())
    assert main(["serve", str(mlp_model), str(tmp_path / "mlp.hxb")]) == 1
    assert "a second model named 'mlp'" in capsys.readouterr().err


@pytest.mark.parametrize("option", [["--replicas", "0"], ["--replicas", "x"], ["--max-batch", "0"],
                                    ["--num-cpus", "-1"], ["--num-gpus", "nan"], ["--port", "70000"], []])
def test_bad_arguments_exit_2(capsys, option):
    with pytest.raises(SystemExit) as caught:
        main(["serve", *option] if option else ["serve"])
    assert caught.value.code == 2


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray 2.60's own, on pydantic's API
def test_a_local_cluster_is_new_and_on_loopback(monkeypatch, capsys, mlp_model):
    """Without --address: address="local" (ray.init() would join a cluster that `ray start` left on
    this machine, and the stop would shut down its Serve), node address 127.0.0.1, no dashboard,
    and the dashboard agent's port (52365 by default) left to the OS, as every other port."""
    ray = pytest.importorskip("ray")
    calls = []

    def init(**options):
        calls.append({**options, "agent_port": ray._private.parameter.RayParams().dashboard_agent_listen_port})
        raise RuntimeError("no cluster in this test")
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the loopback variables stay in this test
    assert main(["serve", str(mlp_model)]) == 1
    assert "serving failed: RuntimeError: no cluster in this test" in capsys.readouterr().err
    (options,) = calls
    assert (options["address"], options["_node_ip_address"], options["include_dashboard"]) == ("local", "127.0.0.1",
                                                                                              False)
    assert options["agent_port"] is None and ray._private.parameter.RayParams().dashboard_agent_listen_port == 52365
    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert os.environ["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == "hexir_runtime.serving.ray.proxy_middlewares"


def test_a_signal_inside_a_call_into_ray_waits_for_it_and_a_second_one_does_not():
    from hexir_runtime.serving import command

    done = []

    def call(signals: int) -> None:
        for _ in range(signals):
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs right here, in this thread
        done.append(signals)
    previous = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        for signals, finished in ((0, [0]), (1, [0, 1]), (2, [0, 1])):
            signal.signal(signal.SIGTERM, command._stop)  # _stop ignores later signals once it stops
            with pytest.raises(command.Stop) if signals else contextlib.nullcontext():
                command._in_ray(call, signals)
            assert done == finished
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def test_with_trust_an_unsigned_or_otherwise_signed_model_is_refused_before_ray_starts(tmp_path, capsys, mlp_model):
    """`--trust KEYFILE`: every model must be signed by a trusted key, checked on the bytes the
    replicas will load; a key file that cannot be used is a bad argument (exit 2)."""
    serialization = pytest.importorskip("cryptography.hazmat.primitives.serialization")
    ed25519 = pytest.importorskip("cryptography.hazmat.primitives.asymmetric.ed25519")
    from hexir_runtime import signing

    pems = {}
    for name in ("alice", "bob"):
        key = ed25519.Ed25519PrivateKey.generate()
        (tmp_path / f"{name}.pem").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        pems[name] = tmp_path / f"{name}.pub.pem"
        pems[name].write_bytes(key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    signed = tmp_path / "signed.hxb"
    signed.write_bytes(signing.sign(mlp_model.read_bytes(), signing.signing_key(tmp_path / "alice.pem")))
    assert main(["serve", str(mlp_model), "--trust", str(pems["alice"])]) == 1
    assert "not signed" in capsys.readouterr().err
    assert main(["serve", str(signed), "--trust", str(pems["bob"])]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"hexir-run serve: {signed}: ") and signing.signer(signed.read_bytes()) in err, err
    assert main(["serve", str(signed), "--trust", str(tmp_path / "nothing.pem")]) == 2
    assert capsys.readouterr().err.startswith("hexir-run serve: error: --trust ")
    assert serve_command._read_models([str(signed)], signing.trusted_keys(pems["alice"])) == {
        "signed": signed.read_bytes()}
