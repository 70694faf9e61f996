"""Block bytes on the KV data plane (``common/transfer``, ``common.pool.transfer``), only
control on ZeroMQ::

    put   PoolPut(keys, transfer_id)  ->  PoolReady(the pool's kv_advert)
          blocks as chunks to the pool's receiver (the best backend the two share)
          PoolCommit(transfer_id)      ->  Ack(blocks new to the pool), once stored
    get   expect transfer_id on this client's own receiver (a ``MultiReceiver``, started
          with the carrier)
          PoolGet(keys, transfer_id, this client's kv_advert)  ->  PoolBlocks(found)
          the pool sends the ``found`` blocks there

A transfer that fails (checksum, abort, a dead peer, its lease of ``timeout_s`` running
out) makes that get a miss and that put batch a failed write, and both ends free it: the
client cancels the transfer it expected, and tells the pool of a put it could not send
with ``PoolCommit(abort=...)``; the pool's own lease covers a client that vanished.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import uuid

import structlog

from common.address import parse_address, with_host
from common.pool.carrier import Carrier
from common.pool.instances import Instances
from common.pool.keys import Buffer
from common.pool.landing import LandingArenas
from common.pool.transfer import BlockInbox, send_blocks
from common.protocol import KVAdvert, PoolBlocks, PoolCommit, PoolGet, PoolPut, PoolReady
from common.transfer import MultiReceiver, MultiSender, TransferError
from common.transfer.negotiate import check_advert, default_host_id

log = structlog.get_logger(__name__)


class DataPlaneCarrier(Carrier):
    """``forced``: the one backend used both ways (None: negotiated per instance, shm on
    one host, else ucx, else tcp); ``kv_host``: the interface the receiver listens on
    (default: the local address that routes to the first instance); ``host_id``: this
    host in adverts (default: the host name; shm needs the pool to report the same). The
    receiver starts at once when made inside an event loop, else at the first get.

    Counts in ``counts``: ``transfer_out_bytes`` / ``transfer_in_bytes``, ``transfers``
    and ``transfers_failed``, ``backend_<kind>`` per put transfer.
    """

    def __init__(self, instances: Instances, counts: collections.Counter[str], *,
                 timeout_s: float, forced: str | None = None, kv_host: str | None = None,
                 host_id: str | None = None) -> None:
        self._instances = instances
        self._counts = counts
        self.timeout_s = timeout_s
        self._kinds = None if forced is None else (forced,)
        self._host_id = host_id or default_host_id()
        self._kv_host = kv_host
        self.sender = MultiSender(host_id=self._host_id, forced=forced)
        self._put_addrs: dict[str, tuple[KVAdvert, str]] = {}  # instance -> (advert, address)
        self.inbox = BlockInbox(LandingArenas())  # gets land in touched memory
        self.receiver: MultiReceiver | None = None
        self._starting: asyncio.Task | None = None
        self._closed = False
        with contextlib.suppress(RuntimeError):  # no running loop: start at first get
            asyncio.get_running_loop()
            self._starting = _quiet_task(self._start_receiver())

    async def put(self, inst: str, keys: list[int], depths: list[int],
                  blocks: list[memoryview], size: int) -> bool:
        tid = uuid.uuid4().hex
        deadline = asyncio.get_running_loop().time() + self.timeout_s  # the pool's lease
        reply = await self._instances.call(inst, PoolPut(
            keys=keys, depths=depths, block_bytes=size, transfer_id=tid, lease_s=self.timeout_s))
        if reply is None:
            return False
        if not isinstance(reply.record, PoolReady):
            log.warning("pool_bad_reply", instance=inst, type=reply.envelope.type)
            return False  # the pool's lease ends whatever it expected
        try:
            address = self._address_for(inst, reply.record.kv_advert)
            async with asyncio.timeout_at(deadline):
                await send_blocks(self.sender, address, tid, blocks,
                                  token=reply.record.kv_token)
        except Exception as exc:  # unexpected ones too: a failed write, not the caller's
            reason = self._transfer_failed(inst, "put", exc)
            with contextlib.suppress(Exception):  # else the pool's lease frees it
                await self._instances.send(inst, PoolCommit(transfer_id=tid, abort=reason))
            return False
        if await self._instances.call(inst, PoolCommit(transfer_id=tid)) is None:
            self._counts["transfers_failed"] += 1
            return False
        self._counts["transfers"] += 1
        self._counts["transfer_out_bytes"] += size * len(blocks)
        self._counts[f"backend_{address.partition('://')[0]}"] += 1
        return True

    async def get(self, inst: str, keys: list[int]) -> list[Buffer]:
        receiver = await self._data_receiver()
        if receiver is None:
            return []
        tid = uuid.uuid4().hex
        try:
            transfer = self.inbox.open(receiver, tid, len(keys), 0, self.timeout_s)
        except RuntimeError:  # closed meanwhile
            return []
        try:
            reply = await self._instances.call(inst, PoolGet(
                keys=keys, transfer_id=tid, kv_advert=receiver.advert(), lease_s=self.timeout_s,
                kv_token=transfer.token or b""))
            if reply is None:
                return []
            found = reply.record.found if isinstance(reply.record, PoolBlocks) else -1
            if not 0 <= found <= len(keys) or reply.bulk:
                log.warning("pool_bad_reply", instance=inst, found=found, asked=len(keys),
                            frames=len(reply.bulk))
                return []
            if found == 0:
                return []
            try:
                await transfer.wait()
            except TransferError as exc:
                self._transfer_failed(inst, "get", exc)
                return []
            blocks = self.inbox.take(tid, found)
            if blocks is None:
                self._transfer_failed(inst, "get", f"the blocks sent are not the {found} "
                                                   "blocks announced")
                return []
            self._counts["transfers"] += 1
            self._counts["transfer_in_bytes"] += sum(map(len, blocks))
            return blocks
        finally:
            receiver.cancel(tid)
            self.inbox.discard(tid)

    async def close(self) -> None:
        self._closed = True
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
            await asyncio.gather(self._starting, return_exceptions=True)
        if self.receiver is not None:
            await self.receiver.close()
        await self.sender.close()
        self.inbox.arenas.close()

    async def _data_receiver(self) -> MultiReceiver | None:
        """The started receiver; None (logged) if it cannot start, retried at the next
        call."""
        if self.receiver is not None:
            return self.receiver
        if self._closed:
            return None
        if self._starting is None or self._starting.done():
            self._starting = _quiet_task(self._start_receiver())
        starting = self._starting
        try:
            return await asyncio.shield(starting)
        except asyncio.CancelledError:
            if starting.cancelled() and not asyncio.current_task().cancelling():
                return None  # close() stopped the start, not our caller
            raise
        except Exception as exc:  # a bind, a backend that does not load: a miss
            log.warning("pool_data_plane_unavailable", error=str(exc) or type(exc).__name__)
            return None

    async def _start_receiver(self) -> MultiReceiver:
        host = self._kv_host or await asyncio.to_thread(  # may resolve a name
            _route_host, self._instances.control(self._instances.ids[0]))
        receiver = MultiReceiver(self._kinds, host=host, sink=self.inbox.sink,
                                 host_id=self._host_id)
        await receiver.start()
        if self._closed:
            await receiver.close()
            raise RuntimeError("pool client closed")
        self.receiver = receiver
        return receiver

    def _address_for(self, inst: str, advert: KVAdvert) -> str:
        """Where to send ``inst`` its put blocks: negotiated against its advert (with a
        wildcard host replaced by the host its control address names), once per advert."""
        known = self._put_addrs.get(inst)
        if known is not None and known[0] == advert:
            return known[1]
        check_advert(advert)
        address = self.sender.address_for(_reachable(advert, self._instances.control(inst)))
        self._put_addrs[inst] = (advert, address)
        return address

    def _transfer_failed(self, inst: str, what: str, exc: BaseException | str) -> str:
        """Count and log a failed transfer; its reason. An exception other than the data
        plane's own (TransferError, a bad address, the deadline) is logged as a bug."""
        expected = isinstance(exc, str | TransferError | ValueError | TimeoutError)
        reason = (exc.reason if isinstance(exc, TransferError) else
                  "timed out" if isinstance(exc, TimeoutError) else
                  str(exc) or type(exc).__name__)
        self._counts["transfers_failed"] += 1
        (log.warning if expected else log.exception)(
            "pool_transfer_failed", instance=inst, op=what, error=reason)
        return reason


def _quiet_task(coro) -> asyncio.Task:
    """A task whose failure is read by whoever awaits it, or by no one without a warning."""
    task = asyncio.ensure_future(coro)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task


def _route_host(control_addr: str) -> str:
    """The local address this host reaches ``control_addr``'s host from: where a pool
    there can send to. 127.0.0.1 for loopback, ipc, or a host that does not resolve."""
    try:
        control = parse_address(control_addr, "tcp")
    except ValueError:
        return "127.0.0.1"
    host = control.host
    if host in ("127.0.0.1", "localhost", "::1") or control.is_wildcard:
        return "127.0.0.1"
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, control.port))  # UDP: picks a route, sends nothing
            return s.getsockname()[0]
    except (OSError, ValueError):
        return "127.0.0.1"


def _reachable(advert: KVAdvert, control_addr: str) -> KVAdvert:
    """``advert`` with each wildcard endpoint host (the pool listens on every interface)
    replaced by the host of the control address we reach the pool by."""
    try:
        control_host = parse_address(control_addr).host
    except ValueError:  # ipc: no host to put in their place
        control_host = ""
    endpoints = {}
    for kind, address in advert.endpoints.items():
        with contextlib.suppress(ValueError):  # not host:port: left as it is
            address = with_host(address, control_host)
        endpoints[kind] = address
    return KVAdvert(host_id=advert.host_id, endpoints=endpoints)
