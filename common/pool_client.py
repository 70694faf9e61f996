"""Client of a set of cache-pool instances: placement, batching, and failure as a miss.

    put(blocks)    each block to its ``replicas`` rendezvous owners
                   (``services.cache_pool.placement``): one PoolPut per instance and
                   batch of ``max_call_blocks``, all concurrently
    get(keys)      the longest retrievable prefix of a hash chain. Consecutive keys with
                   the same owner go in one PoolGet; a key its owner lacks is asked of its
                   next replica; the walk stops at the first key no replica serves
    exists(keys)   the same walk with PoolExists (no bytes move, no use is recorded)
    remove(keys)   PoolRemove to every replica of every key

Bytes (``transport``): ``"data_plane"`` (the default) moves block bytes over the KV data
plane (``common/transfer``, ``common/pool_transfer.py``) and only control over ZeroMQ:

    put   PoolPut(keys, transfer_id)  ->  PoolReady(the pool's kv_advert)
          blocks as chunks to the pool's receiver (the best backend the two share)
          PoolCommit(transfer_id)      ->  Ack(blocks new to the pool), once stored
    get   expect transfer_id on this client's own receiver (a ``MultiReceiver``, started
          with the client)
          PoolGet(keys, transfer_id, this client's kv_advert)  ->  PoolBlocks(found)
          the pool sends the ``found`` blocks there

``"zmq"`` carries them as bulk frames of the same PoolPut / PoolBlocks instead: no
listener, one socket per instance, for a client that cannot accept connections from the
pool; it is also the baseline ``bench/pool_transfer.py`` compares against.

Failures: an instance that times out or cannot be reached counts as a miss (get, exists)
or a failed write (put, remove); the caller never sees an exception for it. Its first
failure is logged once as a warning; it is then skipped (a miss at once, no network) for
``down_retry_s`` at a time until it answers again, which is logged too. An ``Error``
reply is logged and also counts as a miss, without marking the instance down. So does a
transfer that fails (checksum, abort, a dead peer, its lease of ``timeout_s`` running
out): that get is a miss, that put batch a failed write, and both ends free it (the
client cancels the transfer it expected, and tells the pool of a put it could not send
with ``PoolCommit(abort=...)``; the pool's own lease covers a client that vanished).
Caller mistakes (a key outside uint64, blocks of unequal or zero size, a bad depth)
raise ValueError or TypeError before anything is sent.

A call that timed out may still be delivered if the instance comes back (ZeroMQ keeps it
queued); puts are idempotent, so only a late ``remove`` can drop a block stored since.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence

import structlog
import zmq
import zmq.asyncio

from common.address import parse_address, with_host
from common.pool_transfer import BlockInbox, send_blocks
from common.protocol import (
    GetStats,
    KVAdvert,
    Message,
    PoolBlocks,
    PoolCommit,
    PoolExists,
    PoolGet,
    PoolPut,
    PoolReady,
    PoolRemove,
    PoolStats,
)
from common.transfer import MultiReceiver, MultiSender, TransferError
from common.transfer.negotiate import check_advert, default_host_id
from common.zmq_rpc import RemoteError, RpcClient, RpcTimeout
from services.cache_pool import placement
from services.cache_pool.block import Buffer, check_block, check_key

log = structlog.get_logger(__name__)

_EXISTS_BATCH = 65536  # keys per PoolExists: no bytes move, only the envelope limits it


TRANSPORTS = ("data_plane", "zmq")
TRANSFER_BACKENDS = ("auto", "tcp", "shm", "ucx")


class PoolClient:
    """Talks to the pool instances ``instances`` (instance id -> control address).

    ``transport``: ``"data_plane"`` or ``"zmq"`` (module doc). With the data plane,
    ``transfer_backend`` ``"auto"`` negotiates per instance (shm on one host, else ucx,
    else tcp) and ``"tcp"``, ``"shm"`` or ``"ucx"`` forces one both ways; ``kv_host`` is
    the interface this client's receiver listens on (default: the local address that
    routes to the first instance); ``host_id`` names this host in adverts (default: the
    host name; shm needs the pool to report the same). The receiver starts at once when
    the client is made inside an event loop, else at the first get.

    ``counts`` (a Counter): ``transfer_out_bytes`` / ``transfer_in_bytes`` moved on the
    data plane by puts / gets, ``frame_out_bytes`` / ``frame_in_bytes`` as ZeroMQ bulk
    frames, ``transfers`` and ``transfers_failed``, ``backend_<kind>`` per put transfer.
    ``receiver`` (None until started) and ``inbox`` hold nothing while no call is in
    flight: ``receiver.live() == 0 and len(inbox) == 0``.
    """

    def __init__(self, ctx: zmq.asyncio.Context, instances: Mapping[str, str],
                 replicas: int = 1, *, timeout_s: float = 2.0, max_call_blocks: int = 64,
                 down_retry_s: float = 1.0, name: str = "pool-client",
                 transport: str = "data_plane", transfer_backend: str = "auto",
                 kv_host: str | None = None, host_id: str | None = None) -> None:
        if not instances:
            raise ValueError("no cache-pool instances given")
        if not 1 <= replicas <= len(instances):
            raise ValueError(f"replicas must be in 1..{len(instances)}, got {replicas}")
        if timeout_s <= 0 or max_call_blocks < 1 or down_retry_s < 0:
            raise ValueError("timeout_s must be > 0, max_call_blocks >= 1, down_retry_s >= 0")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(f"transfer_backend must be one of {TRANSFER_BACKENDS}, "
                             f"got {transfer_backend!r}")
        self.replicas = replicas
        self.timeout_s = timeout_s
        self.max_call_blocks = max_call_blocks
        self.down_retry_s = down_retry_s
        self.transport = transport
        self.counts: collections.Counter[str] = collections.Counter()
        self._ids = sorted(instances)
        self._controls = dict(instances)
        self._clients = {i: RpcClient(ctx, addr, name=f"{name}->{i}",
                                      server="cache-pool")
                         for i, addr in instances.items()}
        self._down_until: dict[str, float] = {}  # present while the instance is down
        self._closed = False
        # The data plane (unused with transport "zmq").
        forced = None if transfer_backend == "auto" else transfer_backend
        self._kinds = None if forced is None else (forced,)
        self._host_id = host_id or default_host_id()
        self._kv_host = kv_host
        self._sender = MultiSender(host_id=self._host_id, forced=forced)
        self._put_addrs: dict[str, tuple[object, str]] = {}  # instance -> (advert, address)
        self.inbox = BlockInbox()
        self.receiver: MultiReceiver | None = None
        self._starting: asyncio.Task | None = None
        if transport == "data_plane":
            with contextlib.suppress(RuntimeError):  # no running loop: start at first get
                asyncio.get_running_loop()
                self._starting = _quiet_task(self._start_receiver())

    def owners(self, key: int) -> list[str]:
        """The instances holding ``key``, best first."""
        return placement.owners(key, self._ids, self.replicas)

    async def put(self, blocks: Sequence[tuple[int, Buffer, int]]) -> int:
        """Store ``(key, data, depth)`` blocks; returns how many distinct keys at least one
        of their owners acknowledged. All blocks must have the same non-zero size."""
        size = None
        groups: dict[str, list[tuple[int, memoryview, int]]] = {}
        for key, data, depth in blocks:
            view = check_block(key, data, depth)
            n = len(view)
            if n == 0 or (size is not None and n != size):
                raise ValueError(f"block {key:#x} is {n} bytes; blocks must be equal, "
                                 f"non-empty ({size} before)")
            size = n
            for inst in self.owners(key):
                groups.setdefault(inst, []).append((key, view, depth))
        calls = [(inst, items[i:i + self.max_call_blocks]) for inst, items in groups.items()
                 for i in range(0, len(items), self.max_call_blocks)]
        done = await asyncio.gather(*(self._put_batch(inst, batch, size)
                                      for inst, batch in calls))
        stored = {k for (_, batch), ok in zip(calls, done, strict=True)
                  if ok for k, _, _ in batch}
        return len(stored)

    async def get(self, keys: Sequence[int]) -> list[bytes]:
        """The blocks of the longest prefix of ``keys`` the pool can serve, in order."""
        ask = self._get_frames if self.transport == "zmq" else self._get_transfer
        return await self._walk(keys, ask, self.max_call_blocks)

    async def exists(self, keys: Sequence[int]) -> int:
        """Length of the longest prefix of ``keys`` the pool holds."""

        async def ask(inst: str, run: list[int]) -> list[str]:
            reply = await self._call(inst, PoolExists(keys=run))
            if reply is None or not 0 <= reply.record.found <= len(run):
                return []
            return reply.record.tiers[:reply.record.found]

        return len(await self._walk(keys, ask, _EXISTS_BATCH))

    async def remove(self, keys: Sequence[int]) -> int:
        """Drop ``keys`` from every replica; returns how many (instance, block) copies
        were held by the instances that answered."""
        groups: dict[str, list[int]] = {}
        for key in keys:
            check_key(key)
            for inst in self.owners(key):
                groups.setdefault(inst, []).append(key)
        replies = await asyncio.gather(*(
            self._call(inst, PoolRemove(keys=run[i:i + _EXISTS_BATCH]))
            for inst, run in groups.items() for i in range(0, len(run), _EXISTS_BATCH)))
        return sum(int(r.record.detail) for r in replies
                   if r is not None and r.record.detail.isdigit())

    async def close(self) -> None:
        """Close every connection and the data plane; calls in flight fail as misses.
        Idempotent."""
        self._closed = True
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
            await asyncio.gather(self._starting, return_exceptions=True)
        for client in self._clients.values():
            await client.close()
        if self.receiver is not None:
            await self.receiver.close()
        await self._sender.close()

    # -- bytes: ZeroMQ frames ------------------------------------------------------------

    async def _get_frames(self, inst: str, run: list[int]) -> list[bytes]:
        reply = await self._call(inst, PoolGet(keys=run))
        if reply is None:
            return []
        found = reply.record.found
        if not 0 <= found <= len(run) or len(reply.bulk) != found:
            log.warning("pool_bad_reply", instance=inst, found=found, asked=len(run),
                        frames=len(reply.bulk))
            return []
        blocks = [bytes(b) for b in reply.bulk]
        self.counts["frame_in_bytes"] += sum(map(len, blocks))
        return blocks

    # -- bytes: the data plane -----------------------------------------------------------

    async def _put_batch(self, inst: str, batch: list[tuple[int, memoryview, int]],
                         size: int) -> bool:
        """One PoolPut of ``batch`` to ``inst``; True if the pool stored it."""
        keys, depths = [k for k, _, _ in batch], [d for _, _, d in batch]
        data = [b for _, b, _ in batch]
        if self.transport == "zmq":
            reply = await self._call(inst, PoolPut(keys=keys, depths=depths, block_bytes=size),
                                     bulk=data)
            if reply is not None:
                self.counts["frame_out_bytes"] += size * len(batch)
            return reply is not None
        tid = uuid.uuid4().hex
        deadline = asyncio.get_running_loop().time() + self.timeout_s  # the pool's lease
        reply = await self._call(inst, PoolPut(keys=keys, depths=depths, block_bytes=size,
                                               transfer_id=tid, lease_s=self.timeout_s))
        if reply is None:
            return False
        if not isinstance(reply.record, PoolReady):
            log.warning("pool_bad_reply", instance=inst, type=reply.envelope.type)
            return False  # the pool's lease ends whatever it expected
        try:
            address = self._address_for(inst, reply.record.kv_advert.as_dict())
            async with asyncio.timeout_at(deadline):
                await send_blocks(self._sender, address, tid, data)
        except Exception as exc:  # unexpected ones too: a failed write, not the caller's
            reason = self._transfer_failed(inst, "put", exc)
            with contextlib.suppress(Exception):  # else the pool's lease frees it
                await self._clients[inst].send(PoolCommit(transfer_id=tid, abort=reason))
            return False
        if await self._call(inst, PoolCommit(transfer_id=tid)) is None:
            self.counts["transfers_failed"] += 1
            return False
        self.counts["transfers"] += 1
        self.counts["transfer_out_bytes"] += size * len(batch)
        self.counts[f"backend_{address.partition('://')[0]}"] += 1
        return True

    async def _get_transfer(self, inst: str, run: list[int]) -> list[bytes]:
        receiver = await self._data_receiver()
        if receiver is None:
            return []
        tid = uuid.uuid4().hex
        try:
            transfer = self.inbox.open(receiver, tid, len(run), 0, self.timeout_s)
        except RuntimeError:  # closed meanwhile
            return []
        try:
            reply = await self._call(inst, PoolGet(keys=run, transfer_id=tid,
                                                   kv_advert=KVAdvert.of(receiver.advert()),
                                                   lease_s=self.timeout_s))
            if reply is None:
                return []
            found = reply.record.found if isinstance(reply.record, PoolBlocks) else -1
            if not 0 <= found <= len(run) or reply.bulk:
                log.warning("pool_bad_reply", instance=inst, found=found, asked=len(run),
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
            self.counts["transfers"] += 1
            self.counts["transfer_in_bytes"] += sum(map(len, blocks))
            return blocks
        finally:
            receiver.cancel(tid)
            self.inbox.discard(tid)

    async def _data_receiver(self) -> MultiReceiver | None:
        """This client's started receiver; None (logged) if it cannot start, retried at
        the next call."""
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
            _route_host, self._controls[self._ids[0]])
        receiver = MultiReceiver(self._kinds, host=host, sink=self.inbox.sink,
                                 host_id=self._host_id)
        await receiver.start()
        if self._closed:
            await receiver.close()
            raise RuntimeError("pool client closed")
        self.receiver = receiver
        return receiver

    def _address_for(self, inst: str, advert: Mapping) -> str:
        """Where to send ``inst`` its put blocks: negotiated against its advert (with a
        wildcard host replaced by the host its control address names), once per advert."""
        known = self._put_addrs.get(inst)
        if known is not None and known[0] == advert:
            return known[1]
        check_advert(advert)
        address = self._sender.address_for(_reachable(advert, self._controls[inst]))
        self._put_addrs[inst] = (advert, address)
        return address

    def _transfer_failed(self, inst: str, what: str, exc: BaseException | str) -> str:
        """Count and log a failed transfer; its reason. An exception other than the data
        plane's own (TransferError, a bad address, the deadline) is logged as a bug."""
        expected = isinstance(exc, str | TransferError | ValueError | TimeoutError)
        reason = (exc.reason if isinstance(exc, TransferError) else
                  "timed out" if isinstance(exc, TimeoutError) else
                  str(exc) or type(exc).__name__)
        self.counts["transfers_failed"] += 1
        (log.warning if expected else log.exception)(
            "pool_transfer_failed", instance=inst, op=what, error=reason)
        return reason

    # -- internals ----------------------------------------------------------------------

    async def _walk(self, keys: Sequence[int],
                    ask: Callable[[str, list[int]], Awaitable[list]], limit: int) -> list:
        """Walk the chain: from the first key not yet served, ask its replicas in rank
        order (skipping the one that just reported it missing) for the run of following
        keys that replica also holds; stop when no replica serves the key."""
        keys = list(keys)
        for key in keys:
            check_key(key)
        ranked = [self.owners(k) for k in keys]
        out: list = []
        pos, tried = 0, set()
        while pos < len(keys):
            got: list = []
            for rank in range(self.replicas):
                if rank in tried:
                    continue
                inst, end = ranked[pos][rank], pos + 1
                while end < len(keys) and end - pos < limit and ranked[end][rank] == inst:
                    end += 1
                got = await ask(inst, keys[pos:end])
                if got:
                    tried = {rank} if len(got) < end - pos else set()
                    break
            if not got:
                break
            out.extend(got)
            pos += len(got)
        return out

    async def _call(self, inst: str, record, bulk: Sequence[Buffer] = ()) -> Message | None:
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


def _reachable(advert: Mapping, control_addr: str) -> dict:
    """``advert`` with each wildcard endpoint host (the pool listens on every interface)
    replaced by the host of the control address we reach the pool by."""
    try:
        control_host = parse_address(control_addr).host
    except ValueError:  # ipc: no host to put in their place
        control_host = ""
    endpoints = {}
    for kind, address in advert["endpoints"].items():
        with contextlib.suppress(ValueError):  # not host:port: left as it is
            address = with_host(address, control_host)
        endpoints[kind] = address
    return {"host_id": advert["host_id"], "endpoints": endpoints}


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
