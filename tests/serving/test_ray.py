"""`hexir-run serve` on a real one-node Ray cluster, on loopback only: concurrent requests checked
against numpy, malformed ones refused alone, an unknown model, every socket of every process it
started within 127.0.0.0/8, a killed replica replaced with no request lost silently, a clean stop.

One server (two models, two replicas each) serves the whole module; the tests run in order and
the last one stops it. Timeouts are generous: Ray took 17-30 s to start on a busy 2-core machine.
"""

from __future__ import annotations

import ipaddress
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from .conftest import mlp_reference, static_reference

pytest.importorskip("ray", reason="serving needs ray[serve] (pip install 'hexir-runtime[serve]')")
from hexir_runtime.serving import decode_response, encode_request  # noqa: E402
from hexir_runtime.serving.protocol import HEADER_LENGTH  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray 2.60's own, on pydantic's API
RUNTIME = str(Path(__file__).parents[2] / "runtime")
START_S, STOP_S, REQUEST_S, REPLACE_S = 600, 300, 180, 420
MAX_BATCH = 8
IN_FLIGHT = max(2 * MAX_BATCH, 16)  # a replica's max_ongoing_requests (serving/ray.py)
PRINTED_ROW = re.compile(r"^(-?\d+\.\d{6} ){10}$", re.M)  # a row of the mlp's output as hexir.print writes it
ACCESS_LINE = re.compile(r" -- POST /v2/models/\w+ \d{3} [\d.]+ms$", re.M)  # Ray's access log, as Ray 2.60 writes it


def free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def processes() -> tuple[dict[int, int], dict[int, str]]:
    """Every live (not zombie) process: pid -> parent, and pid -> start time (to tell a reused pid)."""
    parents, starts = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parents[int(entry)], starts[int(entry)] = int(fields[1]), fields[19]
    return parents, starts


def process_tree(root: int) -> dict[int, str]:
    """`root` and its live descendants: pid -> start time."""
    parents, starts = processes()
    tree, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        if pid in starts:
            tree[pid] = starts[pid]
            frontier += [child for child, parent in parents.items() if parent == pid]
    return tree


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    host = bytes.fromhex(text.split(":")[0])
    # /proc/net writes an address as 32-bit words in host (little-endian) order
    return ipaddress.ip_address(b"".join(host[i:i + 4][::-1] for i in range(0, len(host), 4)))


def sockets_of(pids) -> list[tuple[int, str, str, str, int]]:
    """(pid, kind, local address, remote address, local port) of every TCP and UDP socket the processes hold."""
    table = {}
    for kind in ("tcp", "tcp6", "udp", "udp6"):
        for line in Path(f"/proc/net/{kind}").read_text().splitlines()[1:]:
            fields = line.split()
            table[fields[9]] = (kind, _address(fields[1]), _address(fields[2]), int(fields[1].split(":")[1], 16))
    found = []
    for pid in pids:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        for link in links:
            inode = link[len("socket:["):-1] if link.startswith("socket:[") else None
            if inode in table:
                found.append((pid, *table[inode]))
    return found


def loopback(address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


class Server:
    """`hexir-run serve` in a subprocess; the processes it started, seen while it ran."""

    def __init__(self, models: list[Path]) -> None:
        self.port = free_loopback_port()
        self.base = f"http://127.0.0.1:{self.port}"
        environment = {**os.environ, "PYTHONPATH": RUNTIME + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "hexir_runtime", "serve", *map(str, models), "--port", str(self.port),
             "--replicas", "2", "--num-cpus", "0.25", "--max-batch", str(MAX_BATCH), "--batch-wait-ms", "20"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.errors: list[str] = []
        self.seen: dict[int, tuple[str, str]] = {}  # pid -> (start time, command line)
        threading.Thread(target=self._read, args=(self.process.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=self._read, args=(self.process.stderr, self.errors.append), daemon=True).start()

    @staticmethod
    def _read(stream, put) -> None:
        for line in stream:
            put(line)
        put(None)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_S
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"not ready after {START_S} s; stderr:\n{''.join(self.errors)[-3000:]}")
            if line is None:
                pytest.fail(f"exited with {self.process.wait()}; stderr:\n{''.join(self.errors)[-3000:]}")
            if line.startswith("ready"):
                return

    def tree(self) -> dict[int, str]:
        tree = process_tree(self.process.pid)
        self.seen.update({pid: (start, command_line(pid)) for pid, start in tree.items() if pid not in self.seen})
        return tree

    def replicas(self, model: str) -> set[int]:
        return {pid for pid in self.tree() if f"ServeReplica:{model}:" in command_line(pid)}

    def left(self) -> dict[int, str]:
        """The processes seen while it ran that are still alive (same pid, same start time)."""
        alive = processes()[1]
        return {pid: line for pid, (start, line) in self.seen.items() if alive.get(pid) == start}

    def stop(self) -> int:
        if self.process.poll() is None:
            self.tree()
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=STOP_S)


def post(url: str, inputs: dict, binary: bool) -> tuple[int, bytes, str | None]:
    body, headers = encode_request(inputs, binary=binary)
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=REQUEST_S) as response:
            return response.status, response.read(), response.headers.get(HEADER_LENGTH)
    except urllib.error.HTTPError as error:
        return error.code, error.read(), None


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=REQUEST_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def infer_mlp(server: Server, x: np.ndarray, binary: bool) -> str:
    """'ok' for a correct answer; else what came back."""
    status, body, header = post(f"{server.base}/v2/models/mlp/infer", {"x": x}, binary)
    if status != 200:
        return f"{status} {body[:300]!r}"
    y = decode_response(body, int(header) if header else None)["output0"]
    return "ok" if np.allclose(y, mlp_reference(x), rtol=1e-4, atol=1e-5) else "WRONG ANSWER"


@pytest.fixture(scope="module")
def server(mlp_model, static_model):
    started = Server([mlp_model, static_model])
    try:
        started.wait_ready()
        yield started
    finally:
        if started.process.poll() is None:
            started.stop()
        for pid in started.left():  # only what this test started, by pid
            os.kill(pid, signal.SIGKILL)


def test_applications_for_ray_configs(mlp_model):
    from hexir_runtime.errors import InputError
    from hexir_runtime.serving import ray as engine
    from ray.serve import Application

    for args in ({"path": str(mlp_model)}, {"path": str(mlp_model), "replicas": "auto", "max_batch": 4},
                 {"path": str(mlp_model), "name": "other", "num_gpus": 0.5}):
        assert isinstance(engine.model_app(args), Application)
    assert isinstance(engine.server_app({"models": ["mlp"]}), Application)
    with pytest.raises(InputError, match="a replica with a GPU .num_gpus=1. runs on cuda, not cpu"):
        engine.model_app({"path": str(mlp_model), "num_gpus": 1, "device": "cpu"})
    assert engine.replica_device("auto", 1.5, 0).threads == 2  # a replica's threads follow its CPUs
    assert engine.replica_device("auto", 0, 1) == "cuda"


def test_a_request_ray_fails_gets_the_protocols_json_error():
    import asyncio

    from hexir_runtime.serving.ray import ProtocolErrors

    async def failing(scope, receive, send):  # as Ray's proxy when the replica died: returns, nothing sent
        pass

    async def answering(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    def run(app) -> list[dict]:
        sent: list[dict] = []

        async def send(message):
            sent.append(message)
        asyncio.run(ProtocolErrors(app)({"type": "http", "path": "/v2/models/mlp/infer"}, None, send))
        return sent

    start, body = run(failing)
    assert start["status"] == 500 and (b"content-type", b"application/json") in start["headers"]
    assert json.loads(body["body"])["error"].startswith("/v2/models/mlp/infer: Ray Serve failed the request before")
    assert [message["type"] for message in run(answering)] == ["http.response.start", "http.response.body"]
    # what Ray's proxy does with the variable hexir-run serve gives a cluster it starts
    from hexir_runtime.serving.command import CLUSTER_ENVIRONMENT
    from ray.serve._private.http_util import validate_http_proxy_callback_return
    from ray.serve._private.utils import call_function_from_import_path

    (middleware,) = validate_http_proxy_callback_return(call_function_from_import_path(
        CLUSTER_ENVIRONMENT["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"]))
    assert middleware.cls is ProtocolErrors


def test_serves_checks_and_batches(server):
    assert get(f"{server.base}/v2/health/live") == (200, {"live": True})
    assert get(f"{server.base}/v2/health/ready") == (200, {"ready": True})
    status, metadata = get(f"{server.base}/v2/models/mlp")
    assert status == 200 and metadata["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 784]}]
    assert get(f"{server.base}/v2/models/static/ready")[0] == 200
    body, headers = encode_request({"x": np.zeros((1, 784), np.float32)})
    try:
        urllib.request.urlopen(urllib.request.Request(f"{server.base}/v2/models/mlp/infer", body,
                                                      {**headers, HEADER_LENGTH: "many"}), timeout=REQUEST_S)
    except urllib.error.HTTPError as error:
        assert error.code == 400 and f"{HEADER_LENGTH} is not a byte count: 'many'" in error.read().decode()
    else:
        pytest.fail("a request with a bad header length was answered")
    status, error = get(f"{server.base}/v2/models/nope")
    assert status == 404 and "unknown model 'nope' (models: mlp, static)" in error["error"]
    rng = np.random.default_rng(0)
    good = [rng.random((int(rng.integers(1, 7)), 784), np.float32) for _ in range(48)]
    bad = [np.zeros((2, 783), np.float32), np.zeros((1, 784), np.float64)]
    with ThreadPoolExecutor(16) as pool:  # the bad ones in the middle of the burst
        answers = list(pool.map(lambda i: infer_mlp(server, good[i], i % 2 == 0), range(24)))
        refused = list(pool.map(lambda x: post(f"{server.base}/v2/models/mlp/infer", {"x": x}, False), bad))
        answers += list(pool.map(lambda i: infer_mlp(server, good[i], i % 2 == 0), range(24, 48)))
        static_x = [rng.random((3, 5)) for _ in range(6)]
        static = list(pool.map(lambda x: post(f"{server.base}/v2/models/static/infer", {"x": x}, True), static_x))
    assert answers == ["ok"] * 48
    assert [status for status, _, _ in refused] == [400, 400]
    assert "input 'x' (expects FP32 [-1, 784], that is float32[batch, 784]): shape is [2, 783]" in \
        json.loads(refused[0][1])["error"]
    assert "input 'x' (expects FP32 [-1, 784], that is float32[batch, 784]): datatype is 'FP64'" in \
        json.loads(refused[1][1])["error"]
    for x, (status, body, header) in zip(static_x, static, strict=True):
        assert status == 200
        np.testing.assert_allclose(decode_response(body, int(header))["output0"], static_reference(x), rtol=1e-12)


def test_every_socket_stays_on_loopback_on_a_port_the_os_picked(server):
    from ray._private import ray_constants
    from ray.serve._private import constants as serve_constants

    tree = server.tree()
    found = sockets_of(tree)
    listening = [port for _, _, local, remote, port in found if remote.is_unspecified]
    assert len(listening) >= 5, found  # the check saw the cluster: gcs, raylet, proxy, replicas...
    outside = [(pid, command_line(pid)[:60], kind, str(local), str(remote)) for pid, kind, local, remote, _ in found
               if not loopback(local) or not (remote.is_unspecified or loopback(remote))]
    assert not outside
    # none on a port Ray fixes by default (a second cluster on the machine would collide there)...
    fixed = {ray_constants.DEFAULT_PORT, ray_constants.DEFAULT_DASHBOARD_PORT, serve_constants.DEFAULT_HTTP_PORT,
             serve_constants.DEFAULT_GRPC_PORT}
    assert server.port in listening and not fixed & set(listening), sorted(listening)
    # ...nor asked for one inside the OS's ephemeral range (where a port's number alone cannot tell):
    # the dashboard agent is told port 0 (not 52365: the raylet starts it, and its command line
    # holds the agent's), the two metrics servers read 0 (not 44217, 44227)
    raylets = [pid for pid in tree if "--listen-port=" in command_line(pid)]
    assert raylets and all("--listen-port=0 " in command_line(pid) + " " for pid in raylets)
    monitors = [pid for pid in tree if "autoscaler/_private/monitor.py" in command_line(pid)]
    assert monitors and {b"AUTOSCALER_METRIC_PORT=0", b"DASHBOARD_METRIC_PORT=0"} <= set(
        Path(f"/proc/{monitors[0]}/environ").read_bytes().split(b"\0"))


def test_a_killed_replica_is_replaced_and_no_request_is_lost(server):
    before = server.replicas("mlp")
    assert len(before) == 2, before
    outcomes: list[str] = []
    lock, stop, warmed = threading.Lock(), threading.Event(), threading.Event()
    rng = np.random.default_rng(1)
    inputs = [rng.random((2, 784), np.float32) for _ in range(8)]

    def client(index: int) -> None:
        while not stop.is_set():
            try:
                outcome = infer_mlp(server, inputs[index], index % 2 == 0)
            except OSError as error:  # a connection closed on us is still an answer: an error
                outcome = f"error {error}"
            with lock:
                outcomes.append(outcome)
                if outcomes.count("ok") >= 16:
                    warmed.set()

    clients = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for thread in clients:
        thread.start()
    try:
        assert warmed.wait(REPLACE_S)
        victim = min(before)
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + REPLACE_S
        while (replicas := server.replicas("mlp")) and (len(replicas) < 2 or victim in replicas):
            assert time.monotonic() < deadline, f"no replacement after {REPLACE_S} s: {replicas}"
            time.sleep(0.5)  # polling for the replacement, which Ray starts in its own time
        assert get(f"{server.base}/v2/models/mlp/ready")[0] == 200
    finally:
        stop.set()
        for thread in clients:
            thread.join(REQUEST_S + 30)
    assert not any(thread.is_alive() for thread in clients), "a request never came back"
    failed = [outcome for outcome in outcomes if outcome != "ok"]
    assert "WRONG ANSWER" not in failed
    assert len(failed) <= IN_FLIGHT, failed  # at most what the dead replica had in flight
    # an HTTP answer to a failed request is the protocol's JSON error, even where Ray failed it
    assert all(re.match(r"\d{3} b'\{\"error\": ", outcome) for outcome in failed if outcome[:1].isdigit()), failed
    with ThreadPoolExecutor(8) as pool:  # the replacement and the survivor serve
        assert list(pool.map(lambda i: infer_mlp(server, inputs[i % 8], True), range(16))) == ["ok"] * 16


def test_stops_cleanly_on_sigterm(server):
    server.tree()
    assert server.stop() == 0, "".join(server.errors)[-3000:]
    deadline = time.monotonic() + STOP_S
    while server.left():
        assert time.monotonic() < deadline, f"left running: {server.left()}"
        time.sleep(0.5)  # polling: processes exit in their own time after the cluster stops
    started = " ".join(line for _, line in server.seen.values())
    assert "raylet" in started and "gcs_server" in started and "ServeReplica:static:" in started
    # this cluster's logs (the GCS's command line names its session: an older one may end in the same pid)
    (session,) = {match.group(1) for match in re.finditer(r"--session-dir=(\S*session_[\d_-]+)", started)}
    # hexir.print (mlp has one) is left out of served calls: no row of it in a replica's log
    replicas = {pid for pid, (_, line) in server.seen.items() if "ServeReplica:mlp:" in line}
    logs = [log for log in Path(session, "logs").glob("worker-*.out") if int(log.stem.rpartition("-")[2]) in replicas]
    assert logs and not [log for log in logs if PRINTED_ROW.search(log.read_text())]
    # Ray's access log is off by default: no line per request in the proxy's or the replicas' logs
    serve_logs = list(Path(session, "logs", "serve").glob("*.log"))
    assert serve_logs and not [log for log in serve_logs if ACCESS_LINE.search(log.read_text())]
