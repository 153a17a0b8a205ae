"""Where a served request's CPU goes: per Ray process (proxy, replica, controller, raylet, GCS...),
CPU milliseconds per request of a 1-row binary request to the 784 -> 64 -> 10 MLP of
bench/serve.py, with the cluster's idle CPU (measured over the same time, no traffic) taken off.

    python bench/serve_cpu.py [--requests 300] [--rounds 3] [--variant NAME:VAR=VALUE,... ...] [--out FILE]

It starts one server of bench/serve.py per `--variant` (b1: max-batch 1, b32: max-batch 32, one
replica of 1 CPU each, on 127.0.0.1), each with its variables set in its cluster's environment
(Ray's switches are environment variables that every process of the cluster reads;
HEXIR_BENCH_ACCESS_LOG=1 turns Ray's access logs on), all at once, so that each round measures
the variants in turn under the same load: `--requests` from 1 client to b1 one after the other,
then `--requests` from 32 clients to b32. Per process: its CPU over a run (from /proc/PID/stat)
minus its idle rate (5 s without traffic) times the run's time, per request. Every response is
checked against numpy.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
spec = importlib.util.spec_from_file_location("serve_bench", HERE / "serve.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)  # the model, the server, the clients of bench/serve.py


def role(pid: int) -> str:
    """What a process of the cluster is, from its command line."""
    line = bench.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    for key, name in (("gcs_server", "gcs_server"), ("raylet", "raylet"), ("ServeController", "controller"),
                      ("ProxyActor", "proxy"), ("ServeReplica:b1:", "replica b1"),
                      ("ServeReplica:b32:", "replica b32"), ("ServeReplica:hexir:", "replica hexir (/)"),
                      ("dashboard/agent", "dashboard agent"), ("runtime_env", "runtime_env agent"),
                      ("log_monitor", "log_monitor"), ("ray::IDLE", "idle workers"), ("-c", "driver")):
        if key in line:
            return name
    return line[:40] or "?"


def cpu_by_role(root: int) -> dict[str, float]:
    """CPU seconds of `root` and its live descendants, summed per role."""
    totals: dict[str, float] = defaultdict(float)
    for pid, seconds in bench.process_cpu_seconds(root).items():
        try:
            totals[role(pid)] += seconds
        except OSError:  # gone meanwhile
            pass
    return totals


def measure(root: int, run) -> tuple[dict[str, float], float]:
    before, start = cpu_by_role(root), time.perf_counter()
    run()
    wall, after = time.perf_counter() - start, cpu_by_role(root)
    return {name: after[name] - before.get(name, 0.0) for name in after}, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="per client setting and round (default 300)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the variants (default 3)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME[:VAR=VALUE,...]",
                        help="a server started with these variables set (repeatable; default: Ray's defaults)")
    parser.add_argument("--out", help="also write the report here")
    args = parser.parse_args()
    variants = {}
    for text in args.variant or ["defaults"]:
        name, _, settings = text.partition(":")
        variants[name] = dict(item.split("=", 1) for item in settings.split(",") if item)
    folder = Path(tempfile.mkdtemp(prefix="hexir-serve-cpu-"))
    model = bench.hexir.export(bench.mlp, folder / "mlp.hxb", bench.hexir.TensorSpec(("batch", 784), "float32"))
    inputs = [bench.rng.random((1, 784), np.float32) for _ in range(8)]
    expected = [np.maximum(x @ bench.W1, 0) @ bench.W2 for x in inputs]
    bodies = [bench.encoder(x, True, True) for x in inputs]
    report = [f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}"]
    servers = {}
    try:
        for name, settings in variants.items():  # all at once, measured in turn: the same load for each
            saved = dict(os.environ)
            os.environ.update(settings)  # the server's cluster inherits them
            try:
                servers[name] = bench.Server(model)
            finally:
                os.environ.clear()
                os.environ.update(saved)
        for server in servers.values():
            for path in ("/v2/models/b1/infer", "/v2/models/b32/infer"):
                bench.warm_up(server.port, path, bodies)
        time.sleep(2)  # the warm-up's own after-work settles
        idle = {}
        for name, server in servers.items():
            idle[name] = measure(server.process.pid, lambda: time.sleep(5))
        used: dict = defaultdict(lambda: defaultdict(float))  # (variant, setting) -> role -> CPU s
        counts: dict = defaultdict(list)  # (variant, setting) -> [(requests, req/s)]
        for _ in range(args.rounds):
            for name, server in servers.items():
                for setting, path, clients in (("1 client -> b1", "/v2/models/b1/infer", 1),
                                               ("32 clients -> b32", "/v2/models/b32/infer", 32)):
                    result = {}

                    def run(path=path, clients=clients, result=result, port=server.port, root=server.process.pid):
                        result.update(bench.load(port, path, bodies, expected, clients, 600, args.requests, root))
                    cpu, wall = measure(server.process.pid, run)
                    idle_cpu, idle_wall = idle[name]
                    for role_name, seconds in cpu.items():
                        used[name, setting][role_name] += seconds - idle_cpu.get(role_name, 0.0) / idle_wall * wall
                    counts[name, setting].append((result["requests"], result["rps"]))
    finally:
        for server in servers.values():
            server.stop()
    for name, settings in variants.items():
        report.append(f"\n**{name}**: {' '.join(f'{k}={v}' for k, v in settings.items()) or '(no variables)'}; "
                      f"idle CPU {sum(idle[name][0].values()) / idle[name][1] * 1e3:.0f} ms/s\n")
        report.append("| process | " + " | ".join(f"{setting}: ms/req" for setting in ("1 client -> b1",
                                                                                         "32 clients -> b32")) + " |")
        report.append("|---|---|---|")
        per = {setting: {role_name: seconds / sum(n for n, _ in counts[name, setting]) * 1e3
                         for role_name, seconds in used[name, setting].items()}
               for setting in ("1 client -> b1", "32 clients -> b32")}
        first = per["1 client -> b1"]
        for role_name in sorted(first, key=lambda role_name: -first[role_name]):
            if max(abs(per[setting].get(role_name, 0.0)) for setting in per) >= 0.3:
                report.append(f"| {role_name} | " + " | ".join(f"{per[setting].get(role_name, 0.0):.1f}"
                                                               for setting in per) + " |")
        report.append("| **total** (all processes) | " + " | ".join(f"**{sum(values.values()):.1f}**"
                                                                    for values in per.values()) + " |")
        report.append("| req/s per round | " + " | ".join(", ".join(f"{rps:.0f}" for _, rps in counts[name, setting])
                                                       for setting in per) + " |")
    report.append(f"\nload average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; every response correct")
    bench.publish(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
