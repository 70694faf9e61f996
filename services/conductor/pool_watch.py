"""The cache pool's part of the global prefix index: find the pool instances, follow their
KV events, resync, and forget an instance that stops answering.

One index location per instance, ``pool:<instance id>`` (the ``source`` of its events);
its DRAM and SSD tiers are one location, because moves between the tiers are not
published and the routing cost model has one pool bandwidth. Every
``check_interval_s`` the watcher asks each configured control address for its PoolStats
(``discover_pools``)::

    answers, instance unknown       attach: SUB to its events_addr (topic kv), let the
                                    subscription settle, then resync
    answers, new boot_id            it restarted (and may have lost its DRAM): resync
    answers, new events_addr        attach again (a new SUB), then resync
    answers, not yet synced         resync again (the last one failed)
    silent for dead_after_s         drop: its location leaves the index (its blocks are
                                    a miss, not a promise) and its SUB is closed; when it
                                    answers again it is attached afresh

A conductor that restarts starts with an empty index and attaches every instance, so
the pool's part is rebuilt within one check and one resync.

Order of events and resync (``PoolFeed``): from the moment a resync is asked until its
reply is applied, the instance's events are held back; the reply then *replaces* the
location's blocks, and the held events are replayed in order. The reply is the state at
some instant T inside that window. Events from before T that arrive late change nothing
once replayed over it (each block ends as the last event about it left it, which is what
T saw; a ``cleared`` is followed by the ``stored`` announce of all the instance held),
and events from after T apply on top, as they should. Without the hold, an event from
after T applied before the reply (a removal, or the ``cleared`` of a pool that just
started) would be undone by the older snapshot.

Events lost on the way (PUB drops what a not-yet-connected SUB would get) are the
remaining gap: the watcher waits ``SETTLE_S`` after connecting a SUB before asking for
the snapshot, ZeroMQ reconnects a SUB to a restarted instance within a tenth of a second
(before its announce), and a restart the events missed is still caught by the boot id.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence

import structlog
import zmq
import zmq.asyncio

from common.address import parse_address, with_host
from common.pool.discovery import discover_pools
from common.protocol import HeldBlocks, KVEvent, PoolInstanceStatus, Resync
from common.zmq_io import Subscriber
from common.zmq_rpc import RemoteError, RpcClient, RpcTimeout
from services.conductor.cache_policy import POOL_PREFIX
from services.conductor.prefix_index import PrefixIndex

log = structlog.get_logger(__name__)

TOPIC = b"kv"
SETTLE_S = 0.1  # after connecting a SUB: lets its subscription reach the pool's PUB
RESYNC_TIMEOUT_S = 10.0  # a big pool answers with every hash it holds


class PoolFeed:
    """One instance's KV events into the index, ordered against its resync snapshots.

    Contract: ``event`` applies an event for ``location`` at once, or holds it while a
    resync is open; ``finish_resync(hashes)`` makes the location hold exactly ``hashes``
    and then replays the held events in arrival order; ``abort_resync`` applies the held
    events and leaves the feed unsynced. Events of another source are ignored (False).
    """

    def __init__(self, location: str, index: PrefixIndex,
                 apply: Callable[[KVEvent], None]) -> None:
        self.location = location
        self.index = index
        self.apply = apply
        self.synced = False
        self._held: list[KVEvent] | None = None

    @property
    def resyncing(self) -> bool:
        return self._held is not None

    def event(self, event: KVEvent) -> bool:
        if event.source != self.location:
            return False
        if self._held is not None:
            self._held.append(event)
        else:
            self.apply(event)
        return True

    def begin_resync(self) -> None:
        if self._held is None:
            self._held = []

    def finish_resync(self, hashes: Sequence[int]) -> int:
        """Apply the snapshot and the events held since ``begin_resync``; returns how
        many events were replayed."""
        held, self._held = self._held or [], None
        self.index.drop_location(self.location)
        self.index.stored(self.location, hashes)
        for event in held:
            self.apply(event)
        self.synced = True
        return len(held)

    def abort_resync(self) -> None:
        held, self._held = self._held or [], None
        for event in held:
            self.apply(event)
        self.synced = False


class _Instance:
    """A known pool instance: where it is, which boot of it, its SUB and event task."""

    def __init__(self, instance_id: str, events_addr: str, feed: PoolFeed,
                 sub: Subscriber, task: asyncio.Task) -> None:
        self.instance_id = instance_id
        self.events_addr = events_addr
        self.feed = feed
        self.sub = sub
        self.task = task
        self.control_addr = ""
        self.boot_id: str | None = None
        self.last_ok = time.monotonic()

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.task
        await self.sub.close()


class PoolWatch:
    """Keeps the ``pool:*`` locations of ``index`` in step with the instances reached at
    ``control_addrs``; ``apply`` applies one KVEvent to the index (the conductor's)."""

    def __init__(self, ctx: zmq.asyncio.Context, control_addrs: Sequence[str],
                 index: PrefixIndex, apply: Callable[[KVEvent], None], *,
                 check_interval_s: float = 1.0, dead_after_s: float = 5.0) -> None:
        if not control_addrs:
            raise ValueError("no cache-pool control addresses given")
        if not (check_interval_s > 0 and dead_after_s > 0):
            raise ValueError("check_interval_s and dead_after_s must be > 0")
        self.ctx = ctx
        self.control_addrs = list(control_addrs)
        self.index = index
        self.apply = apply
        self.check_interval_s = check_interval_s
        self.dead_after_s = dead_after_s
        self.instances: dict[str, _Instance] = {}

    async def run(self) -> None:
        """Check every ``check_interval_s`` until cancelled."""
        while True:
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not stop the watching
                log.exception("cache_pool_check_failed")
            await asyncio.sleep(self.check_interval_s)

    async def check(self) -> None:
        """One round: discover, (re)attach and resync, drop the silent."""
        found = await discover_pools(self.ctx, self.control_addrs,
                                     timeout_s=min(self.check_interval_s, 2.0))
        now = time.monotonic()
        work = []
        for instance_id, values in found.items():
            inst = self.instances.get(instance_id)
            events_addr = reachable(values.events_addr, values.control_addr)
            if not events_addr:
                log.warning("cache_pool_without_events", instance=instance_id)
                continue
            if inst is None or inst.events_addr != events_addr:
                work.append(self._attach(instance_id, values.control_addr, events_addr,
                                         values.boot_id))
                continue
            inst.last_ok, inst.control_addr = now, values.control_addr
            if values.boot_id != inst.boot_id or not inst.feed.synced:
                if values.boot_id != inst.boot_id:
                    log.info("cache_pool_restarted", instance=instance_id)
                inst.boot_id = values.boot_id
                work.append(self._resync(inst))
        await asyncio.gather(*work)
        for instance_id, inst in list(self.instances.items()):
            if instance_id not in found and now - inst.last_ok > self.dead_after_s:
                await self.drop(instance_id)

    async def drop(self, instance_id: str) -> None:
        """Forget an instance: its blocks leave the index, its SUB closes."""
        inst = self.instances.pop(instance_id, None)
        if inst is None:
            return
        await inst.close()
        blocks = self.index.drop_location(inst.feed.location)
        log.warning("cache_pool_dropped", instance=instance_id, blocks=blocks,
                    silent_s=round(time.monotonic() - inst.last_ok, 1))

    async def close(self) -> None:
        """Close every SUB (the index keeps what it has). Idempotent."""
        for inst in self.instances.values():
            await inst.close()
        self.instances.clear()

    def stats(self) -> list[PoolInstanceStatus]:
        now = time.monotonic()
        return [PoolInstanceStatus(
                    instance_id=i, control_addr=inst.control_addr,
                    events_addr=inst.events_addr, synced=inst.feed.synced,
                    blocks=self.index.held(inst.feed.location),
                    silent_s=round(now - inst.last_ok, 3))
                for i, inst in sorted(self.instances.items())]

    # -- internals ----------------------------------------------------------------------

    async def _attach(self, instance_id: str, control_addr: str, events_addr: str,
                      boot_id: str | None) -> None:
        old = self.instances.pop(instance_id, None)
        if old is not None:
            await old.close()
        location = POOL_PREFIX + instance_id
        feed = PoolFeed(location, self.index, self.apply)
        feed.begin_resync()  # hold events from the first one on, until the snapshot
        try:
            sub = Subscriber(self.ctx, events_addr, bind=False, topics=(TOPIC,),
                             server="cache-pool")
        except zmq.ZMQError as exc:
            log.warning("cache_pool_events_unreachable", instance=instance_id,
                        events_addr=events_addr, error=str(exc))
            return
        inst = _Instance(instance_id, events_addr, feed, sub,
                         asyncio.create_task(self._follow(sub, feed, instance_id)))
        inst.control_addr, inst.boot_id = control_addr, boot_id
        self.instances[instance_id] = inst
        log.info("cache_pool_attached", instance=instance_id, control_addr=control_addr,
                 events_addr=events_addr)
        await asyncio.sleep(SETTLE_S)
        await self._resync(inst)

    async def _resync(self, inst: _Instance) -> None:
        feed = inst.feed
        feed.begin_resync()
        client = RpcClient(self.ctx, inst.control_addr, name="conductor->pool",
                           server="cache-pool")
        try:
            held = (await client.call(Resync(), timeout=RESYNC_TIMEOUT_S)).record
            if not isinstance(held, HeldBlocks):
                raise ValueError(f"answered with {type(held).__name__}")
            if held.source != feed.location:
                raise ValueError(f"answered for {held.source!r}")
            hashes = held.hashes  # a list of ints: the codec checked it
        except (RemoteError, RpcTimeout, ConnectionError, zmq.ZMQError,
                ValueError) as exc:
            feed.abort_resync()
            log.warning("cache_pool_resync_failed", instance=inst.instance_id,
                        error=str(exc) or type(exc).__name__)
            return
        finally:
            await client.close()
        replayed = feed.finish_resync(hashes)
        log.info("cache_pool_resynced", instance=inst.instance_id, blocks=len(hashes),
                 replayed_events=replayed)

    async def _follow(self, sub: Subscriber, feed: PoolFeed, instance_id: str) -> None:
        while True:
            msg = await sub.recv()
            if not (isinstance(msg.record, KVEvent) and feed.event(msg.record)):
                log.warning("cache_pool_event_ignored", instance=instance_id,
                            type=msg.envelope.type,
                            source=getattr(msg.record, "source", None))


def reachable(events_addr: str, control_addr: str) -> str:
    """``events_addr`` with a wildcard host (the pool bound every interface) replaced by
    the host of ``control_addr``, the address the instance was reached at."""
    if not events_addr.startswith("tcp://"):
        return events_addr
    try:
        return with_host(events_addr, parse_address(control_addr, "tcp").host)
    except ValueError:  # either one not tcp://host:port: nothing to replace it with
        return events_addr
