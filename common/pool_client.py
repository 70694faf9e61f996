"""Client of a set of cache-pool instances: placement, batching, and failure as a miss.

    put(blocks)    each block to its ``replicas`` rendezvous owners
                   (``services.cache_pool.placement``): one PoolPut per instance and
                   batch of ``max_call_blocks``, all concurrently
    get(keys)      the longest retrievable prefix of a hash chain. Consecutive keys with
                   the same owner go in one PoolGet; a key its owner lacks is asked of its
                   next replica; the walk stops at the first key no replica serves
    exists(keys)   the same walk with PoolExists (no bytes move, no use is recorded)
    remove(keys)   PoolRemove to every replica of every key

Failures: an instance that times out or cannot be reached counts as a miss (get, exists)
or a failed write (put, remove); the caller never sees an exception for it. Its first
failure is logged once as a warning; it is then skipped (a miss at once, no network) for
``down_retry_s`` at a time until it answers again, which is logged too. An ``Error``
reply is logged and also counts as a miss, without marking the instance down. Caller
mistakes (a key outside uint64, blocks of unequal or zero size, a bad depth) raise
ValueError or TypeError before anything is sent.

A call that timed out may still be delivered if the instance comes back (ZeroMQ keeps it
queued); puts are idempotent, so only a late ``remove`` can drop a block stored since.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

import structlog
import zmq
import zmq.asyncio

from common.protocol import GetStats, Message, PoolExists, PoolGet, PoolPut, PoolRemove
from common.zmq_io import RemoteError, RpcClient, RpcTimeout
from services.cache_pool import placement
from services.cache_pool.block import Buffer, check_block, check_key

log = structlog.get_logger(__name__)

_EXISTS_BATCH = 65536  # keys per PoolExists: no bytes move, only the envelope limits it


class PoolClient:
    """Talks to the pool instances ``instances`` (instance id -> control address)."""

    def __init__(self, ctx: zmq.asyncio.Context, instances: Mapping[str, str],
                 replicas: int = 1, *, timeout_s: float = 2.0, max_call_blocks: int = 64,
                 down_retry_s: float = 1.0, name: str = "pool-client") -> None:
        if not instances:
            raise ValueError("no cache-pool instances given")
        if not 1 <= replicas <= len(instances):
            raise ValueError(f"replicas must be in 1..{len(instances)}, got {replicas}")
        if timeout_s <= 0 or max_call_blocks < 1 or down_retry_s < 0:
            raise ValueError("timeout_s must be > 0, max_call_blocks >= 1, down_retry_s >= 0")
        self.replicas = replicas
        self.timeout_s = timeout_s
        self.max_call_blocks = max_call_blocks
        self.down_retry_s = down_retry_s
        self._ids = sorted(instances)
        self._clients = {i: RpcClient(ctx, addr, name=f"{name}->{i}")
                         for i, addr in instances.items()}
        self._down_until: dict[str, float] = {}  # present while the instance is down

    def owners(self, key: int) -> list[str]:
        """The instances holding ``key``, best first."""
        return placement.owners(key, self._ids, self.replicas)

    async def put(self, blocks: Sequence[tuple[int, Buffer, int]]) -> int:
        """Store ``(key, data, depth)`` blocks; returns how many distinct keys at least one
        of their owners acknowledged. All blocks must have the same non-zero size."""
        size = None
        groups: dict[str, list[tuple[int, Buffer, int]]] = {}
        for key, data, depth in blocks:
            n = len(check_block(key, data, depth))
            if n == 0 or (size is not None and n != size):
                raise ValueError(f"block {key:#x} is {n} bytes; blocks must be equal, "
                                 f"non-empty ({size} before)")
            size = n
            for inst in self.owners(key):
                groups.setdefault(inst, []).append((key, data, depth))
        calls = [(inst, items[i:i + self.max_call_blocks]) for inst, items in groups.items()
                 for i in range(0, len(items), self.max_call_blocks)]
        replies = await asyncio.gather(*(
            self._call(inst, PoolPut(keys=[k for k, _, _ in batch],
                                     depths=[d for _, _, d in batch], block_bytes=size),
                       bulk=[b for _, b, _ in batch])
            for inst, batch in calls))
        stored = {k for (_, batch), reply in zip(calls, replies, strict=True)
                  if reply is not None for k, _, _ in batch}
        return len(stored)

    async def get(self, keys: Sequence[int]) -> list[bytes]:
        """The blocks of the longest prefix of ``keys`` the pool can serve, in order."""

        async def ask(inst: str, run: list[int]) -> list[bytes]:
            reply = await self._call(inst, PoolGet(keys=run))
            if reply is None:
                return []
            found = reply.record.found
            if not 0 <= found <= len(run) or len(reply.bulk) != found:
                log.warning("pool_bad_reply", instance=inst, found=found, asked=len(run),
                            frames=len(reply.bulk))
                return []
            return [bytes(b) for b in reply.bulk]

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
        """Close every connection; calls in flight fail as misses. Idempotent."""
        for client in self._clients.values():
            await client.close()

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


def parse_pool_addrs(spec: str) -> list[str]:
    """Control addresses from a comma-separated setting; "" means no pool."""
    return [a.strip() for a in spec.split(",") if a.strip()]


async def discover_pools(ctx: zmq.asyncio.Context, control_addrs: Sequence[str], *,
                         timeout_s: float = 2.0) -> dict[str, dict]:
    """Ask each pool instance for its Stats: instance id -> those values (which name its
    ``control_addr`` and ``events_addr``). Instances that do not answer are left out;
    a caller that needs them all retries."""

    async def ask(addr: str) -> dict | None:
        client = RpcClient(ctx, addr, name="pool-discovery")
        try:
            reply = await client.call(GetStats(), timeout=timeout_s)
            values = dict(reply.record.values)
            values["control_addr"] = addr  # the address we reach it by, not its bind
            return values
        except (RemoteError, RpcTimeout, ConnectionError, zmq.ZMQError) as exc:
            log.info("pool_not_answering", addr=addr, error=str(exc) or type(exc).__name__)
            return None
        finally:
            await client.close()

    found = await asyncio.gather(*(ask(a) for a in control_addrs))
    return {v["instance_id"]: v for v in found if v is not None}
