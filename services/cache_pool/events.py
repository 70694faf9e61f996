"""KV events of one cache-pool instance, queued in store order and published in order.

The store reports net changes through ``on_stored`` / ``on_removed`` while a request
runs; ``flush`` (called after the request, with no await since the store call) turns
them into one ``KVEvent`` per kind. One task (``run``) publishes the queue, so
subscribers see events in the order the store made the changes, and ``announce`` (a
snapshot taken and queued at once) can never be overtaken by an older event.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import structlog
import zmq

from common.protocol import KVEvent
from common.zmq_io import Publisher

log = structlog.get_logger(__name__)

TOPIC = b"kv"
CHUNK = 65536  # hashes per published KVEvent, to keep envelopes small


class EventOutbox:
    def __init__(self, source: str) -> None:
        self.source = source
        self._stored: list[int] = []
        self._removed: list[int] = []
        self._queue: asyncio.Queue[KVEvent] = asyncio.Queue()

    def on_stored(self, keys: list[int]) -> None:
        self._stored.extend(keys)

    def on_removed(self, keys: list[int]) -> None:
        self._removed.extend(keys)

    @property
    def pending_stored(self) -> int:
        """Keys stored since the last ``flush``."""
        return len(self._stored)

    def flush(self) -> None:
        """Queue the changes since the last flush: new blocks enter DRAM (tier "dram");
        removed ones are gone from every tier (tier "")."""
        stored, self._stored = self._stored, []
        removed, self._removed = self._removed, []
        self.queue("stored", stored, "dram")
        self.queue("removed", removed, "")

    def queue(self, kind: str, hashes: Sequence[int], tier: str) -> None:
        for i in range(0, len(hashes), CHUNK):
            self._queue.put_nowait(KVEvent(source=self.source, kind=kind,
                                           hashes=list(hashes[i:i + CHUNK]), tier=tier))

    def announce(self, hashes: Sequence[int], tiers: Sequence[str]) -> None:
        """Queue "cleared", then "stored" of every held block, one event per tier."""
        self._queue.put_nowait(KVEvent(source=self.source, kind="cleared", hashes=[]))
        for tier in ("dram", "ssd"):
            self.queue("stored", [h for h, t in zip(hashes, tiers, strict=True) if t == tier],
                       tier)

    async def run(self, publisher: Publisher) -> None:
        """Publish queued events under ``TOPIC`` until cancelled."""
        while True:
            event = await self._queue.get()
            try:
                await publisher.publish(event, TOPIC)
            except zmq.ZMQError as exc:
                log.warning("kv_event_not_published", kind=event.kind, error=str(exc))
