"""KV export off a device: the reusable host-buffer pool, the side-stream copy (with a
stand-in for torch.cuda), and the CPU path that stays a zero-copy view."""

from __future__ import annotations

import gc

import torch

from services.engine.host_buffers import HostBufferPool, PendingBytes, SideStream
from services.engine.kv_cache import KVCache


def test_pool_reuses_a_buffer_once_its_views_are_gone():
    pool = HostBufferPool(pin=False)
    buf = pool.take(64)
    assert buf.dtype == torch.uint8 and buf.numel() == 64 and not buf.is_pinned()
    view = pool.view(buf)
    view[:3] = b"abc"
    sub = view[1:3]  # a slice keeps the bytes (and the buffer) held too
    del view, buf
    gc.collect()
    assert pool.stats.idle == 0
    assert bytes(sub) == b"bc"
    del sub
    gc.collect()
    assert pool.stats == (1, 0, 1, 64)
    again = pool.take(64)
    assert bytes(again[:3].numpy()) == b"abc"  # the very same memory
    assert pool.stats == (1, 1, 0, 0)
    other = pool.take(32)  # another size never takes it
    assert pool.stats.allocated == 2 and other.numel() == 32


def test_pool_bounds_what_it_keeps_and_frees_all_on_close():
    pool = HostBufferPool(pin=False, max_idle_per_size=2, max_idle_bytes=300)
    bufs = [pool.take(100) for _ in range(4)]
    for b in bufs:
        pool.give_back(b)
    assert pool.stats.idle == 2  # two per size
    pool.give_back(pool.take(150))  # within the byte cap? 200 + 150 > 300: dropped
    assert pool.stats.idle == 2 and pool.stats.idle_bytes == 200
    held = pool.view(pool.take(100))
    pool.close()
    assert pool.stats.idle == 0
    del held  # returned after close: freed, not kept
    gc.collect()
    assert pool.stats.idle == 0


class _FakeStreams:
    """torch.cuda's stream API as a log, for CPU tests."""

    def __init__(self):
        self.log: list[str] = []
        self.current = "compute"
        fake = self

        class Stream:
            def __init__(self, device):
                self.device = device

            def wait_event(self, event):
                fake.log.append(f"side waits {event.name}")

        class Event:
            count = 0

            def __init__(self):
                Event.count += 1
                self.name = f"e{Event.count}"
                self.synced = False

            def record(self, stream):
                where = "side" if isinstance(stream, Stream) else stream
                fake.log.append(f"{self.name} on {where}")

            def query(self):
                return self.synced

            def synchronize(self):
                fake.log.append(f"sync {self.name}")
                self.synced = True

        self.Stream, self.Event = Stream, Event

    def current_stream(self, device):
        if self.current != "compute":
            return self.current
        fake = self

        class Compute(str):  # still "compute" where the log names it
            def wait_event(self, event):
                fake.log.append(f"compute waits {event.name}")

        return Compute("compute")

    def stream(self, s):
        fake = self

        class _Ctx:
            def __enter__(self):
                fake.current = "side"
                fake.log.append("enter side")

            def __exit__(self, *exc):
                fake.current = "compute"
                fake.log.append("leave side")

        return _Ctx()


def test_side_stream_orders_the_copy_after_compute_and_never_blocks_it():
    streams = _FakeStreams()
    side = SideStream(torch.device("cpu"), streams)
    seen = []
    result, done = side.run(lambda: seen.append(streams.current) or "packed")
    assert result == "packed" and seen == ["side"]  # the work ran under the side stream
    assert streams.log == ["e1 on compute", "enter side", "side waits e1", "e2 on side",
                           "leave side"]  # nothing makes compute wait
    pending = PendingBytes(b"xyz", done, lambda b: memoryview(b))
    assert not pending.ready()
    assert bytes(pending.wait()) == b"xyz"
    assert streams.log[-1] == "sync e2" and pending.ready()


def _filled_cache():
    cache = KVCache(2, 6, 4, 2, 8, torch.float32)
    gen = torch.Generator().manual_seed(0)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    return cache


def test_cpu_export_is_a_view_ready_at_once():
    cache = _filled_cache()
    assert cache._host is None and cache._side is None  # no pool, no stream on the CPU
    pending = cache.export_layer_async(1, [4, 0])
    assert pending.ready()
    want = torch.stack([cache.k[1][[4, 0]], cache.v[1][[4, 0]]])
    assert bytes(pending.wait()) == want.numpy().tobytes()


def test_device_export_path_through_pool_and_side_stream():
    """The CUDA code path run on CPU tensors: fake streams, an unpinned pool."""
    cache, plain = _filled_cache(), _filled_cache()
    streams = _FakeStreams()
    cache._host = HostBufferPool(pin=False)
    cache._side = SideStream(torch.device("cpu"), streams)
    pending = cache.export_layer_async(0, [5, 2, 3])
    assert streams.log[:3] == ["e1 on compute", "enter side", "side waits e1"]
    got = pending.wait()
    assert bytes(got) == bytes(plain.export_layer_bytes(0, [5, 2, 3]))
    assert bytes(cache.export_block_bytes(3)) == bytes(plain.export_block_bytes(3))
    del got, pending  # the pending export holds its bytes too
    gc.collect()
    assert cache._host.stats.idle == 2  # the layer's buffer and the block's
    again = cache.export_layer_bytes(0, [1, 1, 1])  # same size: the same buffer back
    assert cache._host.stats.reused == 1 and cache._host.stats.allocated == 2
    assert bytes(again) == bytes(plain.export_layer_bytes(0, [1, 1, 1]))
    cache.close()
    assert cache._host.stats.idle == 0


def _device_path(cache):
    """``cache`` on the CUDA code path with CPU tensors: fake streams, an unpinned pool."""
    streams = _FakeStreams()
    cache._host = HostBufferPool(pin=False)
    cache._side = SideStream(torch.device("cpu"), streams)
    return streams


def test_pool_export_packs_on_compute_then_copies_on_the_side():
    """The gather is queued on the compute stream, before a later step could reuse the
    (evictable) blocks; only the copy to the host runs on the side stream."""
    cache, plain = _filled_cache(), _filled_cache()
    streams = _device_path(cache)
    packed = torch.arange(12, dtype=torch.float32)
    pending = cache._to_host(lambda: streams.log.append(f"pack on {streams.current}")
                             or packed)
    assert streams.log == ["pack on compute", "e1 on compute", "enter side",
                           "side waits e1", "e2 on side", "leave side"]
    assert not pending.ready() and pending._keep is packed  # held while the copy reads it
    assert bytes(pending.wait()) == packed.numpy().tobytes()
    assert streams.log[-1] == "sync e2" and pending._keep is None

    streams.log.clear()
    started = cache.export_blocks_async([5, 0, 3])
    assert "sync" not in " ".join(streams.log)  # the engine thread did not wait
    whole = started.wait()
    want = b"".join(bytes(plain.export_block_bytes(b)) for b in (5, 0, 3))
    assert bytes(whole) == want and whole.nbytes == 3 * plain.block_nbytes


def test_pool_import_copies_on_the_side_and_compute_waits_on_the_event():
    cache, plain = _filled_cache(), _filled_cache()
    src = _filled_cache()
    src.k.mul_(-3)
    data = [bytes(src.export_block_bytes(b)) for b in (1, 4)]
    streams = _device_path(cache)
    cache.import_blocks_bytes([2, 5], data)
    assert streams.log == ["e1 on compute", "enter side", "side waits e1", "e2 on side",
                           "leave side", "compute waits e2"]  # no host sync anywhere
    assert bytes(cache.export_block_bytes(2)) == data[0]
    assert bytes(cache.export_block_bytes(5)) == data[1]
    plain.import_blocks_bytes([2, 5], data)
    assert torch.equal(cache.k, plain.k) and torch.equal(cache.v, plain.v)
    # The staging buffer stays out of the pool until the copy's event has happened.
    size = 2 * plain.block_nbytes
    assert size not in cache._host._idle or not cache._host._idle[size]
    cache._host.take(1)  # reaps: e2 not done yet
    assert len(cache._host._in_use) == 1
    staged, done = cache._host._in_use[0]
    done.synchronize()
    assert cache._host.take(size).data_ptr() == staged.data_ptr()  # back once done


def test_pool_import_checks_every_block_before_writing_any():
    cache = _filled_cache()
    streams = _device_path(cache)
    before = cache.k.clone()
    good = bytes(cache.export_block_bytes(0))
    streams.log.clear()
    for ids, data in (([1, 2], [good, good[:-4]]), ([1, 9], [good, good]), ([1], [])):
        try:
            cache.import_blocks_bytes(ids, data)
        except ValueError:
            pass
        else:
            raise AssertionError(f"{ids} accepted")
    assert torch.equal(cache.k, before) and streams.log == []


def test_cpu_pool_blocks_are_slices_of_one_gather():
    """On the CPU nothing is staged: a batch of blocks is one gather, each block's bytes a
    slice of it, ready at once."""
    from services.engine.kv_store import import_blocks, start_block_export

    cache, other = _filled_cache(), KVCache(2, 6, 4, 2, 8, torch.float32)
    started = start_block_export(cache, [4, 1, 1])
    assert started.ready() and cache._host is None
    views = started.wait()
    assert len({id(v.obj) for v in views}) == 1  # one buffer under all three
    assert [bytes(v) for v in views] == [bytes(cache.export_block_bytes(b)) for b in (4, 1, 1)]
    import_blocks(other, [0, 3], views[:2])
    assert torch.equal(other.k[:, 0], cache.k[:, 4]) and torch.equal(other.v[:, 3], cache.v[:, 1])
