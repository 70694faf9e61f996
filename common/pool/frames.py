"""Block bytes as bulk ZeroMQ frames of PoolPut / PoolBlocks: no listener, one socket per
instance, for a client the pool cannot connect to; also the baseline
``bench/pool_transfer.py`` compares the data plane against."""

from __future__ import annotations

import collections

import structlog

from common.pool.carrier import Carrier
from common.pool.instances import Instances
from common.pool.keys import Buffer
from common.protocol import PoolGet, PoolPut

log = structlog.get_logger(__name__)


class FrameCarrier(Carrier):
    """Counts ``frame_out_bytes`` / ``frame_in_bytes`` in ``counts``."""

    def __init__(self, instances: Instances, counts: collections.Counter[str]) -> None:
        self._instances = instances
        self._counts = counts

    async def put(self, inst: str, keys: list[int], depths: list[int],
                  blocks: list[memoryview], size: int) -> bool:
        reply = await self._instances.call(
            inst, PoolPut(keys=keys, depths=depths, block_bytes=size), bulk=blocks)
        if reply is not None:
            self._counts["frame_out_bytes"] += size * len(blocks)
        return reply is not None

    async def get(self, inst: str, keys: list[int]) -> list[Buffer]:
        reply = await self._instances.call(inst, PoolGet(keys=keys))
        if reply is None:
            return []
        found = reply.record.found
        if not 0 <= found <= len(keys) or len(reply.bulk) != found:
            log.warning("pool_bad_reply", instance=inst, found=found, asked=len(keys),
                        frames=len(reply.bulk))
            return []
        blocks = [bytes(b) for b in reply.bulk]
        self._counts["frame_in_bytes"] += sum(map(len, blocks))
        return blocks

    async def close(self) -> None:
        pass  # the frames ride the client's control connections, closed by the client
