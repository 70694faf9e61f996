"""The cache pool's side of the data plane: the block bytes of puts in, of gets out
(a request with a ``transfer_id``; docs/cache_pool.md)::

    put   PoolPut    (validated by the server) expect the transfer on the receiver for
                     lease_s (its blocks collect in ``inbox``), reply PoolReady(advert)
          (chunks)   a task waits for the transfer: DONE -> store all its blocks at once;
                     anything else -> store nothing
          PoolCommit that task's outcome: Ack(new blocks) or Error("transfer_failed");
                     with ``abort`` the transfer is cancelled first
    get   PoolGet    the server reads the blocks as for frames and replies
                     PoolBlocks(found); a task sends them to the client's advert
                     (negotiated backend) within lease_s

Every transfer ends by its lease at the latest, and each end frees what it held then:
a vanished client costs the pool one lease of memory, never more.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

import structlog

from common.pool.keys import Buffer
from common.pool.landing import LandingArenas, Packer
from common.pool.transfer import BlockInbox, send_blocks
from common.protocol import Ack, Error, KVAdvert, PoolCommit, PoolPut, PoolReady
from common.transfer import MultiReceiver, MultiSender, Transfer, TransferError
from common.transfer.negotiate import check_advert
from services.cache_pool.settings import PoolSettings
from services.cache_pool.validate import BadRequest

log = structlog.get_logger(__name__)

_ADDRESSES_KEPT = 1024  # negotiated client addresses remembered

StorePut = Callable[[PoolPut, list[bytes]], Ack | Error]
"""Stores the blocks a put's transfer delivered; the reply its PoolCommit gets."""


class PoolDataPlane:
    """One receiver for puts and one sender for gets, per ``settings`` (``kv_host``,
    ``kv_port``, ``transfer_backend``, ``host_id``).

    ``store`` stores a delivered put, ``count_bytes(direction, n)`` counts bytes moved;
    ``transfers`` counts ``in_ok``, ``in_failed``, ``out_ok``, ``out_failed`` and
    ``out_<backend>``. ``puts`` (transfer id -> its receive-and-store task, kept one
    lease after it ended) and ``sends`` are empty while no transfer is in flight.
    """

    def __init__(self, settings: PoolSettings, *, store: StorePut,
                 count_bytes: Callable[[str, int], None],
                 transfers: collections.Counter[str]) -> None:
        forced = None if settings.transfer_backend == "auto" else settings.transfer_backend
        self.inbox = BlockInbox(LandingArenas())  # a put's blocks are copied into the store
        self.receiver = MultiReceiver(None if forced is None else (forced,),
                                      host=settings.resolved_kv_host, port=settings.kv_port,
                                      sink=self.inbox.sink,
                                      host_id=settings.resolved_host_id)
        self.sender = MultiSender(host_id=settings.resolved_host_id, forced=forced)
        self.puts: dict[str, asyncio.Task] = {}
        self.sends: set[asyncio.Task] = set()
        self._addresses: dict[tuple, str] = {}  # client advert -> where its gets go
        self._store = store
        self._count_bytes = count_bytes
        self.transfers = transfers

    def advert(self) -> KVAdvert:
        return self.receiver.advert()

    async def start(self) -> None:
        await self.receiver.start()

    async def close(self) -> None:
        tasks = [*self.sends, *self.puts.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.receiver.close()
        await self.sender.close()
        self.inbox.arenas.close()

    # -- puts ---------------------------------------------------------------------------

    def expect_put(self, rec: PoolPut) -> PoolReady:
        """Expect a validated put's transfer; BadRequest for a transfer id in use."""
        if rec.transfer_id in self.puts:
            raise BadRequest(f"transfer_id {rec.transfer_id!r} is in use")
        try:
            transfer = self.inbox.open(self.receiver, rec.transfer_id, len(rec.keys),
                                       rec.block_bytes, rec.lease_s)
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        self.puts[rec.transfer_id] = asyncio.create_task(self._receive_put(rec, transfer))
        return PoolReady(kv_advert=self.advert(), kv_token=transfer.token or b"")

    async def _receive_put(self, rec: PoolPut, transfer: Transfer) -> Ack | Error:
        """Wait for the put's transfer; store its blocks if it ended DONE. The outcome
        waits in ``puts`` for the client's PoolCommit, one lease at most."""
        tid = rec.transfer_id
        try:
            try:
                await transfer.wait()
                blocks = self.inbox.take(tid, len(rec.keys))
                if blocks is None:
                    raise TransferError("the blocks sent are not the blocks announced", tid)
            except TransferError as exc:
                self.transfers["in_failed"] += 1
                log.warning("pool_put_transfer_failed", transfer_id=tid, error=exc.reason)
                return Error("transfer_failed", exc.reason)
            outcome = self._store(rec, blocks)
            self.transfers["in_failed" if isinstance(outcome, Error) else "in_ok"] += 1
            return outcome
        finally:
            self.receiver.cancel(tid)
            self.inbox.discard(tid)
            asyncio.get_running_loop().call_later(rec.lease_s, self._forget_put, tid)

    def _forget_put(self, tid: str) -> None:
        task = self.puts.get(tid)
        if task is not None and task.done():
            del self.puts[tid]

    async def commit(self, rec: PoolCommit) -> Ack | Error:
        task = self.puts.pop(rec.transfer_id, None)
        if task is None:
            return Error("not_found", f"no put transfer {rec.transfer_id!r} (unknown, "
                                      "committed, or forgotten one lease after it ended)")
        if rec.abort and not task.done():
            log.info("pool_put_aborted", transfer_id=rec.transfer_id, reason=rec.abort)
            self.receiver.cancel(rec.transfer_id)
        return await asyncio.shield(task)

    # -- gets ---------------------------------------------------------------------------

    def address_for(self, advert: KVAdvert | None) -> str:
        """Where a client's gets go, negotiated once per advert; BadRequest if none is
        usable."""
        try:
            host_id, endpoints = check_advert(advert)
            key = (host_id, tuple(sorted(endpoints.items())))
            address = self._addresses.get(key)
            if address is None:
                if len(self._addresses) >= _ADDRESSES_KEPT:
                    self._addresses.clear()
                address = self._addresses[key] = self.sender.address_for(advert)
        except (TransferError, ValueError) as exc:
            raise BadRequest(f"no usable data plane to the client: {exc}") from exc
        return address

    def packer(self, nbytes: int) -> Packer:
        """A ``copy`` for one get's blocks into up to ``nbytes`` of reused memory."""
        return Packer(self.inbox.arenas, nbytes)

    def send_get(self, address: str, tid: str, blocks: list[Buffer], lease_s: float, *,
                 token: bytes = b"") -> None:
        """Send ``blocks`` as transfer ``tid`` in the background, within ``lease_s``,
        presenting the client's ``token``."""
        task = asyncio.create_task(self._send_get(address, tid, blocks, lease_s, token))
        self.sends.add(task)
        task.add_done_callback(self.sends.discard)

    async def _send_get(self, address: str, tid: str, blocks: list[Buffer],
                        lease_s: float, token: bytes) -> None:
        try:
            async with asyncio.timeout(lease_s):
                await send_blocks(self.sender, address, tid, blocks, token=token)
        except Exception as exc:  # the client's lease ends its side in any case
            self.transfers["out_failed"] += 1
            expected = isinstance(exc, TransferError | ValueError | TimeoutError)
            (log.warning if expected else log.exception)(
                "pool_get_transfer_failed", transfer_id=tid, address=address,
                error=exc.reason if isinstance(exc, TransferError) else
                str(exc) or type(exc).__name__)
            return
        self.transfers["out_ok"] += 1
        self.transfers[f"out_{address.partition('://')[0]}"] += 1
        self._count_bytes("out", sum(map(len, blocks)))
