"""Finding the cache-pool instances: the addresses a setting names, and what each says
it is (its ``PoolStats``)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

import structlog
import zmq
import zmq.asyncio

from common.protocol import GetStats, PoolStats
from common.zmq_rpc import RemoteError, RpcClient, RpcTimeout

log = structlog.get_logger(__name__)


def parse_pool_addrs(spec: str) -> list[str]:
    """Control addresses from a comma-separated setting; "" means no pool."""
    return [a.strip() for a in spec.split(",") if a.strip()]


async def discover_pools(ctx: zmq.asyncio.Context, control_addrs: Sequence[str], *,
                         timeout_s: float = 2.0) -> dict[str, PoolStats]:
    """Ask each pool instance for its PoolStats: instance id -> those (which name its
    ``control_addr`` and ``events_addr``). Instances that do not answer, or answer with
    something else, are left out; a caller that needs them all retries."""

    async def ask(addr: str) -> PoolStats | None:
        client = RpcClient(ctx, addr, name="pool-discovery", server="cache-pool")
        try:
            reply = await client.call(GetStats(), timeout=timeout_s)
            if not isinstance(reply.record, PoolStats):
                log.debug("pool_not_a_pool", addr=addr, type=reply.envelope.type)
                return None
            # The address we reach it by, not its bind.
            return dataclasses.replace(reply.record, control_addr=addr)
        except (RemoteError, RpcTimeout, ConnectionError, zmq.ZMQError) as exc:
            log.debug("pool_not_answering", addr=addr, error=str(exc) or type(exc).__name__)
            return None
        finally:
            await client.close()

    found = await asyncio.gather(*(ask(a) for a in control_addrs))
    return {v.instance_id: v for v in found if v is not None}
