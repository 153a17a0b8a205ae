"""Ray Serve applications serving .hxb modules over the Open Inference Protocol (protocol.py).

Each model is one application, `/v2/models/{name}` (its name: the file's stem), whose replicas
load the module once, check each request against the entry's signature alone, then let
`@serve.batch` gather requests into one call (`protocol.run_batched`); a server application at
`/` answers `/v2`, `/v2/health/live`, `/v2/health/ready` (every model answers) and 404 for an
unknown model. The proxy routes a request straight to its model's replicas (one hop).

    hexir-run serve mlp.hxb --replicas 2             # serving/command.py: start, serve, stop on a signal
    serve run config.yaml                            # Ray's own: model_app / server_app below

Importing this module imports Ray; the rest of the runtime never does.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import os
from collections.abc import Sequence
from typing import Any

import ray
from ray import serve
from ray.serve import Application
from starlette.middleware import Middleware
from starlette.requests import Request as HttpRequest
from starlette.responses import Response

from .. import __version__
from ..cpu import CpuDevice
from ..errors import HexirRuntimeError, InputError
from ..module import load
from . import protocol

READY_TIMEOUT_S = 10.0  # how long /v2/health/ready waits for each model to answer


def _json(status: int, document: dict[str, Any]) -> Response:
    return Response(json.dumps(document), status_code=status, media_type="application/json")


def _error(status: int, message: str) -> Response:
    return _json(status, {"error": message})


class ProtocolErrors:
    """ASGI middleware for Ray's HTTP proxy: a request that Ray fails before its replica answered
    (the replica died with it in flight) gets the protocol's JSON error, not uvicorn's plain-text 500."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        started = False

        async def watched(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        await self.app(scope, receive, watched)
        if scope["type"] == "http" and not started:
            body = json.dumps({"error": f"{scope.get('path')}: Ray Serve failed the request before a replica answered "
                                        "(one died or stopped with it in flight; Ray's log says why): retry"}).encode()
            await send({"type": "http.response.start", "status": 500, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})


def _bind_replica_grpc_to_node_address() -> None:
    """Ray 2.60 binds each replica's inter-deployment gRPC server to every interface ("[::]:0");
    bind it to the node's own address instead (127.0.0.1 on a loopback node, still reachable
    from other nodes on a cluster). Runs in every replica, which imports this module."""
    try:
        from ray.serve._private import replica
    except ImportError:
        return
    original = getattr(replica, "add_port_to_grpc_server", None)
    if original is None or getattr(original, "hexir_bound", False):
        return

    def add_port(server: Any, address: str) -> Any:
        if address.startswith("[::]:"):
            node = ray.util.get_node_ip_address()
            address = f"{f'[{node}]' if ':' in node else node}:{address[5:]}"
        return original(server, address)
    add_port.hexir_bound = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = add_port


_bind_replica_grpc_to_node_address()


def replica_device(device: str, num_cpus: float, num_gpus: float) -> Any:
    """What a replica loads its module on: cuda when it has a GPU, else a CPU pool of
    ceil(num_cpus) threads (Ray does not pin replicas; the pool would take every core)."""
    if num_gpus > 0:
        if device not in ("auto", "cuda"):
            raise InputError(f"a replica with a GPU (num_gpus={num_gpus}) runs on cuda, not {device}")
        return "cuda"
    if device == "cuda":
        raise InputError("device cuda needs a GPU per replica: give num_gpus > 0")
    return "reference" if device == "reference" else CpuDevice(threads=max(1, math.ceil(num_cpus)))


@serve.deployment(name="HexirModel")
class HexirModel:
    """One replica of a model: `GET ""` (metadata), `GET /ready`, `POST /infer` under its route."""

    def __init__(self, name: str, source: bytes | str, device: str = "auto", num_cpus: float = 1.0,
                 num_gpus: float = 0.0, max_batch: int = 32, batch_wait_ms: float = 2.0, prints: bool = False,
                 entry: str = "main") -> None:
        self.name, self.entry = name, entry
        self.module = load(source, replica_device(device, num_cpus, num_gpus), prints=prints)
        self.signature = self.module.signature(entry)
        self.symbol = protocol.batch_symbol(self.signature)
        self.metadata = protocol.metadata(name, self.signature)
        self.infer_batch.set_max_batch_size(max_batch)
        self.infer_batch.set_batch_wait_timeout_s(batch_wait_ms / 1000)

    def ready(self) -> bool:
        return not self.module.closed

    async def __call__(self, request: HttpRequest) -> Response:
        path = request.url.path[len(request.scope.get("root_path", "")):].rstrip("/")
        if path in ("", "/ready") and request.method == "GET":
            return _json(200, self.metadata if not path else {"name": self.name, "ready": self.ready()})
        if path != "/infer":
            return _error(404, f"no endpoint {request.url.path} (model {self.name!r} has {{,/ready,/infer}})")
        if request.method != "POST":
            return _error(405, f"{request.url.path} takes POST")
        try:  # a ProtocolError: the request's (400), or an output the protocol cannot carry (500)
            length = protocol.header_length(request.headers.get(protocol.HEADER_LENGTH))
            decoded = protocol.decode_request(await request.body(), self.signature, length)
            result = await self.infer_batch(decoded.arrays)  # (a call's error comes back as its result)
            if isinstance(result, BaseException):
                return _error(400 if isinstance(result, InputError) else 500, f"model {self.name!r}: {result}")
            body, headers = protocol.encode_response(self.name, self.signature, decoded, result)
        except protocol.ProtocolError as error:
            return _error(error.status, f"model {self.name!r}: {error}")
        return Response(body, headers=headers)

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.002)
    async def infer_batch(self, requests: list[tuple[Any, ...]]) -> list[Any]:
        # a thread, so that the replica keeps reading and checking requests while the module runs
        call = functools.partial(self.module.run, self.entry)
        return await asyncio.to_thread(protocol.run_batched, call, requests, self.symbol)


@serve.deployment(name="HexirServer")
class HexirServer:
    """`/v2` (server metadata), `/v2/health/live`, `/v2/health/ready`, and 404 for what no model serves."""

    def __init__(self, models: Sequence[str]) -> None:
        self.models = list(models)

    async def _ready(self, name: str) -> bool:
        handle = serve.get_deployment_handle("HexirModel", app_name=name)
        try:
            return bool(await asyncio.wait_for(_awaited(handle.ready.remote()), READY_TIMEOUT_S))
        except (asyncio.TimeoutError, ray.exceptions.RayError, RuntimeError, ValueError):
            return False

    async def __call__(self, request: HttpRequest) -> Response:
        path = request.url.path.rstrip("/")
        if path == "/v2":
            return _json(200, {"name": "hexir", "version": __version__, "extensions": [protocol.BINARY_EXTENSION]})
        if path == "/v2/health/live":
            return _json(200, {"live": True})
        if path == "/v2/health/ready":
            answers = await asyncio.gather(*(self._ready(name) for name in self.models))
            return _json(200 if all(answers) else 503, {"ready": all(answers)})
        if path.startswith("/v2/models/"):
            name = path.split("/")[3]
            return _error(404, f"unknown model {name!r} (models: {', '.join(self.models) or 'none'})")
        return _error(404, f"no endpoint {request.url.path} (the Open Inference Protocol's are under /v2)")


async def _awaited(response: Any) -> Any:
    return await response


def model_application(source: bytes | str, name: str, *, replicas: int | str = 1, num_cpus: float = 1.0,
                      num_gpus: float = 0.0, max_batch: int = 32, batch_wait_ms: float = 2.0,
                      device: str = "auto", prints: bool = False, access_log: bool = False) -> Application:
    """The application serving one module (`source`: its bytes, or a path every node can read)
    as `name`, to be run at route prefix `/v2/models/{name}`. `replicas` is a count or "auto"
    (Ray's autoscaling, aiming at `max_batch` requests in flight per replica); `access_log`:
    Ray's line per request in the replica's log."""
    replica_device(device, num_cpus, num_gpus)  # a contradiction fails here, not in every replica
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": num_cpus, "num_gpus": num_gpus},
        "logging_config": {"enable_access_log": access_log},
        # Serve's default of 5 in flight per replica would cap every batch at 5 requests
        "max_ongoing_requests": max(2 * max_batch, 16),
    }
    if replicas == "auto":
        options["autoscaling_config"] = {"min_replicas": 1, "target_ongoing_requests": max(2, max_batch)}
    else:
        options["num_replicas"] = int(replicas)
    return HexirModel.options(**options).bind(name, source, device, num_cpus, num_gpus, max_batch, batch_wait_ms,
                                              prints)


def server_application(models: Sequence[str]) -> Application:
    """The application at `/` answering health, server metadata and unknown models."""
    return HexirServer.options(num_replicas=1, ray_actor_options={"num_cpus": 0}).bind(list(models))


def model_app(args: dict[str, Any]) -> Application:
    """Builder for Ray's config files: `import_path: hexir_runtime.serving.ray:model_app`, `args:`
    `path` (the .hxb, readable on every node), and optionally `name` (default: the file's stem)
    and model_application's options."""
    options = dict(args)
    path = options.pop("path")
    name = options.pop("name", os.path.splitext(os.path.basename(path))[0])
    return model_application(path, name, **options)


def server_app(args: dict[str, Any]) -> Application:
    """Builder for Ray's config files: `import_path: hexir_runtime.serving.ray:server_app`,
    `args: {models: [mlp, ...]}`, route prefix `/`."""
    return server_application(list(args["models"]))


def init_local() -> None:
    """ray.init of a new one-node cluster on 127.0.0.1 (with command.CLUSTER_ENVIRONMENT set before
    Ray was imported) on ports the OS picks: ray.init leaves all to it but two metrics servers'
    (CLUSTER_ENVIRONMENT's) and the dashboard agent's HTTP port, 52365 (two clusters on one
    machine would collide); None picks one, as Ray's own test clusters do."""
    parameter = ray._private.parameter
    original = parameter.RayParams
    parameter.RayParams = functools.partial(original, dashboard_agent_listen_port=None)
    try:
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    finally:
        parameter.RayParams = original


def proxy_middlewares() -> list[Middleware]:
    """What Ray's HTTP proxy wraps its app in, where the cluster's environment has
    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=hexir_runtime.serving.ray.proxy_middlewares
    (command.CLUSTER_ENVIRONMENT; Ray 2.60 takes no middleware from serve.start)."""
    return [Middleware(ProtocolErrors)]


def start(host: str, port: int, access_log: bool = False) -> None:
    """Start Serve on the connected cluster, its HTTP proxy at host:port; `access_log`: the
    proxy's line per request in its log."""
    serve.start(http_options={"host": host, "port": port}, logging_config={"enable_access_log": access_log})


def deploy(models: dict[str, bytes | str], **options: Any) -> None:
    """Run every model's application and the server's on the connected Ray cluster (serve.start
    first sets where the proxy listens); returns once all are ready."""
    for name, source in models.items():
        deploy_model(name, source, **options)
    deploy_server(list(models))


def deploy_model(name: str, source: bytes | str, **options: Any) -> None:
    """Run one model's application at /v2/models/{name}; returns once it is ready."""
    serve.run(model_application(source, name, **options), name=name, route_prefix=f"/v2/models/{name}")


def deploy_server(models: Sequence[str]) -> None:
    """Run the server's application at / for these models; returns once it is ready."""
    serve.run(server_application(list(models)), name="hexir", route_prefix="/")


def undeploy(models: Sequence[str]) -> None:
    """Delete the applications `deploy` ran (other applications on the cluster stay)."""
    for name in [*models, "hexir"]:
        try:
            serve.delete(name)
        except (HexirRuntimeError, RuntimeError, ray.exceptions.RayError):
            pass
