"""The cache-pool process: one ``BlockStore`` served over ZeroMQ, publishing KV events.

Lifecycle of an instance::

    start   open the SSD tier (index replay) -> block size: the setting, else the size of
            the blocks on SSD, else the first stored put's -> start the data-plane
            receiver (its advert in PoolStats and PoolReady) -> bind the control ROUTER
            (control_addr) and the events PUB (events_addr) -> after ANNOUNCE_DELAY_S,
            publish "cleared" then "stored" of everything held
    serve   PoolPut / PoolCommit / PoolGet / PoolExists / PoolRemove / Resync / GetStats.
            Store calls are synchronous, so requests never interleave inside the store.
            The store's stored/removed callbacks are collected per request (or stored
            transfer) and queued as one KVEvent per kind (topic b"kv"); one task
            publishes the queue in order.
    SIGTERM stop serving -> copy DRAM blocks to SSD (``flush_on_close``) -> sync the
            index -> exit. A restart on the same ``ssd_dir`` then serves them all.

Block bytes of a request with a ``transfer_id`` move on the data plane
(``services/cache_pool/data_plane.py``); without one, as bulk frames of the request and
its reply.

Bad input is answered with ``Error("bad_request")`` (contents) or the codec's error
(frames), and the process keeps serving. A frame over ``max(max_request_bytes, 64 MiB)``
makes ZeroMQ drop the sender's connection instead (its call times out). SSD reads and
writes run on the event loop: one request's disk I/O delays the others.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import uuid
from collections.abc import Sequence

import structlog
import zmq
import zmq.asyncio
from prometheus_client import start_http_server

from common.address import bind_host
from common.config import apply_ucx_settings, load_settings
from common.logging import configure_logging
from common.pool.keys import Buffer
from common.protocol import (
    MAX_FRAME_BYTES,
    Ack,
    Error,
    GetStats,
    HeldBlocks,
    Message,
    PoolBlocks,
    PoolCommit,
    PoolExists,
    PoolFound,
    PoolGet,
    PoolPut,
    PoolRemove,
    PoolStats,
    Resync,
)
from common.service_main import run_service, until_stopped
from common.transfer import TransferError
from common.zmq_auth import make_context
from common.zmq_io import Publisher
from common.zmq_metrics import ControlMetrics
from common.zmq_policy import CACHE_POOL_CONTROL
from common.zmq_rpc import RpcServer
from services.cache_pool import validate
from services.cache_pool.data_plane import PoolDataPlane
from services.cache_pool.events import EventOutbox
from services.cache_pool.metrics import PoolMetrics
from services.cache_pool.settings import PoolSettings
from services.cache_pool.store import BlockStore, StoreStats
from services.cache_pool.tiers import DramTier, SsdTier
from services.cache_pool.validate import BadRequest

log = structlog.get_logger(__name__)

ANNOUNCE_DELAY_S = 0.5  # lets subscribers that reconnect after a restart see the announce


class CachePool:
    """One cache-pool instance; ``start``, then serve until ``close``."""

    def __init__(self, settings: PoolSettings) -> None:
        self.settings = settings
        self.source = f"pool:{settings.instance_id}"
        self.boot_id = uuid.uuid4().hex  # in PoolStats: subscribers tell a restart by it
        self.ctx = make_context(settings.curve_keys_dir, "cache-pool")
        # Applies to sockets made after this: a peer sending a larger frame is dropped.
        self.ctx.setsockopt(zmq.MAXMSGSIZE, max(settings.max_request_bytes, MAX_FRAME_BYTES))
        self.ssd = (SsdTier(settings.ssd_dir, settings.ssd_bytes, settings.make_policy())
                    if settings.ssd_dir else None)
        self.store: BlockStore | None = None
        self.outbox = EventOutbox(self.source)
        self.block_bytes = settings.block_bytes or self._block_bytes_on_ssd()
        if self.block_bytes:
            self._open_store(self.block_bytes)
        self.metrics = PoolMetrics(self._read_stats)
        self.metrics.registry.register(ControlMetrics(self.ctx))
        self.rpc = RpcServer(self.ctx, settings.control_addr, self._handle, name=self.source,
                             allowed=CACHE_POOL_CONTROL)
        self.events: Publisher | None = None
        # in_/out_bytes, in_/out_ok, in_/out_failed, out_<backend>, frame_in/out_bytes
        self.transfers: collections.Counter[str] = collections.Counter()
        self.data_plane = PoolDataPlane(settings, store=self._store_put,
                                        count_bytes=self._count_bytes,
                                        transfers=self.transfers)
        self._tasks: list[asyncio.Task] = []
        self._handlers = {PoolPut: self._put, PoolCommit: self._commit, PoolGet: self._get,
                          PoolExists: self._exists, PoolRemove: self._remove,
                          Resync: self._resync, GetStats: self._stats}

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        await self.data_plane.start()
        self.events = Publisher(self.ctx, self.settings.events_addr, bind=True)
        await self.rpc.start()
        self._tasks += [asyncio.create_task(self.outbox.run(self.events)),
                        asyncio.create_task(self._announce())]
        if self.settings.metrics_port:
            start_http_server(self.settings.metrics_port, registry=self.metrics.registry,
                              addr=bind_host(self.settings.control_addr))
        advert = self.data_plane.advert()
        log.info("cache pool started", instance=self.settings.instance_id,
                 control=self.rpc.address, events=self.events.address,
                 kv_host_id=advert.host_id, kv_endpoints=advert.endpoints,
                 block_bytes=self.block_bytes, dram_bytes=self.settings.dram_bytes,
                 ssd_bytes=self.settings.ssd_bytes,
                 ssd_recovery=self.ssd.recovery._asdict() if self.ssd is not None else None)

    @property
    def loops(self) -> list[asyncio.Task]:
        """The tasks that must run as long as the process serves (see ``until_stopped``)."""
        return list(self._tasks)

    async def close(self) -> None:
        """Stop serving; flush DRAM to SSD if configured; sync and close the SSD tier."""
        await self.rpc.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.data_plane.close()
        if self.events is not None:
            await self.events.close()
        if self.ssd is not None:
            if self.settings.flush_on_close and self.store is not None:
                self._flush_dram()
            self.ssd.close()
        self.ctx.term()

    def _block_bytes_on_ssd(self) -> int:
        keys = self.ssd.keys() if self.ssd is not None else []
        sizes = {self.ssd.length(k) for k in keys}
        if len(sizes) > 1:
            log.warning("ssd_block_sizes_differ", sizes=sorted(sizes)[:8])
        return max(sizes, default=0)

    def _open_store(self, block_bytes: int) -> None:
        dram = DramTier(self.settings.dram_bytes, self.settings.make_policy(), block_bytes)
        self.store = BlockStore(dram, self.ssd, on_stored=self.outbox.on_stored,
                                on_removed=self.outbox.on_removed)

    def _flush_dram(self) -> None:
        """Copy DRAM blocks to SSD, oldest insert first, so the restart keeps them."""
        dram, written = self.store.dram, 0
        keys = dram.keys()  # a copy: the loop reads the tier
        for key in keys:
            try:
                self.ssd.put(key, dram.get(key), dram.depth(key))
                written += 1
            except (OSError, ValueError) as exc:
                log.warning("flush_failed", key=f"{key:016x}", error=str(exc))
                break
        log.info("dram flushed to ssd", blocks=written)

    # -- requests -----------------------------------------------------------------------

    async def _handle(self, msg: Message):
        kind = msg.envelope.type
        handler = self._handlers.get(type(msg.record))
        if handler is None:
            return Error("unsupported", f"{kind} is not handled by the cache pool")
        try:
            reply = handler(msg.record, msg.bulk)
            if inspect.isawaitable(reply):
                reply = await reply
        except BadRequest as exc:
            log.warning("pool_bad_request", type=kind, error=str(exc),
                        request_id=msg.envelope.request_id)
            self.metrics.requests.labels(type=kind, outcome="bad_request").inc()
            return Error("bad_request", str(exc))
        finally:
            self.outbox.flush()
        outcome = reply.code if isinstance(reply, Error) else "ok"
        self.metrics.requests.labels(type=kind, outcome=outcome).inc()
        return reply

    def _put(self, rec: PoolPut, bulk):
        if rec.transfer_id:
            return self._expect_put(rec, bulk)
        items = validate.put_items(rec.keys, rec.depths, rec.block_bytes, bulk,
                                   pool_block_bytes=self.block_bytes,
                                   max_request_bytes=self.settings.max_request_bytes)
        new = self._store_items(rec.block_bytes, items)
        self._count_bytes("frame_in", rec.block_bytes * len(items))
        return Ack(detail=str(new))

    def _store_items(self, block_bytes: int, items: list) -> int:
        """Store validated ``(key, data, depth)`` items; how many were new. Learns the
        block size from the first items stored."""
        if self.store is None and items:
            if block_bytes > self.settings.dram_bytes:
                raise BadRequest(f"block_bytes {block_bytes} exceeds the DRAM tier's "
                                 f"{self.settings.dram_bytes} bytes")
            self.block_bytes = block_bytes
            self._open_store(block_bytes)
            log.info("block size learned", block_bytes=block_bytes)
        if items and block_bytes != self.block_bytes:  # learned meanwhile from another put
            raise BadRequest(f"block_bytes {block_bytes} differs from the pool's "
                             f"{self.block_bytes}")
        before = self.outbox.pending_stored
        if items:
            self.store.put_many(items)
        return self.outbox.pending_stored - before

    def _expect_put(self, rec: PoolPut, bulk):
        validate.check_no_bulk("pool_put with a transfer_id", bulk)
        validate.check_put(rec.keys, rec.depths, rec.block_bytes,
                           pool_block_bytes=self.block_bytes,
                           max_request_bytes=self.settings.max_request_bytes)
        validate.check_transfer(rec.transfer_id, rec.lease_s)
        if self.store is None and rec.block_bytes > self.settings.dram_bytes:
            raise BadRequest(f"block_bytes {rec.block_bytes} exceeds the DRAM tier's "
                             f"{self.settings.dram_bytes} bytes")
        return self.data_plane.expect_put(rec)

    def _store_put(self, rec: PoolPut, blocks: Sequence[bytes]) -> Ack | Error:
        """Store the blocks a put's transfer delivered; the reply its PoolCommit gets."""
        try:
            new = self._store_items(rec.block_bytes,
                                    list(zip(rec.keys, blocks, rec.depths, strict=True)))
        except BadRequest as exc:
            return Error("bad_request", str(exc))
        except Exception as exc:  # as the RpcServer answers a handler that raised
            log.exception("pool_put_store_failed", transfer_id=rec.transfer_id)
            return Error("internal", str(exc) or type(exc).__name__)
        finally:
            self.outbox.flush()
        self._count_bytes("in", rec.block_bytes * len(blocks))
        return Ack(detail=str(new))

    async def _commit(self, rec: PoolCommit, bulk):
        validate.check_no_bulk("pool_commit", bulk)
        return await self.data_plane.commit(rec)

    def _get(self, rec: PoolGet, bulk):
        validate.check_get(rec.keys, bulk, pool_block_bytes=self.block_bytes,
                           max_request_bytes=self.settings.max_request_bytes)
        address = None
        if rec.transfer_id:
            validate.check_transfer(rec.transfer_id, rec.lease_s)
            address = self.data_plane.address_for(rec.kv_advert)
        if self.store is None:
            return PoolBlocks(found=0)
        blocks: list[Buffer] = []
        held = self.store.exists_prefix(rec.keys)
        # Copies for the data plane go to reused memory (they are dropped once sent).
        copy = bytes if address is None else self.data_plane.packer(held * self.block_bytes)
        # One key at a time, up to and including the first absent one (counted as the
        # miss): a corrupt block ends the prefix before later blocks are read.
        for key in rec.keys[:held + 1]:
            data = self.store.get_many([key], copy)[0]
            if data is None:
                break
            blocks.append(data)
        if address is None:
            self._count_bytes("frame_out", sum(map(len, blocks)))
            return PoolBlocks(found=len(blocks)), blocks
        if blocks:
            self.data_plane.send_get(address, rec.transfer_id, blocks, rec.lease_s,
                                     token=rec.kv_token)
        return PoolBlocks(found=len(blocks))

    def _count_bytes(self, direction: str, nbytes: int) -> None:
        self.transfers[f"{direction}_bytes"] += nbytes
        self.metrics.block_bytes.labels(
            direction=direction.removeprefix("frame_"),
            carrier="zmq" if direction.startswith("frame_") else "data_plane").inc(nbytes)

    def _exists(self, rec: PoolExists, bulk):
        validate.check_no_bulk("pool_exists", bulk)
        validate.check_keys(rec.keys)
        if self.store is None:
            return PoolFound(found=0, tiers=[])
        found = self.store.exists_prefix(rec.keys)
        return PoolFound(found=found, tiers=[self.store.where(k)[0] for k in rec.keys[:found]])

    def _remove(self, rec: PoolRemove, bulk):
        validate.check_no_bulk("pool_remove", bulk)
        validate.check_keys(rec.keys)
        removed = self.store.remove_many(rec.keys) if self.store is not None else 0
        return Ack(detail=str(removed))

    def _resync(self, rec: Resync, bulk):
        validate.check_no_bulk("resync", bulk)
        hashes, tiers = self._held()
        return HeldBlocks(source=self.source, hashes=hashes, tiers=tiers)

    def _stats(self, rec: GetStats, bulk):
        stats, capacity = self._read_stats()
        values = stats._asdict() if stats is not None else dict.fromkeys(StoreStats._fields, 0)
        return PoolStats(**values, instance_id=self.settings.instance_id,
                         boot_id=self.boot_id, control_addr=self.rpc.address,
                         events_addr=self.events.address if self.events else "",
                         block_bytes=self.block_bytes, policy=self.settings.policy,
                         dram_capacity_bytes=capacity["dram"],
                         ssd_capacity_bytes=capacity["ssd"],
                         kv_advert=self.data_plane.advert(),
                         live_transfers=self.data_plane.receiver.live(),
                         pending_puts=len(self.data_plane.puts),
                         sending_gets=len(self.data_plane.sends),
                         transfers=dict(self.transfers))

    def _read_stats(self) -> tuple[StoreStats | None, dict[str, int]]:
        return (self.store.stats() if self.store is not None else None,
                {"dram": self.settings.dram_bytes, "ssd": self.settings.ssd_bytes})

    def _held(self) -> tuple[list[int], list[str]]:
        """Every held key (DRAM first, then SSD-only) and its tier."""
        dram = self.store.dram.keys() if self.store is not None else []
        in_dram = set(dram)
        ssd_keys = self.ssd.keys() if self.ssd is not None else []
        ssd = [k for k in ssd_keys if k not in in_dram]
        return dram + ssd, ["dram"] * len(dram) + ["ssd"] * len(ssd)

    async def _announce(self) -> None:
        await asyncio.sleep(ANNOUNCE_DELAY_S)
        self.outbox.announce(*self._held())


async def serve(settings: PoolSettings, stop: asyncio.Event) -> None:
    pool = CachePool(settings)
    await pool.start()
    try:
        await until_stopped(stop, pool.loops)
    finally:
        await pool.close()


def _prepare(settings: PoolSettings) -> None:
    configure_logging(settings.log_format, service=f"cache-pool:{settings.instance_id}")
    apply_ucx_settings(settings.ucx_tls, settings.ucx_net_devices)


def main(argv=None) -> int:
    return run_service(
        "cache-pool",
        lambda: load_settings(PoolSettings, "cache_pool", argv, prog="pdserve cache-pool"),
        serve, prepare=_prepare, startup_errors=(TransferError,))
