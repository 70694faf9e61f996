"""How a pool client's block bytes travel: one carrier, chosen when the client is made.

    FrameCarrier      transport "zmq": bulk frames of PoolPut / PoolBlocks on the
                      control connection (``common.pool.frames``)
    DataPlaneCarrier  transport "data_plane": control on ZeroMQ, the bytes one data-plane
                      transfer per call (``common.pool.data_plane``)

A carrier moves the blocks of one call to or from one instance. Which instances, in what
order, and what a miss means for the rest of a chain is the client's
(``common.pool.client``). A carrier never raises for the pool or the transport: a failed
put is False, a failed get is ``[]``, both logged and counted in the client's ``counts``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.pool.keys import Buffer
    from common.pool.transfer import BlockInbox
    from common.transfer import MultiReceiver


class Carrier(ABC):
    """The bytes of one call. ``receiver`` and ``inbox`` are the data plane's listener
    and its open transfers (None for a carrier that has none); they hold nothing while
    no call is in flight."""

    receiver: MultiReceiver | None = None
    inbox: BlockInbox | None = None

    @abstractmethod
    async def put(self, inst: str, keys: list[int], depths: list[int],
                  blocks: list[memoryview], size: int) -> bool:
        """Store one batch of ``size``-byte blocks on ``inst``; True once it is stored."""

    @abstractmethod
    async def get(self, inst: str, keys: list[int]) -> list[Buffer]:
        """The blocks of the longest prefix of ``keys`` that ``inst`` serves, in order."""

    @abstractmethod
    async def close(self) -> None:
        """Free what the carrier holds; calls in flight fail as misses. Idempotent."""
