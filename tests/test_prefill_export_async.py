"""The prefill role starts each layer's KV export where it is computed and waits for its
bytes off the engine thread: on a GPU the copy to the host overlaps the next layer;
on the CPU the export is the same zero-copy view as before, ready at once."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.kv_cache import KVCache
from services.worker.engine_loop import EngineLoop, ExportedNow
from services.worker.prefill_role import exported_bytes


def test_cpu_export_is_ready_at_once_and_shares_the_gather():
    cache = KVCache(2, 6, 4, 2, 8, torch.float32)
    cache.k.normal_()
    cache.v.normal_()
    pending = cache.export_layer_async(1, [4, 0, 2])
    assert pending.ready()
    view = pending.wait()
    assert view is pending.wait()  # one buffer, not a copy per wait
    want = torch.stack([cache.k[1, [4, 0, 2]], cache.v[1, [4, 0, 2]]])
    assert bytes(view) == want.numpy().tobytes()
    assert bytes(view) == bytes(cache.export_layer_bytes(1, [4, 0, 2]))


class _OnTheWay:
    """An export whose copy finishes when ``done`` is set (a side stream stand-in)."""

    def __init__(self, payload: bytes) -> None:
        self.done = threading.Event()
        self.payload = memoryview(payload)
        self.waited_on: list[str] = []

    def ready(self) -> bool:
        return self.done.is_set()

    def wait(self) -> memoryview:
        self.waited_on.append(threading.current_thread().name)
        if not self.done.wait(10):
            raise TimeoutError("copy never finished")
        return self.payload


async def test_a_pending_layer_is_waited_for_off_the_event_loop():
    pending = _OnTheWay(b"kv bytes")
    waiting = asyncio.create_task(exported_bytes(pending))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # the loop runs on while the copy is under way
    pending.done.set()
    assert bytes(await waiting) == b"kv bytes"
    assert pending.waited_on[0] != threading.current_thread().name
    ready = ExportedNow(memoryview(b"now"))
    assert bytes(await exported_bytes(ready)) == b"now"


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))


async def test_engine_loop_starts_exports_on_the_engine_thread_only(private_cache):
    engine = LLMEngine(EngineConfig(random_weights="tiny", device="cpu", dtype="float32",
                                    num_kv_blocks=8))
    engine.kv_store.k.normal_()
    loop = EngineLoop(lambda outputs, step_s: None)
    await loop.start(lambda: engine)
    try:
        pending = await loop.call(lambda: loop.export_layer_async(1, [3, 5]))
        assert pending.ready()
        assert bytes(pending.wait()) == bytes(engine.kv_store.export_layer_bytes(1, [3, 5]))
        with pytest.raises(RuntimeError, match="engine thread only"):
            loop.export_layer_async(1, [3])

        class NoAsync:  # a store without async exports (tensor parallelism's)
            def export_layer_bytes(self, layer, block_ids):
                return memoryview(bytes([layer, *block_ids]))

        engine.kv_store, real = NoAsync(), engine.kv_store
        try:
            fallback = await loop.call(lambda: loop.export_layer_async(2, [7]))
        finally:
            engine.kv_store = real
        assert isinstance(fallback, ExportedNow) and bytes(fallback.wait()) == b"\x02\x07"
    finally:
        await loop.stop()
