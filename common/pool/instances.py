"""The cache-pool instances a client talks to: one control connection each, and which of
them are down.

``call`` never raises for the pool's sake: a timeout or an unreachable instance marks it
down (logged once) and answers None; while down, it answers None at once, without the
network, for ``down_retry_s`` at a time, until the instance answers again (logged too).
An ``Error`` reply is logged and answers None without marking the instance down.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import structlog
import zmq
import zmq.asyncio

from common.pool.keys import Buffer
from common.protocol import Message
from common.zmq_rpc import RemoteError, RpcClient, RpcTimeout

log = structlog.get_logger(__name__)


class Instances:
    """``addrs``: instance id -> control address. ``ids`` are sorted, the order placement
    ranks them from."""

    def __init__(self, ctx: zmq.asyncio.Context, addrs: Mapping[str, str], *,
                 timeout_s: float, down_retry_s: float, name: str) -> None:
        self.ids = sorted(addrs)
        self.timeout_s = timeout_s
        self.down_retry_s = down_retry_s
        self._controls = dict(addrs)
        self._clients = {i: RpcClient(ctx, addr, name=f"{name}->{i}", server="cache-pool")
                         for i, addr in addrs.items()}
        self._down_until: dict[str, float] = {}  # present while the instance is down

    def control(self, inst: str) -> str:
        """The control address ``inst`` is reached by."""
        return self._controls[inst]

    async def call(self, inst: str, record, bulk: Sequence[Buffer] = ()) -> Message | None:
        """The reply, or None for any failure (logged; see the module doc)."""
        if self._down_until.get(inst, 0.0) > time.monotonic():
            return None
        try:
            reply = await self._clients[inst].call(record, timeout=self.timeout_s, bulk=bulk)
        except RemoteError as exc:
            log.warning("pool_request_refused", instance=inst, type=type(record).__name__,
                        code=exc.code, error=exc.message)
            return None
        except (RpcTimeout, ConnectionError, zmq.ZMQError) as exc:
            if inst not in self._down_until:
                log.warning("pool_instance_down", instance=inst, error=str(exc))
            self._down_until[inst] = time.monotonic() + self.down_retry_s
            return None
        if self._down_until.pop(inst, None) is not None:
            log.info("pool_instance_back", instance=inst)
        return reply

    async def send(self, inst: str, record) -> None:
        """Send ``record`` to ``inst`` expecting no reply; raises as the socket does."""
        await self._clients[inst].send(record)

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
