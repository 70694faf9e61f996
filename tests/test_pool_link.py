"""The worker's pool link in isolation: the fetch-or-compute estimate and write-back
bounds. (Fetching and writing back for real: tests/test_pool_system.py.)"""

from __future__ import annotations

import asyncio
import types

import pytest

from services.worker import pool_link
from services.worker.engine_loop import EngineFacts
from services.worker.pool_link import PoolLink
from services.worker.settings import WorkerSettings


def fake_context(rate: float, block_nbytes: int = 720 * 1024, **settings):
    """What PoolLink reads of its RoleContext; the engine loop answers no engine calls."""
    facts = EngineFacts(block_size=16, num_blocks=64, num_layers=2, block_nbytes=block_nbytes,
                        fingerprint="fp")
    return types.SimpleNamespace(
        settings=WorkerSettings(**settings), worker_id="w",
        loop=types.SimpleNamespace(prefill_tokens_per_s=rate, facts=facts))


@pytest.mark.asyncio
async def test_fetch_only_when_cheaper_than_computing():
    link = PoolLink(fake_context(rate=0.0, cache_pools="tcp://127.0.0.1:1"))
    assert link._worth_fetching(100)  # nothing measured yet: fetch
    # 1 GB/s and 720 KiB blocks: ~0.74 ms a block, against 16 tokens at the rate.
    link.ctx.loop.prefill_tokens_per_s = 500.0  # 32 ms a block: fetch
    assert link._worth_fetching(1) and link._worth_fetching(100)
    link.ctx.loop.prefill_tokens_per_s = 50_000.0  # 0.32 ms a block: compute
    assert not link._worth_fetching(100)
    link.bandwidth = 10e9  # a faster pool tips it back: 0.074 ms a block
    assert link._worth_fetching(100)
    assert not link._worth_fetching(1)  # the fixed cost of a fetch dominates one block


@pytest.mark.asyncio
async def test_write_back_is_queued_bounded_and_dropped_past_the_bound(monkeypatch):
    monkeypatch.setattr(pool_link, "MAX_QUEUED_BLOCKS", 10)
    link = PoolLink(fake_context(rate=0.0, cache_pools="tcp://127.0.0.1:1"))
    link.client = object()  # connected; the writer task is not running
    prompt = list(range(16 * 6 + 3))  # six full blocks
    link.computed(prompt, None)
    assert link._queued == 6 and len(link._queue[0]) == 6
    link.computed(prompt, None)  # 12 > 10: dropped whole, counted
    assert link._queued == 6 and link.counts["write_back_dropped"] == 6
    link.computed(prompt[:40], "salt")  # two blocks fit
    assert link._queued == 8
    assert link._queue[1] != link._queue[0][:2]  # the salt changes every hash


@pytest.mark.asyncio
async def test_without_pools_it_neither_fetches_nor_writes():
    ctx = fake_context(rate=0.0)
    calls = []
    engine = object()

    async def run(fn, *args, **kwargs):  # the engine loop: fn(engine, ...) on its thread
        calls.append(fn(engine, *args, **kwargs))
        return calls[-1]

    ctx.loop.run = run
    link = PoolLink(ctx)
    await link.start()
    assert not link.enabled and link._tasks == []
    assert await link.with_prefix([1, 2, 3], None, lambda e, x: x * 2, 21) == 42
    link.computed(list(range(64)), None)
    assert link._queued == 0 and calls == [42]
    await link.close()
    await asyncio.sleep(0)


@pytest.mark.asyncio
async def test_write_back_waits_for_the_copy_off_the_event_loop():
    """The engine thread only starts the export; its bytes are waited for on another
    thread while the event loop runs on, then put under their keys and positions."""
    import threading

    from services.engine.kv_store import PendingBlocks

    class OnTheWay:  # a side-stream copy that ends when ``done`` is set
        def __init__(self, payload):
            self.payload, self.done, self.waited_on = memoryview(payload), threading.Event(), []

        def ready(self):
            return self.done.is_set()

        def wait(self):
            self.waited_on.append(threading.current_thread().name)
            if not self.done.wait(10):
                raise TimeoutError("copy never finished")
            return self.payload

    copy = OnTheWay(b"aaaabbbb")
    engine = types.SimpleNamespace(pool_blocks=types.SimpleNamespace(
        export_async=lambda hashes: PendingBlocks(2, 4, pending=copy)))
    started = []

    async def run(fn, *args):
        started.append(args)
        return fn(engine, *args)

    class Client:
        puts: list = []

        async def exists(self, keys):
            return 1  # the pool holds the first block already

        async def put(self, items):
            self.puts.append([(k, bytes(d), pos) for k, d, pos in items])

    ctx = fake_context(rate=0.0, cache_pools="tcp://127.0.0.1:1")
    ctx.loop.run = run
    link = PoolLink(ctx)
    link.client = Client()
    writing = asyncio.create_task(link._write([11, 12, 13]))
    await asyncio.sleep(0.05)
    assert started == [([12, 13],)] and not writing.done()  # the loop is not blocked
    copy.done.set()
    async with asyncio.timeout(10):
        await writing
    assert Client.puts == [[(12, b"aaaa", 1), (13, b"bbbb", 2)]]
    assert link.counts["written_blocks"] == 2
    assert copy.waited_on[0] != threading.current_thread().name
