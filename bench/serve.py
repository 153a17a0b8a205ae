"""Serving a .hxb on Ray Serve over loopback: requests/s, p50/p99 latency and the server's CPU time
per request, for 1-row and 64-row requests of a 784 -> 64 -> 10 float32 MLP, from 1 and 32
clients, JSON and binary tensors, with `--max-batch 1` and `--max-batch 32`; against calling
`module.main` directly. Every response is checked against numpy.

    python bench/serve.py [--seconds 3] [--max-requests 3000] [--pre-encoded] [--wide] [--out FILE.md]

It starts a one-node cluster on 127.0.0.1 (an ephemeral port) serving the module as b1
(max-batch 1) and b32 (max-batch 32), one replica of 1 CPU each, and measures, for every
(rows, clients, encoding), b1 then b32 right after each other, `--seconds` of traffic
after a warm-up (at most `--max-requests`). Clients are threads with a persistent connection
each; each encodes its request and decodes and checks the response, as a real client must
(`--pre-encoded`: bodies encoded beforehand, the server's side alone). They run on the same
machine: on 2 cores they take CPU from the server.
Server CPU = user+system time of every process the server started (proxy, replica, controller,
raylet, gcs...) over the run, per request.

`--wide` adds rows, reported apart: a 784 -> 4096 -> 4096 -> 10 float32 MLP (an 80 MB module)
whose 1-row call costs about what Ray's own work for a request does (10-25 ms of CPU here), served
as w1 and w32 by the same cluster, 1-row binary requests from 1 and 32 clients: where batching pays.
Ray then counts each of the four replicas as half a CPU (else two would wait for a core for ever);
each still runs one kernel thread.
"""

from __future__ import annotations

import argparse
import http.client
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import hexir_runtime
import numpy as np
from hexir_runtime.cpu import CpuDevice
from hexir_runtime.serving import decode_response, encode_request
from hexir_runtime.serving.protocol import HEADER_LENGTH

import hexir

rng = np.random.default_rng(0)
W1 = (rng.standard_normal((784, 64)) * 0.05).astype(np.float32)
W2 = (rng.standard_normal((64, 10)) * 0.1).astype(np.float32)
WIDE = [(rng.standard_normal(shape) * 0.03).astype(np.float32) for shape in ((784, 4096), (4096, 4096), (4096, 10))]
TICK = os.sysconf("SC_CLK_TCK")


@hexir.jit
def mlp(x):
    y = hexir.linear(hexir.relu(hexir.linear(x, W1)), W2)
    hexir.print(y)  # served calls leave it out
    return y


@hexir.jit
def wide(x):
    return hexir.linear(hexir.relu(hexir.linear(hexir.relu(hexir.linear(x, WIDE[0])), WIDE[1])), WIDE[2])


def wide_reference(x: np.ndarray) -> np.ndarray:
    return np.maximum(np.maximum(x @ WIDE[0], 0) @ WIDE[1], 0) @ WIDE[2]


def process_cpu_seconds(root: int) -> dict[int, float]:
    """User + system CPU seconds of `root` and of each of its live descendants, by pid (also
    bench/serve_cpu.py's, per role)."""
    parents, times = {}, {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        parents[int(entry)], times[int(entry)] = int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK
    seconds, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        seconds[pid] = times.get(pid, 0.0)
        frontier += [child for child, parent in parents.items() if parent == pid]
    return seconds


def server_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of `root` and its live descendants."""
    return sum(process_cpu_seconds(root).values())


# The server: one one-node cluster on 127.0.0.1 serving the module twice, as b1 (max-batch 1) and
# b32 (max-batch 32), one replica of 1 CPU each, so that the two are measured one right after the
# other under the same load (hexir-run serve's --max-batch is one for all its models).
SERVER = """
import os, signal, sys
from hexir_runtime.serving.command import CLUSTER_ENVIRONMENT
for name, value in CLUSTER_ENVIRONMENT.items():  # bench/serve_cpu.py's variants may change them
    os.environ.setdefault(name, value)
import ray
from ray import serve
from hexir_runtime.serving import ray as engine
engine.init_local()
access_log = os.environ.get("HEXIR_BENCH_ACCESS_LOG") == "1"  # bench/serve_cpu.py's switch
engine.start("127.0.0.1", int(sys.argv[1]), access_log)
names = []
cpus = 2 / (2 * len(sys.argv[2:]))  # Ray's accounting: 2 or 4 replicas on 2 cores; one kernel thread each
for prefix, path in zip("bw", sys.argv[2:], strict=False):  # b: the small MLP, w: --wide's
    data = open(path, "rb").read()
    for max_batch in (1, 32):
        names.append(f"{prefix}{max_batch}")
        engine.deploy_model(names[-1], data, replicas=1, num_cpus=cpus, max_batch=max_batch, batch_wait_ms=2,
                            access_log=access_log)
engine.deploy_server(names)
signal.signal(signal.SIGTERM, lambda number, frame: None)  # pause() returns on it
print("ready", flush=True)
signal.pause()
serve.shutdown()
ray.shutdown()
"""


class Server:
    def __init__(self, *models: Path) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.errors = tempfile.TemporaryFile("w+")  # the server's stderr, shown if it fails to start
        self.process = subprocess.Popen([sys.executable, "-c", SERVER, str(self.port), *map(str, models)],
                                        stdout=subprocess.PIPE, stderr=self.errors, text=True)
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [*map(lines.put, self.process.stdout), lines.put("")], daemon=True).start()
        while not (line := lines.get(timeout=600)).startswith("ready"):
            if not line:
                self.errors.seek(0)
                raise SystemExit(f"the server exited with {self.process.wait()}:\n{self.errors.read()[-3000:]}")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=300)


def load(port: int, path: str, bodies: list, expected: list[np.ndarray], clients: int, seconds: float,
         max_requests: int, root: int) -> dict[str, float]:
    """Run `clients` threads against the server; requests/s, latencies, server CPU per request."""
    latencies: list[float] = []
    wrong: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()

    def client(index: int) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        turn = index
        while not stop.is_set():
            start = time.perf_counter()
            body, headers = bodies[turn % len(bodies)]()
            connection.request("POST", path, body, headers)
            response = connection.getresponse()
            data, header = response.read(), response.getheader(HEADER_LENGTH)
            elapsed = time.perf_counter() - start
            if response.status != 200:
                outcome = f"{response.status} {data[:200]!r}"
            else:
                y = decode_response(data, int(header) if header else None)["output0"]
                outcome = "" if np.allclose(y, expected[turn % len(bodies)], rtol=1e-4, atol=1e-5) else "wrong values"
            with lock:
                latencies.append(elapsed)
                if outcome:
                    wrong.append(outcome)
                if len(latencies) >= max_requests:
                    stop.set()
            turn += clients
        connection.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    cpu_before, start = server_cpu_seconds(root), time.perf_counter()
    for thread in threads:
        thread.start()
    stop.wait(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    wall, cpu = time.perf_counter() - start, server_cpu_seconds(root) - cpu_before
    if wrong:
        raise SystemExit(f"{len(wrong)} wrong response(s), e.g. {wrong[0]}")
    ms = np.array(latencies) * 1e3
    return {"requests": len(ms), "rps": len(ms) / wall, "p50": float(np.percentile(ms, 50)),
            "p99": float(np.percentile(ms, 99)), "cpu_ms": cpu / len(ms) * 1e3}


def warm_up(port: int, path: str, bodies: list) -> None:
    """A few requests first: the replica plans this shape, the connection is made."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    for body, headers in (make() for make in bodies[:3]):
        connection.request("POST", path, body, headers)
        response = connection.getresponse()
        response.read()
        assert response.status == 200, response.status
    connection.close()


def encoder(x: np.ndarray, binary: bool, pre_encoded: bool):
    """What makes a request's body and headers: encoding `x`, or handing out bytes made once."""
    if pre_encoded:
        made = encode_request({"x": x}, binary=binary)
        return lambda: made
    return lambda: encode_request({"x": x}, binary=binary)


def direct(model: Path, inputs: dict[int, list[np.ndarray]], calls: int = 2000) -> dict[int, float]:
    """Microseconds per module.main call, best of 5 rounds of `calls`."""
    module = hexir_runtime.load(model, CpuDevice(threads=1), prints=False)
    result = {}
    for rows, arrays in inputs.items():
        rounds = []
        for _ in range(5):
            start = time.perf_counter()
            for i in range(calls):
                module.main(arrays[i % len(arrays)])
            rounds.append((time.perf_counter() - start) / calls * 1e6)
        result[rows] = min(rounds)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="traffic per configuration (default 3)")
    parser.add_argument("--max-requests", type=int, default=3000, help="at most this many per configuration")
    parser.add_argument("--pre-encoded", action="store_true", help="encode the request bodies beforehand")
    parser.add_argument("--wide", action="store_true", help="add the rows of a wide MLP (see above)")
    parser.add_argument("--out", help="also write the report (markdown) here")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="hexir-serve-bench-"))
    model = hexir.export(mlp, folder / "mlp.hxb", hexir.TensorSpec(("batch", 784), "float32"))
    inputs = {rows: [rng.random((rows, 784), np.float32) for _ in range(8)] for rows in (1, 64)}
    expected = {rows: [np.maximum(x @ W1, 0) @ W2 for x in arrays] for rows, arrays in inputs.items()}
    bodies = {(rows, binary): [encoder(x, binary, args.pre_encoded) for x in arrays]
              for rows, arrays in inputs.items() for binary in (False, True)}
    lines = ["| max-batch | encoding | rows | clients | requests | req/s | p50 ms | p99 ms | server CPU ms/req |",
             "|---|---|---|---|---|---|---|---|---|"]
    for rows, micros in direct(model, inputs).items():
        lines.append(f"| (module.main) | - | {rows} | 1 | 5 x 2000 | {1e6 / micros:,.0f} | {micros / 1e3:.3f} "
                     "| - | - |")
    results = {}
    if args.wide:
        wide_model = hexir.export(wide, folder / "wide.hxb", hexir.TensorSpec(("batch", 784), "float32"))
        wide_inputs = {rows: [rng.random((rows, 784), np.float32) for _ in range(8)] for rows in (1, 32)}
        wide_rows = [f"| (module.main) | - | {rows} | 1 | 5 x 20 | {1e6 / micros:,.0f} | {micros / 1e3:.3f} | - | - |"
                     for rows, micros in direct(wide_model, wide_inputs, 20).items()]
    server = Server(model, *([wide_model] if args.wide else []))
    try:
        for rows in (1, 64):
            for clients in (1, 32):
                for binary in (False, True):
                    for max_batch in (1, 32):
                        path = f"/v2/models/b{max_batch}/infer"
                        warm_up(server.port, path, bodies[rows, binary])
                        result = results[max_batch, binary, rows, clients] = load(
                            server.port, path, bodies[rows, binary], expected[rows], clients, args.seconds,
                            args.max_requests, server.process.pid)
                        lines.append(f"| {max_batch} | {'binary' if binary else 'JSON'} | {rows} | {clients} | "
                                     f"{result['requests']} | {result['rps']:,.1f} | {result['p50']:.1f} | "
                                     f"{result['p99']:.1f} | {result['cpu_ms']:.1f} |")
                        print(lines[-1], flush=True)
        if args.wide:
            wide_bodies = [encoder(x, True, args.pre_encoded) for x in wide_inputs[1]]
            for clients in (1, 32):
                for max_batch in (1, 32):
                    path = f"/v2/models/w{max_batch}/infer"
                    warm_up(server.port, path, wide_bodies)
                    result = results["wide", max_batch, clients] = load(
                        server.port, path, wide_bodies, [wide_reference(x) for x in wide_inputs[1]], clients,
                        args.seconds, args.max_requests, server.process.pid)
                    wide_rows.append(f"| {max_batch} | binary | 1 | {clients} | {result['requests']} | "
                                     f"{result['rps']:,.1f} | {result['p50']:.1f} | {result['p99']:.1f} | "
                                     f"{result['cpu_ms']:.1f} |")
                    print(wide_rows[-1], flush=True)
    finally:
        server.stop()
    lines.append("")
    for binary in (False, True):
        for rows in (1, 64):
            gain = results[32, binary, rows, 32]["rps"] / results[1, binary, rows, 32]["rps"]
            lines.append(f"- batching, {'binary' if binary else 'JSON'} {rows}-row, 32 clients: max-batch 32 / "
                         f"max-batch 1 = {gain:.2f}x (target >= 3x)")
    for max_batch in (1, 32):
        for clients in (1, 32):
            gain = results[max_batch, True, 64, clients]["rps"] / results[max_batch, False, 64, clients]["rps"]
            lines.append(f"- binary / JSON, 64x784 f32, max-batch {max_batch}, {clients} client(s): {gain:.2f}x "
                         "(target >= 5x)")
    if args.wide:
        title = "Additional rows: the wide MLP, 784 -> 4096 -> 4096 -> 10 (`--wide`)"
        lines += ["", title, "", *lines[:2], *wide_rows, ""]
        for clients in (1, 32):
            gain = results["wide", 32, clients]["rps"] / results["wide", 1, clients]["rps"]
            lines.append(f"- batching, wide MLP, binary 1-row, {clients} client(s): max-batch 32 / max-batch 1 = "
                         f"{gain:.2f}x")
    lines.append("- every response checked against numpy: all correct")
    encoded = "encoded beforehand" if args.pre_encoded else "encoded by each client per request"
    lines.append(f"- request bodies {encoded}")
    publish(lines, args.out)


def publish(lines: list[str], out: str | None) -> None:
    """Print a report (markdown lines) and, with --out, write it there too (bench/serve_cpu.py's also)."""
    report = "\n".join(lines)
    print(report)
    if out:
        Path(out).write_text(report + "\n")


if __name__ == "__main__":
    main()
