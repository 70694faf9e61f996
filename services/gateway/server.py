"""The gateway process: OpenAI-compatible HTTP and the ZeroMQ client protocol, in front
of the cluster. Imports no torch: the model's tokenizer and context length come from a
child process (:mod:`services.gateway.model_info`) or from settings.

Stopping: on SIGINT/SIGTERM, or at once when a loop it cannot live without dies (the
token dispatcher, the ZeroMQ front-end, the HTTP server). Requests still open get
``shutdown_grace_s`` to finish; then their connections are closed.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass

import structlog
import uvicorn

from common.config import load_settings
from common.logging import configure_logging
from common.service_main import run_service, until_stopped
from common.tokenizer import TextTokenizer
from common.tracing import Tracer
from common.zmq_auth import make_context
from common.zmq_metrics import ControlMetrics
from services.engine.model_config import preset  # shapes only: imports no torch
from services.gateway.cluster_backend import ClusterBackend
from services.gateway.failover import FailoverSettings
from services.gateway.model_info import describe_model
from services.gateway.openai_api import create_app
from services.gateway.pipeline import RequestPipeline
from services.gateway.zmq_frontend import ZmqFrontend

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    model: str = "smollm2-135m-instruct"
    served_model_name: str = ""  # name clients use; empty: the model setting
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    zmq_addr: str = "tcp://127.0.0.1:5550"
    conductor_addr: str = "tcp://127.0.0.1:5551"
    stream_bind: str = "tcp://127.0.0.1:5553"  # where workers push tokens
    stream_advertise: str = ""  # address workers should use, if not stream_bind
    tokenizer_dir: str = ""  # empty: derived from the model
    # The shape preset the workers serve with random weights (their --random-weights):
    # the tokenizer and context length are the preset's; `model` is then only a name.
    random_weights: str = ""
    max_model_len: int = 0  # 0: the model's context length
    api_keys: tuple[str, ...] = ()  # required on HTTP and the ZeroMQ port when set
    request_timeout_s: float = 600.0
    max_body_bytes: int = 4 << 20  # larger HTTP bodies are answered 413
    shutdown_grace_s: float = 5.0  # how long open requests may run on after a stop
    # A stream whose decode worker died waits this long for another to continue it.
    decode_failover_wait_s: float = 30.0
    # A new request waits this long for a live decode worker when the conductor has
    # none (right after a conductor restart, before workers re-register); then 503.
    route_wait_s: float = 5.0
    log_format: str = "json"
    curve_keys_dir: str = ""  # CURVE keys (pdserve keys); empty: plain, trusted host only
    tracing: bool = False  # OpenTelemetry spans (docs/tracing.md)
    tracing_endpoint: str = ""  # OTLP/HTTP collector, e.g. http://127.0.0.1:4318/v1/traces
    tracing_file: str = ""  # spans as JSON lines, one file per process

    def __post_init__(self) -> None:
        if self.random_weights:
            preset(self.random_weights)  # ValueError naming the known presets
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if not 0 <= self.shutdown_grace_s < float("inf"):
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        self.failover()  # raises if out of range

    def failover(self) -> FailoverSettings:
        return FailoverSettings(wait_s=self.decode_failover_wait_s,
                                route_wait_s=self.route_wait_s)


async def serve(settings: GatewaySettings, stop: asyncio.Event) -> None:
    http_sock = _bind_http(settings.http_host, settings.http_port)  # a port in use fails fast
    try:
        await _serve(settings, stop, http_sock)
    finally:
        http_sock.close()


async def _serve(settings: GatewaySettings, stop: asyncio.Event,
                 http_sock: socket.socket) -> None:
    name = settings.served_model_name or settings.model
    if settings.tokenizer_dir and settings.max_model_len:
        tok_dir, max_len = settings.tokenizer_dir, settings.max_model_len
    else:
        info = await asyncio.to_thread(describe_model, settings.model,
                                       random_weights=settings.random_weights)
        tok_dir = settings.tokenizer_dir or info.tokenizer_dir
        max_len = settings.max_model_len or info.max_model_len
    tokenizer = TextTokenizer.from_dir(tok_dir)
    ctx = make_context(settings.curve_keys_dir, "gateway")
    tracer = Tracer("gateway", enabled=settings.tracing, endpoint=settings.tracing_endpoint,
                    file=settings.tracing_file)
    backend = ClusterBackend(ctx, settings.conductor_addr, settings.stream_bind, name,
                             stream_advertise=settings.stream_advertise,
                             failover=settings.failover(), tracer=tracer)
    await backend.start()
    pipeline = RequestPipeline(tokenizer, max_len)
    frontend = ZmqFrontend(ctx, settings.zmq_addr, backend, pipeline, tokenizer, name,
                           request_timeout_s=settings.request_timeout_s,
                           api_keys=settings.api_keys)
    await frontend.start()
    app = create_app(backend, tokenizer, model_name=name, max_model_len=max_len,
                     api_keys=settings.api_keys, request_timeout_s=settings.request_timeout_s,
                     max_body_bytes=settings.max_body_bytes)
    control_metrics = ControlMetrics(ctx)  # in the process-wide registry: one per serve
    app.state.metrics_registry.register(control_metrics)
    server = uvicorn.Server(uvicorn.Config(
        app, host=settings.http_host, port=settings.http_port, log_level="warning",
        lifespan="off", timeout_graceful_shutdown=settings.shutdown_grace_s))
    http = asyncio.create_task(_run_http(server, http_sock, stop))
    log.info("gateway started", http=f"http://{settings.http_host}:{settings.http_port}",
             zmq=frontend.address, model=name, max_model_len=max_len)
    try:
        # The token and client receive loops: without them the gateway answers nothing.
        await until_stopped(stop, [http, *backend.loops, *frontend.loops])
    finally:
        server.should_exit = True
        await asyncio.gather(http, return_exceptions=True)
        await frontend.close()
        await backend.close()
        app.state.metrics_registry.unregister(control_metrics)
        tracer.close()
        ctx.term()


async def _run_http(server: uvicorn.Server, sock: socket.socket, stop: asyncio.Event) -> None:
    await server.serve(sockets=[sock])
    stop.set()  # uvicorn catches SIGINT/SIGTERM itself while it serves


def _bind_http(host: str, port: int) -> socket.socket:
    """The HTTP listening socket, bound here because uvicorn turns a failed bind into
    sys.exit (no message to the caller)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot bind http://{host}:{port}: {exc.strerror}") from exc
    return sock


def main(argv=None) -> int:
    return run_service(
        "gateway", lambda: load_settings(GatewaySettings, "gateway", argv), serve,
        prepare=lambda s: configure_logging(s.log_format, service="gateway"))
