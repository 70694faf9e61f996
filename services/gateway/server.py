"""The gateway process: OpenAI-compatible HTTP and the ZeroMQ client protocol, in front
of the cluster. Imports no torch: the model's tokenizer and context length come from a
child process (:mod:`services.gateway.model_info`) or from settings.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import structlog
import uvicorn
import zmq.asyncio

from common.logging import configure_logging
from common.tokenizer import TextTokenizer
from common.zmq_io import install_uvloop
from services.gateway.cluster_backend import ClusterBackend
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
    max_model_len: int = 0  # 0: the model's context length
    api_keys: tuple[str, ...] = ()
    request_timeout_s: float = 600.0
    log_format: str = "json"


async def serve(settings: GatewaySettings, *, ready: asyncio.Event | None = None) -> None:
    name = settings.served_model_name or settings.model
    if settings.tokenizer_dir and settings.max_model_len:
        tok_dir, max_len = settings.tokenizer_dir, settings.max_model_len
    else:
        info = await asyncio.to_thread(describe_model, settings.model)
        tok_dir = settings.tokenizer_dir or info.tokenizer_dir
        max_len = settings.max_model_len or info.max_model_len
    tokenizer = TextTokenizer.from_dir(tok_dir)
    ctx = zmq.asyncio.Context()
    backend = ClusterBackend(ctx, settings.conductor_addr, settings.stream_bind, name,
                             stream_advertise=settings.stream_advertise)
    await backend.start()
    pipeline = RequestPipeline(tokenizer, max_len)
    frontend = ZmqFrontend(ctx, settings.zmq_addr, backend, pipeline, tokenizer, name,
                           request_timeout_s=settings.request_timeout_s)
    await frontend.start()
    app = create_app(backend, tokenizer, model_name=name, max_model_len=max_len,
                     api_keys=settings.api_keys, request_timeout_s=settings.request_timeout_s)
    server = uvicorn.Server(uvicorn.Config(app, host=settings.http_host,
                                           port=settings.http_port, log_level="warning",
                                           lifespan="off"))
    log.info("gateway started", http=f"http://{settings.http_host}:{settings.http_port}",
             zmq=frontend.address, model=name, max_model_len=max_len)
    if ready is not None:
        ready.set()
    try:
        await server.serve()
    finally:
        await frontend.close()
        await backend.close()
        ctx.term()


def main(argv=None) -> int:
    from common.config import load_settings

    settings = load_settings(GatewaySettings, "gateway", argv)
    configure_logging(settings.log_format, service="gateway")
    install_uvloop()
    asyncio.run(serve(settings))
    return 0
