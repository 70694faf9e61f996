"""What a worker's parts (its role, its pool link) may use of the worker.

The worker builds one ``RoleContext`` and hands it to each part, instead of itself:
a part sees the engine only through the engine loop, sends tokens through the token
streams, reaches peers through the shared client factory, and can reach nothing else of
the worker. Parts import this module; none imports the worker (services.worker.server),
which imports them.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass

import zmq.asyncio

from common.address import format_address, parse_address
from common.tracing import NO_TRACER, Tracer
from common.zmq_rpc import RpcClient
from services.worker.engine_loop import EngineLoop
from services.worker.metrics import WorkerMetrics
from services.worker.settings import WorkerSettings
from services.worker.token_streams import TokenStreams


@dataclass(frozen=True, slots=True)
class RoleContext:
    worker_id: str
    settings: WorkerSettings
    loop: EngineLoop  # the only way to the engine
    streams: TokenStreams  # tokens out to the gateways
    metrics: WorkerMetrics
    zmq: zmq.asyncio.Context  # for the sockets a part opens itself (cache pool)
    peer: Callable[..., RpcClient]  # (addr, server="worker"): one client per address
    tracer: Tracer = NO_TRACER  # the worker's spans

    def advertised(self, addr: str) -> str:
        """``addr`` of a socket bound here, as peers should dial it (see ``advertise``)."""
        return advertise(addr, self.settings.advertise_host)


def advertise(addr: str, host: str = "") -> str:
    """``addr`` (``scheme://host:port``) as peers should dial it: with ``host`` when
    given, else with this machine's address in place of a wildcard bind. Addresses
    without a network host (shm, ipc) are returned as they are."""
    try:
        parsed = parse_address(addr)
    except ValueError:
        return addr
    if parsed.scheme not in ("tcp", "ucx"):
        return addr
    if not host and parsed.is_wildcard:
        host = socket.gethostbyname(socket.gethostname())
    return format_address(parsed.scheme, host, parsed.port) if host else addr
