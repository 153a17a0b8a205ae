"""`hexir-run serve MODEL.hxb [MORE.hxb ...]`: serve modules on Ray Serve until SIGINT or SIGTERM.

Every module is read and checked before Ray starts (a bad file fails in a second, not after a
cluster came up). Without `--address` it starts a one-node Ray cluster whose own sockets stay on
127.0.0.1 (only the HTTP proxy listens on `--host`), and on a signal stops the applications and
that cluster: nothing it started is left. With `--address` it joins a running cluster (its
replicas go wherever the cluster places them) and on a signal deletes only its own
applications. Exit codes as `hexir-run`'s: 0 stopped by a signal, 1 failure, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import re
import signal
import socket
import sys
from typing import Any

from .. import signing
from ..describe import safe
from ..errors import HexirRuntimeError, HxbFormatError, KeyFileError
from ..format import decode

INSTALL = "hexir-run serve needs Ray Serve: pip install 'hexir-runtime[serve]'"
# Set before Ray is imported, inherited by every process of a cluster this command starts:
# what keeps its sockets on 127.0.0.1 (with ray.init's _node_ip_address; Ray otherwise takes the
# host's interface address as the node's) on ports the OS picks (two metrics servers' are fixed
# otherwise; ray.py's init_local frees the third), no usage reports, the proxy's JSON errors, and
# requests from the proxy to replicas over gRPC, not actor calls (a fifth less CPU per request,
# bench/results/2026-12-02-serve.md), with gRPC's 4 MB cap on a response lifted.
CLUSTER_ENVIRONMENT = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
                       "AUTOSCALER_METRIC_PORT": "0", "DASHBOARD_METRIC_PORT": "0",
                       "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "hexir_runtime.serving.ray.proxy_middlewares",
                       "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1", "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(2**31-1)}
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # a model's name is one URL path segment


class Stop(BaseException):
    """SIGINT or SIGTERM arrived: unwind and stop."""


class _Signals:
    """Where a signal may interrupt: anywhere but inside a call into Ray, where an exception raised
    asynchronously once made the process crash as it shut Ray down; there the first one is held
    until the call returns (`_in_ray`), a second one interrupts it all the same."""

    in_ray = False
    held = False


def _stop(signum: int, frame: Any) -> None:
    if _Signals.in_ray and not _Signals.held:
        _Signals.held = True
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the cleanup that follows runs to its end
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Stop


def _in_ray(call: Any, *args: Any, **keywords: Any) -> Any:
    """`call(...)` with signals held until it returns; then Stop if one came."""
    _Signals.in_ray = True
    try:
        return call(*args, **keywords)
    finally:
        _Signals.in_ray = False
        if _Signals.held:
            _Signals.held = False
            _stop(signal.SIGTERM, None)


def main(argv: list[str]) -> int:
    """Run `hexir-run serve` with `argv` (the arguments after `serve`); return the exit code."""
    args = _parser().parse_args(argv)
    # from here on a signal stops quietly (even while Ray is imported); the caller's handlers come back at the end
    previous = {number: signal.signal(number, _stop) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _checked_serve(args)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _checked_serve(args: argparse.Namespace) -> int:
    """Check the files and options, import Ray, serve."""
    try:
        keys = signing.trusted_keys(args.trust) if args.trust else None
    except KeyFileError as error:  # a key the user named: a bad argument, found before any work
        print(f"hexir-run serve: error: --trust {safe(str(error))}", file=sys.stderr)
        return 2
    try:
        models = _read_models(args.models, keys)
        if args.num_gpus > 0 and args.device in ("cpu", "reference"):
            raise HexirRuntimeError(f"--num-gpus {args.num_gpus} runs replicas on cuda, not --device {args.device}")
        if args.num_gpus == 0 and args.device == "cuda":
            raise HexirRuntimeError("--device cuda needs --num-gpus > 0 (a GPU per replica)")
        replicas = args.replicas if args.replicas == "auto" else int(args.replicas)
        needed = len(models) * (1 if replicas == "auto" else replicas) * args.num_cpus
        if args.address is None and needed > (os.cpu_count() or 1):  # Ray would wait for them forever
            raise HexirRuntimeError(f"{len(models)} model(s) x {replicas} replica(s) x {args.num_cpus:g} CPU(s) "
                                    f"need {needed:g} CPUs, this machine has {os.cpu_count()}: lower --replicas "
                                    "or --num-cpus, or join a cluster with --address")
        _check_port(args.host, args.port)  # Ray's proxy would retry a port in use for ever
        if args.address is None:
            os.environ.update(CLUSTER_ENVIRONMENT)  # inherited by every process of the cluster
        try:
            from . import ray as engine
        except ImportError as error:
            raise HexirRuntimeError(f"{INSTALL} ({error})") from None
    except HexirRuntimeError as error:
        return _fail(str(error))
    except Stop:
        return 0
    options = {"replicas": replicas, "num_cpus": args.num_cpus, "num_gpus": args.num_gpus,
               "max_batch": args.max_batch, "batch_wait_ms": args.batch_wait_ms, "device": args.device,
               "prints": args.prints, "access_log": args.access_log}
    return _serve(engine, models, args, options)


def _serve(engine: Any, models: dict[str, bytes], args: argparse.Namespace, options: dict[str, Any]) -> int:
    """Start (or join) Ray, deploy, wait for a signal, then stop everything that was started."""
    import ray
    from ray import serve

    started = deployed = False
    code = 0
    try:
        if args.address is None:
            started = True
            # "local": a new cluster even where `ray start` left one on this machine, which
            # ray.init() would otherwise join (and whose Serve the stop would shut down)
            _in_ray(engine.init_local)
        else:
            _in_ray(ray.init, address=args.address, log_to_driver=False, configure_logging=False)
        signal.signal(signal.SIGINT, _stop)  # ray.init sets its own SIGTERM handler
        signal.signal(signal.SIGTERM, _stop)
        deployed = True
        _in_ray(engine.start, args.host, args.port, args.access_log)
        for name, source in models.items():
            _in_ray(engine.deploy_model, name, source, **options)
        _in_ray(engine.deploy_server, list(models))
        for name in models:
            print(f"serving {name} at http://{_url_host(args.host)}:{args.port}/v2/models/{name}", flush=True)
        print("ready (SIGINT or SIGTERM stops)", flush=True)
        while True:
            signal.pause()
    except Stop:
        pass
    except (HexirRuntimeError, RuntimeError, ValueError, ConnectionError, ray.exceptions.RayError) as error:
        code = _fail(f"serving failed: {type(error).__name__}: {error}")
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("stopping", file=sys.stderr, flush=True)
        if deployed and started:
            serve.shutdown()
        elif deployed:
            engine.undeploy(list(models))
        if ray.is_initialized():
            ray.shutdown()  # stops the cluster this process started; only disconnects from one it joined
    return code


def _read_models(paths: list[str], keys: Any = None) -> dict[str, bytes]:
    """Each module's bytes by name (its file's stem), checked: format, entry main, a unique usable
    name, and with `keys` a signature by one of them (the replicas load these bytes, not the file)."""
    models: dict[str, bytes] = {}
    for path in paths:
        name = os.path.splitext(os.path.basename(path))[0]
        if not NAME.fullmatch(name):
            raise HexirRuntimeError(f"{path}: the model's name {name!r} (the file's stem) must be letters, digits, "
                                    "'_', '.' or '-'")
        if name in models:
            raise HexirRuntimeError(f"{path}: a second model named {name!r} (a model's name is its file's stem)")
        try:
            with open(path, "rb") as file:
                data = file.read()
            if keys is not None:
                signing.verify(data, keys)
            entries = [entry.name for entry in decode(data).manifest.entries]
        except OSError as error:
            raise HexirRuntimeError(f"{path}: {error.strerror or error}") from None
        except HxbFormatError as error:
            raise HexirRuntimeError(f"{path}: {error}") from None
        if "main" not in entries:
            raise HexirRuntimeError(f"{path}: no entry main to serve (entries: {', '.join(entries) or 'none'})")
        models[name] = data
    return models


def _check_port(host: str, port: int) -> None:
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family) as probe:
            probe.bind((host, port))
    except OSError as error:
        raise HexirRuntimeError(f"cannot listen on {host} port {port}: {error.strerror or error}") from None


def _url_host(host: str) -> str:
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        return host


def _fail(message: str) -> int:
    print(f"hexir-run serve: {safe(message)}", file=sys.stderr)
    return 1


def _replicas(text: str) -> str:
    if text == "auto" or (text.isdigit() and int(text) >= 1):
        return text
    raise argparse.ArgumentTypeError(f"expected a count of at least 1 or auto, got {text!r}")


def _positive(kind: type, limit: float = math.inf) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = -1
        if not value >= 0 or (kind is int and value < 1) or not math.isfinite(value) or value > limit:
            wanted = "number >= 0" if kind is float else "count >= 1" if limit == math.inf else f"count 1-{limit}"
            raise argparse.ArgumentTypeError(f"expected a {wanted}, got {text!r}")
        return value
    return parse


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hexir-run serve",
        description="Serve .hxb modules over the Open Inference Protocol (KServe v2) on Ray Serve "
                    "until SIGINT or SIGTERM. A model's name is its file's stem; docs/serving.md.",
    )
    parser.add_argument("models", nargs="+", metavar="MODEL.hxb", help="the modules to serve (entry main)")
    parser.add_argument("--host", default="127.0.0.1", help="where the HTTP proxy listens (default 127.0.0.1)")
    parser.add_argument("--port", type=_positive(int, 65535), default=8000, help="its port (default 8000)")
    parser.add_argument("--replicas", type=_replicas, default="1", help="replicas per model: a count, or auto "
                        "(Ray's autoscaling) (default 1)")
    parser.add_argument("--num-cpus", type=_positive(float), default=1.0,
                        help="CPUs per replica, also its kernel threads (rounded up) (default 1)")
    parser.add_argument("--num-gpus", type=_positive(float), default=0.0,
                        help="GPUs per replica (fractions share one); > 0 runs on cuda (default 0)")
    parser.add_argument("--max-batch", type=_positive(int), default=32,
                        help="most requests one call runs together (default 32)")
    parser.add_argument("--batch-wait-ms", type=_positive(float), default=2.0,
                        help="how long a batch waits to fill (default 2)")
    parser.add_argument("--trust", action="append", default=[], metavar="KEYFILE",
                        help="serve only modules signed by this key (an Ed25519 public key in PEM; repeatable)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda", "reference"), default="auto",
                        help="as hexir-run's; auto: cuda with --num-gpus, else cpu (default auto)")
    parser.add_argument("--address", help="join this running Ray cluster (the head's HOST:PORT) instead of "
                        "starting a one-node one on loopback")
    parser.add_argument("--prints", action="store_true", help="let hexir.print write to the replicas' logs "
                        "(off: it slows every call)")
    parser.add_argument("--access-log", action="store_true", help="let Ray log a line per request (proxy and "
                        "replica; off: it costs CPU on every request)")
    return parser
