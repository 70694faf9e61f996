"""Client of a set of cache-pool instances: placement, batching, and failure as a miss.

    put(blocks)    each block to its ``replicas`` rendezvous owners
                   (``common.pool.placement``): one PoolPut per instance and batch of
                   ``max_call_blocks``, all concurrently
    get(keys)      the longest retrievable prefix of a hash chain. Consecutive keys with
                   the same owner go in one PoolGet; a key its owner lacks is asked of its
                   next replica; the walk stops at the first key no replica serves
    exists(keys)   the same walk with PoolExists (no bytes move, no use is recorded)
    remove(keys)   PoolRemove to every replica of every key

Bytes travel by one carrier (``common.pool.carrier``) chosen by ``transport`` when the
client is made: ``"data_plane"`` (the default) moves block bytes over the KV data plane
(``common.pool.data_plane``) and only control over ZeroMQ; ``"zmq"`` carries them as bulk
frames of the same PoolPut / PoolBlocks (``common.pool.frames``): no listener, for a
client that cannot accept connections from the pool, and the baseline
``bench/pool_transfer.py`` compares against.

Failures: an instance that times out or cannot be reached counts as a miss (get, exists)
or a failed write (put, remove); the caller never sees an exception for it. It is then
skipped for ``down_retry_s`` at a time until it answers again (``common.pool.instances``).
An ``Error`` reply, or a transfer that fails, also counts as a miss or a failed write.
Caller mistakes (a key outside uint64, blocks of unequal or zero size, a bad depth)
raise ValueError or TypeError before anything is sent.

A call that timed out may still be delivered if the instance comes back (ZeroMQ keeps it
queued); puts are idempotent, so only a late ``remove`` can drop a block stored since.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable, Mapping, Sequence

import zmq.asyncio

from common.pool import placement
from common.pool.carrier import Carrier
from common.pool.data_plane import DataPlaneCarrier
from common.pool.frames import FrameCarrier
from common.pool.instances import Instances
from common.pool.keys import Buffer, check_block, check_key
from common.pool.transfer import BlockInbox
from common.protocol import PoolExists, PoolRemove
from common.transfer import MultiReceiver

_EXISTS_BATCH = 65536  # keys per PoolExists: no bytes move, only the envelope limits it


TRANSPORTS = ("data_plane", "zmq")
TRANSFER_BACKENDS = ("auto", "tcp", "shm", "ucx")


class PoolClient:
    """Talks to the pool instances ``instances`` (instance id -> control address).

    ``transport``: ``"data_plane"`` or ``"zmq"`` (module doc). With the data plane,
    ``transfer_backend`` ``"auto"`` negotiates per instance (shm on one host, else ucx,
    else tcp) and ``"tcp"``, ``"shm"`` or ``"ucx"`` forces one both ways; ``kv_host`` and
    ``host_id`` are the receiver's (``DataPlaneCarrier``).

    ``counts`` (a Counter): ``transfer_out_bytes`` / ``transfer_in_bytes`` moved on the
    data plane by puts / gets, ``frame_out_bytes`` / ``frame_in_bytes`` as ZeroMQ bulk
    frames, ``transfers`` and ``transfers_failed``, ``backend_<kind>`` per put transfer.
    ``receiver`` (None until started, and with the zmq transport) and ``inbox`` hold
    nothing while no call is in flight: ``receiver.live() == 0 and len(inbox) == 0``.
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
        self._instances = Instances(ctx, instances, timeout_s=timeout_s,
                                    down_retry_s=down_retry_s, name=name)
        self.carrier: Carrier = (
            FrameCarrier(self._instances, self.counts) if transport == "zmq" else
            DataPlaneCarrier(self._instances, self.counts, timeout_s=timeout_s,
                             forced=None if transfer_backend == "auto" else transfer_backend,
                             kv_host=kv_host, host_id=host_id))

    @property
    def receiver(self) -> MultiReceiver | None:
        return self.carrier.receiver

    @property
    def inbox(self) -> BlockInbox | None:
        return self.carrier.inbox

    def owners(self, key: int) -> list[str]:
        """The instances holding ``key``, best first."""
        return placement.owners(key, self._instances.ids, self.replicas)

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
        done = await asyncio.gather(*(
            self.carrier.put(inst, [k for k, _, _ in batch], [d for _, _, d in batch],
                             [b for _, b, _ in batch], size)
            for inst, batch in calls))
        stored = {k for (_, batch), ok in zip(calls, done, strict=True)
                  if ok for k, _, _ in batch}
        return len(stored)

    async def get(self, keys: Sequence[int]) -> list[Buffer]:
        """The blocks of the longest prefix of ``keys`` the pool can serve, in order.
        On the data plane they are views of reused memory (``common.pool.landing``): held
        blocks stay as they are, and memory is reused once none of a call's is held."""
        return await self._walk(keys, self.carrier.get, self.max_call_blocks)

    async def exists(self, keys: Sequence[int]) -> int:
        """Length of the longest prefix of ``keys`` the pool holds."""

        async def ask(inst: str, run: list[int]) -> list[str]:
            reply = await self._instances.call(inst, PoolExists(keys=run))
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
            self._instances.call(inst, PoolRemove(keys=run[i:i + _EXISTS_BATCH]))
            for inst, run in groups.items() for i in range(0, len(run), _EXISTS_BATCH)))
        return sum(int(r.record.detail) for r in replies
                   if r is not None and r.record.detail.isdigit())

    async def close(self) -> None:
        """Close every connection and the carrier; calls in flight fail as misses.
        Idempotent."""
        await self.carrier.close()
        await self._instances.close()

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
