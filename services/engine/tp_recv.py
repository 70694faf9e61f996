"""Direct KV receive on a tensor-parallel decode worker: every rank takes the KV heads its
blocks hold straight off the data plane, instead of rank 0 taking all heads and
scattering them (``tp_kv.py``).

    decode rank 0                                   decode rank r > 0
    start: KV_LISTEN plan ────────────────────────► its own receiver (tcp, shm, ucx) on a
           reads each rank's endpoints ◄── store ── thread of its own; endpoints published
    advert: KVAdvert.ranks = [endpoints, heads of each rank]
    admit:  receiver.expect(rid, token) and KV_EXPECT plan ──► expect(rid, token, blocks)
    prefill ranks ── CHUNK(heads in the receiving rank's own numbering) ──► every rank
    PrefillDone + own transfer DONE, then ``landed``: ◄── store ── "ok" or why it failed
    fall back / abort: KV_DROP plan ──► the rank's transfer cancelled before its blocks
                                         can be freed and reused

A slice names heads in its receiving rank's numbering (start within that rank's heads,
of that rank's head count), so each rank's receiver and ledger (``common/transfer/
slices.py``) work as a one-rank engine's do and settle once every head it holds is in
for every layer. Completion comes back through the group's TCPStore (one key per rank
and transfer), read by rank 0's event loop without a collective. Followers write into
blocks reserved for a request waiting for its KV, which no step reads until rank 0
completes it, and which rank 0 frees only after a KV_DROP has stopped the follower's
sink (plans reach a follower in order, before any later step).

Only where ranks do not share KV heads (TP size <= KV heads), on the backends rank 0's
receiver serves (``RECV_KINDS`` of them: a ucx follower runs ucxx on its receiver's
thread, its own process's one context); a replicated head keeps rank 0's
receive-and-scatter path.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from datetime import timedelta

import msgpack
import structlog

log = structlog.get_logger(__name__)

RECV_KINDS = ("tcp", "shm", "ucx")
# Plan kinds (tp_group.py has the rest): start the followers' receivers, expect a
# transfer there, stop taking one.
KV_LISTEN, KV_EXPECT, KV_DROP = 6, 7, 8
ADVERT_KEY = "kvadv/{rank}"
LISTEN_TIMEOUT_S = 30.0
POLL_S = 0.002
# Test-only, never set in a deployment: names a file; while the file holds a rank's
# number, that rank refuses every slice of each transfer it is then asked to expect (its
# sink raises), so a test can toggle it without restarting the worker. A bare number (no
# such file) does nothing: the switch cannot be thrown by a stray value.
FAIL_ENV = "PDSERVE_TEST_TP_RECV_FAIL"


def refuses(rank: int) -> bool:
    """Whether the test-only switch ``FAIL_ENV`` tells ``rank`` to refuse slices now."""
    path = os.environ.get(FAIL_ENV)
    if not path:
        return False
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip() == str(rank)
    except (OSError, ValueError):
        return False


def landed_key(rid: str, token: bytes, rank: int) -> str:
    return f"kvin/{rid}/{token.hex()}/{rank}"


class FollowerReceiver:
    """A decode follower's data-plane receiver, on an event loop thread of its own."""

    def __init__(self, cache, rank: int, store) -> None:
        self.cache = cache
        self.rank = rank
        self.store = store
        self._loop: asyncio.AbstractEventLoop | None = None
        self._receiver = None
        # rid -> (token, blocks, whether the test-only switch refuses its slices)
        self._expected: dict[str, tuple[bytes, list[int], bool]] = {}
        if os.environ.get(FAIL_ENV):
            log.warning("test-only KV refusal switch set", variable=FAIL_ENV, rank=rank)

    def _call(self, fn, *args, timeout: float = 30.0):
        """Run ``fn(*args)`` on the receiver's loop and wait for its result."""
        async def run():
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)

    def apply(self, kind: int, payload: bytes) -> None:
        """Carry out one of rank 0's receive plans (KV_LISTEN / KV_EXPECT / KV_DROP), as
        ``LeaderReceive`` packs them."""
        if kind == KV_LISTEN:
            self.listen(*msgpack.unpackb(payload))
        elif kind == KV_EXPECT:
            self.expect(*msgpack.unpackb(payload))
        elif kind == KV_DROP:
            self.drop(*msgpack.unpackb(payload))
        else:
            raise ValueError(f"unknown receive plan kind {kind}")

    def listen(self, kinds: list[str], host: str, host_id: str) -> None:
        """Start the receiver and publish its endpoints in the store. Plan thread."""
        from common.transfer import MultiReceiver

        if self._loop is not None:
            return
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name="tp-kv-recv", daemon=True).start()
        self._loop = loop
        self._receiver = MultiReceiver(tuple(kinds), host=host, port=0, sink=self._whole,
                                       slice_sink=self._slice, host_id=host_id)
        asyncio.run_coroutine_threadsafe(self._receiver.start(), loop).result(30)
        endpoints = self._receiver.advert().endpoints
        self.store.set(ADVERT_KEY.format(rank=self.rank),
                       msgpack.packb(dict(endpoints), use_bin_type=True))

    def expect(self, rid: str, token: bytes, lease_s: float, block_ids: list[int]) -> None:
        def go() -> None:
            if rid in self._expected:  # a stale one: its rank 0 gave up on it
                self._drop(rid)
            transfer = self._receiver.expect(rid, lease_s, token)
            self._expected[rid] = (token, block_ids, refuses(self.rank))
            self._loop.create_task(self._watch(rid, token, transfer))
        self._call(go)

    def drop(self, rid: str, token: bytes) -> None:
        """Stop taking ``rid``'s slices (returns once none can land) and forget it."""
        def go() -> None:
            if self._expected.get(rid, (None,))[0] == token:
                self._drop(rid)
            with contextlib.suppress(Exception):
                self.store.delete_key(landed_key(rid, token, self.rank))
        self._call(go)

    def _drop(self, rid: str) -> None:
        self._expected.pop(rid, None)
        self._receiver.cancel(rid)

    async def _watch(self, rid: str, token: bytes, transfer) -> None:
        try:
            await transfer.wait()
            state = b"ok %d" % transfer.bytes_received
        except Exception as exc:  # noqa: BLE001 - the transfer's failure, reported
            state = f"rank {self.rank}: {exc}".encode()[:512]
        if self._expected.get(rid, (None,))[0] != token:
            return  # dropped: rank 0 no longer asks
        self._expected.pop(rid, None)
        try:
            self.store.set(landed_key(rid, token, self.rank), state)
        except Exception:  # noqa: BLE001 - rank 0 then runs into its lease
            log.exception("could not report a KV transfer's end", request_id=rid)

    def _whole(self, rid, layer, block_ids, payload) -> None:
        raise ValueError("a tensor-parallel rank takes only its own heads' slices")

    def _slice(self, rid: str, layer: int, block_ids: list[int],
               heads: tuple[int, int, int], payload: memoryview) -> None:
        expected = self._expected.get(rid)
        if expected is None or block_ids != expected[1]:
            raise ValueError(f"KV for blocks {block_ids[:4]}…, not the ones reserved")
        if expected[2]:
            raise ValueError(f"{FAIL_ENV} refuses rank {self.rank}'s slices")
        self.cache.import_layer_slice_bytes(layer, block_ids, heads, payload)

    def close(self) -> None:
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._receiver.close(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)


class LeaderReceive:
    """Rank 0's side: the followers' receivers (started by a plan), their endpoints, and
    whether their part of a transfer landed. ``send_plan(payload, kind)`` as in
    ``tp_kv.ShardedKVStore``."""

    def __init__(self, store, port: int, world_size: int, send_plan) -> None:
        self._store = store
        self._port = port
        self._world = world_size
        self._send_plan = send_plan
        self._poll_store = None  # a client of its own for the event loop
        self.ranks: list[dict] = []  # endpoints of ranks 1.., once listening

    def listen(self, kinds: list[str], host: str, host_id: str) -> list[dict]:
        """Start every follower's receiver; their endpoints, rank 1 first. Engine thread."""
        if self.ranks:
            return self.ranks
        self._send_plan(msgpack.packb([kinds, host, host_id], use_bin_type=True), KV_LISTEN)
        keys = [ADVERT_KEY.format(rank=r) for r in range(1, self._world)]
        self._store.wait(keys, timedelta(seconds=LISTEN_TIMEOUT_S))
        self.ranks = [msgpack.unpackb(self._store.get(k)) for k in keys]
        return self.ranks

    def expect(self, rid: str, token: bytes, lease_s: float, block_ids: list[int]) -> None:
        self._send_plan(msgpack.packb([rid, token, lease_s, list(block_ids)],
                                      use_bin_type=True), KV_EXPECT)

    def drop(self, rid: str, token: bytes) -> None:
        self._send_plan(msgpack.packb([rid, token], use_bin_type=True), KV_DROP)

    async def landed(self, rid: str, token: bytes, timeout_s: float) -> tuple[str | None, int]:
        """(None, bytes the followers took) once every follower's part of the transfer
        is in; else (why not: a failure one reported, or none within ``timeout_s``, 0).
        Event loop."""
        import torch.distributed as dist

        if self._poll_store is None:
            self._poll_store = dist.TCPStore("127.0.0.1", self._port, is_master=False,
                                             wait_for_workers=False,
                                             timeout=timedelta(seconds=10))
        store = self._poll_store
        keys = [landed_key(rid, token, r) for r in range(1, self._world)]
        deadline = time.monotonic() + timeout_s
        delay = POLL_S
        while not store.check(keys):
            if time.monotonic() > deadline:
                return f"KV slices of the followers not in within {timeout_s:.1f} s", 0
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
        states = [bytes(store.get(k)) for k in keys]
        for k in keys:
            store.delete_key(k)
        failed = [s.decode(errors="replace") for s in states if not s.startswith(b"ok ")]
        if failed:
            return "; ".join(failed), 0
        return None, sum(int(s[3:]) for s in states)
