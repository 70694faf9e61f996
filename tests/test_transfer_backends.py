"""Every data-plane backend behind the one interface (tcp, shm, and ucx where ucxx
imports): KV round trips into a paged cache, big and concurrent transfers, integrity,
dead peers, no leaked shared memory; and how peers negotiate a backend."""

from __future__ import annotations

import array
import asyncio
import os
import random
import resource
import secrets
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import structlog
import xxhash

from common.address import dial_target
from common.records import KVAdvert
from common.transfer import (
    BackendUnavailable,
    MultiReceiver,
    MultiSender,
    TransferError,
    TransferState,
    available_backends,
    choose,
    make_advert,
    make_receiver,
    make_sender,
    shm_sender,
    table,
    ucx,
    wire,
)
from common.transfer.shm_sender import ShmSender
from common.transfer.ucx import load_ucxx
from tests.ucx_probe import UCX_MISSING

# Every transfer is expected with a token and every message presents it; one drawn per run
# serves these tests (tests/test_transfer_tokens.py checks that the wrong one is refused).
TOKEN = secrets.token_bytes(16)

ROOT = Path(__file__).resolve().parents[1]
BLOCK_VALUES = 16 * 3 * 64  # tokens x KV heads x head dim: one block's K (or V), one layer


def shm_entries() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("pdkv-")}


@pytest.fixture(autouse=True)
def no_leaked_segments():
    before = shm_entries()
    yield
    assert shm_entries() - before == set(), "shared-memory segments leaked"


@pytest.fixture(params=["tcp", "shm", "ucx"])
def kind(request) -> str:
    if request.param == "ucx" and UCX_MISSING:
        pytest.skip(UCX_MISSING)
    return request.param


@pytest.fixture
async def serve():
    """``await serve(kind, sink)``: a started receiver, closed after the test."""
    receivers = []

    async def start(kind: str, sink):
        rx = make_receiver(kind, sink=sink)
        await rx.start()
        receivers.append(rx)
        return rx

    yield start
    for rx in receivers:
        await rx.close()


@pytest.fixture
async def sender(kind):
    tx = make_sender(kind)
    yield tx
    await tx.close()


class PagedCache:
    """The decode worker's sink: a chunk is ``[K|V][block in block_ids][block bytes]``
    and each block lands in its place in that layer's K and V caches."""

    def __init__(self, layers: int, blocks: int, block_bytes: int) -> None:
        self.size = block_bytes
        self.k = [bytearray(blocks * block_bytes) for _ in range(layers)]
        self.v = [bytearray(blocks * block_bytes) for _ in range(layers)]
        self.calls: list[tuple[int, list[int]]] = []

    def __call__(self, request_id, layer, block_ids, payload) -> None:
        self.calls.append((layer, block_ids))
        size, n = self.size, len(block_ids)
        if payload.nbytes != 2 * n * size:
            raise ValueError(f"{payload.nbytes} bytes for {n} blocks")
        for j, b in enumerate(block_ids):
            self.k[layer][b * size : (b + 1) * size] = payload[j * size : (j + 1) * size]
            self.v[layer][b * size : (b + 1) * size] = payload[(n + j) * size : (n + j + 1) * size]

    def block(self, layer: int, b: int) -> bytes:
        where = slice(b * self.size, (b + 1) * self.size)
        return bytes(self.k[layer][where]) + bytes(self.v[layer][where])


def encode(values: list[float], dtype: str) -> bytes:
    if dtype == "fp32":
        return array.array("f", values).tobytes()
    if dtype == "fp16":
        return struct.pack(f"<{len(values)}e", *values)
    words = array.array("I", array.array("f", values).tobytes())  # bf16: fp32's top half
    return array.array("H", (w >> 16 for w in words)).tobytes()


def decode(raw: bytes, dtype: str) -> list[float]:
    if dtype == "fp32":
        return array.array("f", raw).tolist()
    if dtype == "fp16":
        return list(struct.unpack(f"<{len(raw) // 2}e", raw))
    return array.array("f", array.array("I", (h << 16 for h in array.array("H", raw)))).tolist()


@pytest.mark.parametrize("dtype,itemsize,seed", [("fp32", 4, 1), ("bf16", 2, 2), ("fp16", 2, 3)])
async def test_kv_round_trip_into_non_contiguous_blocks(kind, serve, sender, dtype, itemsize, seed):
    cache = PagedCache(layers=3, blocks=40, block_bytes=BLOCK_VALUES * itemsize)
    rx, rng = await serve(kind, cache), random.Random(seed)
    runs = [[17, 3, 29], [8], [39, 0]]  # out of order, with gaps
    sent: dict[tuple[int, int], list[float]] = {}
    transfer = rx.expect("kv", lease_s=10, token=TOKEN)
    for layer in range(3):
        for run in runs:
            k, v = ([[rng.uniform(-8, 8) for _ in range(BLOCK_VALUES)] for _ in run] for _ in "kv")
            sent.update({(layer, b): k[j] + v[j] for j, b in enumerate(run)})
            flat = [x for values in k + v for x in values]
            await sender.send(rx.address, "kv", layer, run, encode(flat, dtype), token=TOKEN)
    await sender.finish(rx.address, "kv", 9, token=TOKEN)
    await transfer.wait()
    assert transfer.bytes_received == 18 * 2 * BLOCK_VALUES * itemsize
    assert cache.calls == [(layer, run) for layer in range(3) for run in runs]
    for (layer, b), values in sent.items():
        assert cache.block(layer, b) == encode(values, dtype)  # byte-exact, in its place
        assert decode(cache.block(layer, b), dtype) == decode(encode(values, dtype), dtype)
    untouched = set(range(40)) - {b for run in runs for b in run}
    assert all(cache.block(1, b) == bytes(2 * cache.size) for b in untouched)


async def test_256_mib_in_32_layers_of_8_mib(kind, serve, sender):
    got = []
    rx = await serve(kind, lambda r, layer, b, p: got.append((layer, b, xxhash.xxh3_64_digest(p))))
    data, expected = bytearray(random.Random(7).randbytes(8 << 20)), []
    transfer = rx.expect("big", lease_s=60, token=TOKEN)
    for layer in range(32):
        data[:8] = layer.to_bytes(8, "little")  # each layer's bytes differ
        blocks = list(range(layer * 3, 400, 37))
        expected.append((layer, blocks, xxhash.xxh3_64_digest(data)))
        # A buffer of its own: a payload must stay unchanged until finish (base.py).
        await sender.send(rx.address, "big", layer, blocks, bytes(data), token=TOKEN)
    await sender.finish(rx.address, "big", 32, token=TOKEN)
    await transfer.wait()
    assert transfer.bytes_received == 256 << 20 and got == expected


async def test_four_senders_into_one_receiver_at_once(kind, serve):
    chunks = []
    rx = await serve(kind, lambda r, layer, b, p: chunks.append((r, layer, b, bytes(p))))
    senders, rng = [make_sender(kind) for _ in range(4)], random.Random(3)
    plans = {f"s{i}-{r}": [(layer, [9, 2 + i], rng.randbytes(rng.choice((3, 70000, 1 << 20))))
                           for layer in range(4)] for i in range(4) for r in range(2)}
    transfers = [rx.expect(rid, lease_s=20, token=TOKEN) for rid in plans]

    async def run(i: int) -> None:
        for rid in (f"s{i}-0", f"s{i}-1"):
            for layer, blocks, data in plans[rid]:
                await senders[i].send(rx.address, rid, layer, blocks, data, token=TOKEN)
            await senders[i].finish(rx.address, rid, len(plans[rid]), token=TOKEN)

    try:
        await asyncio.gather(*(run(i) for i in range(4)))
        await asyncio.gather(*(t.wait() for t in transfers))
    finally:
        for s in senders:
            await s.close()
    for rid, plan in plans.items():
        assert [c[1:] for c in chunks if c[0] == rid] == plan


async def test_bit_flipped_once_is_sent_again_and_arrives_exact(kind, serve, sender, monkeypatch):
    chunks = []
    rx = await serve(kind, lambda r, layer, b, p: chunks.append((r, layer, bytes(p))))
    data, other = (random.Random(seed).randbytes(50000) for seed in (4, 5))
    flaky = rx.expect("flaky", lease_s=10, token=TOKEN)
    good = rx.expect("good", lease_s=10, token=TOKEN)
    real_checksum, seen = table.checksum, []

    def checksum(payload) -> int:  # what the receiver computes over the bytes it got
        seen.append(bytes(payload) == data)
        flipped = bytearray(payload)
        flipped[31337] ^= 0x04  # the first arrival of `data` had a bit flipped in flight
        return real_checksum(flipped if len(seen) == 1 else payload)

    monkeypatch.setattr(table, "checksum", checksum)
    await sender.send(rx.address, "flaky", 0, [5], data, token=TOKEN)
    await sender.send(rx.address, "good", 0, [6], other, token=TOKEN)  # another transfer meanwhile
    await sender.finish(rx.address, "flaky", 1, token=TOKEN)  # waits for the resent chunk's verdict
    await sender.finish(rx.address, "good", 1, token=TOKEN)
    await asyncio.gather(flaky.wait(), good.wait())
    assert seen == [True, False, True]  # `data`, `other`, `data` again
    assert (sender.resent, rx.retried) == (1, 1)
    assert sorted(chunks) == [("flaky", 0, data), ("good", 0, other)]  # byte-exact, once
    assert flaky.chunks_received == 1 and flaky.bytes_received == len(data)


async def test_bit_flipped_on_both_attempts_fails_only_that_transfer(
    kind, serve, sender, monkeypatch
):
    chunks = []
    rx = await serve(kind, lambda r, layer, b, p: chunks.append((r, bytes(p))))
    data = random.Random(4).randbytes(50000)
    corrupted = bytearray(data)
    corrupted[31337] ^= 0x04
    bad = rx.expect("bad", lease_s=10, token=TOKEN)
    good = rx.expect("good", lease_s=10, token=TOKEN)
    real_checksum, real_stage = wire.checksum, shm_sender.stage

    def stage(destination, source) -> int:  # shm hashes as it copies
        real_stage(destination, source)
        return real_checksum(data)

    # Each sender checks `data`, but `corrupted` is what travels, both times.
    monkeypatch.setattr(wire, "checksum", lambda payload: real_checksum(data))
    monkeypatch.setattr(shm_sender, "stage", stage)
    await sender.send(rx.address, "bad", 0, [5], corrupted, token=TOKEN)
    with pytest.raises(TransferError, match=r"checksum mismatch on layer 0 blocks \[5\]") as info:
        # The sender hears it, sends no FINISH.
        await sender.finish(rx.address, "bad", 1, token=TOKEN)
    assert info.value.request_id == "bad" and info.value.reason.endswith("(attempt 2 of 2)")
    monkeypatch.undo()
    await sender.send(rx.address, "good", 0, [6], data, token=TOKEN)
    await sender.finish(rx.address, "good", 1, token=TOKEN)
    await good.wait()
    with pytest.raises(TransferError, match=r"checksum mismatch on layer 0 blocks \[5\]"):
        await bad.wait()
    assert bad.state is TransferState.FAILED and bad.chunks_received == 0
    assert chunks == [("good", data)] and rx.live() == 0
    assert (sender.resent, rx.retried, sender.connections) == (1, 1, 1)  # same connection


SENDER_PROCESS = """
import asyncio, os, sys
from common.transfer import make_sender

async def main(kind, address, token):
    sender, token = make_sender(kind), bytes.fromhex(token)
    small, big = os.urandom(1 << 16), os.urandom(64 << 20)
    for layer in range(3):
        await sender.send(address, "victim", layer, [2 * layer + 1], small, token=token)
    # More than a stalled receiver takes.
    await sender.send(address, "victim", 3, [9], big, token=token)
    await asyncio.sleep(60)

asyncio.run(main(*sys.argv[1:]))
"""


async def test_sender_killed_mid_transfer_fails_it_at_once_and_leaks_nothing(kind, serve, sender):
    child, killed_at, before = [], [], shm_entries()

    def sink(rid, layer, blocks, payload) -> None:
        if rid == "victim" and layer == 2:
            time.sleep(0.5)  # the receiver stalls; the sender blocks in its next send or after
            child[0].kill()
            child[0].wait()
            killed_at.append(time.monotonic())

    rx = await serve(kind, sink)
    transfer = rx.expect("victim", lease_s=30, token=TOKEN)
    child.append(subprocess.Popen([sys.executable, "-c", SENDER_PROCESS, kind, rx.address,
                                   TOKEN.hex()],
                                  cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}))
    try:
        with pytest.raises(TransferError, match="connection lost"):
            await asyncio.wait_for(transfer.wait(), 20)  # the lease is 30 s
    finally:
        child[0].kill()
        child[0].wait()
    assert time.monotonic() - killed_at[0] < 5.0  # well before the 30 s lease
    assert transfer.state is TransferState.FAILED and rx.live() == 0
    assert shm_entries() <= before  # already, not only once the receiver closes
    after = rx.expect("after", lease_s=10, token=TOKEN)  # and the receiver keeps serving
    await sender.send(rx.address, "after", 0, [1], b"still here", token=TOKEN)
    await sender.finish(rx.address, "after", 1, token=TOKEN)
    await after.wait()


async def test_receiver_gone_makes_send_raise_and_frees_the_sender(kind, serve, sender):
    rx = await serve(kind, lambda *a: None)
    await sender.send(rx.address, "nobody", 0, [0], bytes(1 << 20), token=TOKEN)
    await rx.close()
    deadline = time.monotonic() + 8  # ucxx takes its 5 s connect timeout on a closed port
    with pytest.raises(TransferError):
        while time.monotonic() < deadline:  # until the sender has seen the hang-up
            await sender.send(rx.address, "nobody", 0, [0], bytes(1 << 20), token=TOKEN)
            await asyncio.sleep(0.01)
    assert sender.connections == 0


async def test_shm_ring_reuses_its_slots_within_the_in_flight_budget(serve):
    rx = await serve("shm", lambda *a: None)
    tx = ShmSender(slots=16, max_in_flight_bytes=2 << 20, min_segment_bytes=1 << 20)
    try:
        transfer = rx.expect("r", lease_s=10, token=TOKEN)
        sends = (tx.send(rx.address, "r", i, [i], bytes(1 << 20), token=TOKEN) for i in range(12))
        await asyncio.gather(*sends)  # all at once: the budget lets two through at a time
        # Over budget: goes alone.
        await tx.send(rx.address, "r", 12, [12], bytes(3 << 20), token=TOKEN)
        await tx.finish(rx.address, "r", 13, token=TOKEN)
        await transfer.wait()
        assert tx.segments_created == 3  # two slots in use, one of them grown once
    finally:
        await tx.close()


async def test_shm_small_chunks_share_a_segment(serve):
    got = []
    rx = await serve("shm", lambda r, layer, b, p: got.append(bytes(p)))
    tx = ShmSender()  # 4 MiB segments: 40 chunks of 48 KiB fit in one
    chunks = [random.Random(i).randbytes(48 << 10) for i in range(40)]
    try:
        transfer = rx.expect("r", lease_s=10, token=TOKEN)
        for layer, chunk in enumerate(chunks):
            await tx.send(rx.address, "r", layer, [layer], chunk, token=TOKEN)
        await tx.finish(rx.address, "r", len(chunks), token=TOKEN)
        await transfer.wait()
        assert got == chunks and tx.segments_created == 1
    finally:
        await tx.close()


def test_ucx_run_holds_small_payloads_and_ends_with_a_large_one():
    small, large = b"s" * 100, 5 << 20  # the large one's payload follows on its own
    messages = [
        wire.encode(wire.Chunk("r", 0, [1], wire.checksum(small)), len(small)) + small,
        wire.encode(wire.Chunk("r", 1, [2], 7), large),
    ]
    run = ucx.BATCH_LENGTH.pack(sum(map(len, messages))) + b"".join(messages)
    buffer = bytearray(run + bytes(64))
    parsed = ucx.split_run(buffer)
    assert [(kind, size) for kind, _, size, _ in parsed] == [
        (wire.Kind.CHUNK, 100),
        (wire.Kind.CHUNK, large),
    ]
    assert bytes(parsed[0][3]) == small and parsed[1][3] is None
    assert wire.decode_header(wire.Kind.CHUNK, parsed[1][1]) == wire.Chunk("r", 1, [2], 7)
    after = messages[1] + messages[0]  # nothing may follow a payload that comes on its own
    with pytest.raises(wire.WireError, match="after one whose payload follows"):
        ucx.split_run(bytearray(ucx.BATCH_LENGTH.pack(len(after)) + after))
    short = messages[0][:-3]
    with pytest.raises(wire.WireError, match="ends inside a message"):
        ucx.split_run(bytearray(ucx.BATCH_LENGTH.pack(len(short)) + short))
    with pytest.raises(wire.WireError, match="a run of"):
        ucx.split_run(bytearray(ucx.BATCH_LENGTH.pack(1 << 30) + messages[0]))


@pytest.mark.skipif(UCX_MISSING is not None, reason=str(UCX_MISSING))
async def test_ucx_run_applies_the_messages_before_a_malformed_one(serve):
    got = []
    rx = await serve("ucx", lambda r, layer, b, p: got.append((r, bytes(p))))
    done = rx.expect("done", lease_s=30, token=TOKEN)
    left = rx.expect("left", lease_s=30, token=TOKEN)
    data = b"x" * 1000
    bad = b"\x81\xa1z\x01"  # a CHUNK header without its fields
    run = b"".join([
        wire.encode(wire.Chunk("left", 0, [1], wire.checksum(data), token=TOKEN), len(data)) + data,
        wire.encode(wire.Chunk("done", 0, [2], wire.checksum(data), token=TOKEN), len(data)) + data,
        wire.encode(wire.Finish("done", 1, token=TOKEN)),
        wire.PREFIX.pack(wire.MAGIC, wire.VERSION, wire.Kind.CHUNK, 0, len(bad), 0) + bad,
    ])
    ucxx = load_ucxx()
    ep = await ucxx.create_endpoint(*dial_target(rx.address, "ucx"))
    try:
        await ep.send(ucx.BATCH_LENGTH.pack(len(run)) + run)
        await done.wait()
        with pytest.raises(TransferError, match="sender protocol error: CHUNK header"):
            await asyncio.wait_for(left.wait(), 10)  # at once, not at the end of its lease
    finally:
        ep.abort()
    assert got == [("left", data), ("done", data)] and rx.live() == 0


def test_works_under_uvloop(kind):
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> list[bytes]:
        got = []
        rx, tx = make_receiver(kind, sink=lambda r, layer, b, p: got.append(bytes(p))), None
        try:
            await rx.start()
            tx = make_sender(kind)
            transfer = rx.expect("u", lease_s=10, token=TOKEN)
            await tx.send(rx.address, "u", 0, [3, 1], b"uv" * 70000, token=TOKEN)
            await tx.finish(rx.address, "u", 1, token=TOKEN)
            await transfer.wait()
        finally:
            await rx.close()
            if tx is not None:
                await tx.close()
        return got

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(scenario()) == [b"uv" * 70000]


# -- negotiation -------------------------------------------------------------------------

PEER = make_advert("host-a", {"shm": "shm://127.0.0.1:7001", "ucx": "ucx://10.1.0.5:7002",
                              "tcp": "tcp://10.1.0.5:7003"})
TCP_ONLY, SHM_ONLY = (make_advert("host-a", {k: f"{k}://h:1"}) for k in ("tcp", "shm"))
ALL = ("shm", "ucx", "tcp")


@pytest.mark.parametrize("local_host,local,advert,forced,expected", [
    ("host-a", ALL, PEER, None, ("shm", "shm://127.0.0.1:7001")),
    ("host-b", ALL, PEER, None, ("ucx", "ucx://10.1.0.5:7002")),
    ("host-a", ("ucx", "tcp"), PEER, None, ("ucx", "ucx://10.1.0.5:7002")),
    ("host-b", ("shm", "tcp"), PEER, None, ("tcp", "tcp://10.1.0.5:7003")),
    ("host-a", ALL, TCP_ONLY, None, ("tcp", "tcp://h:1")),
    ("host-a", ALL, PEER, "tcp", ("tcp", "tcp://10.1.0.5:7003")),
    ("host-b", ALL, PEER, "ucx", ("ucx", "ucx://10.1.0.5:7002")),
])
def test_choose_picks_shm_then_ucx_then_tcp(local_host, local, advert, forced, expected):
    with structlog.testing.capture_logs() as logs:
        assert tuple(choose(local_host, local, advert, forced)) == expected
    [event] = [e for e in logs if e["event"] == "kv_transfer.backend_chosen"]
    assert (event["kind"], event["address"], event["forced"]) == (*expected, forced)


@pytest.mark.parametrize("local_host,local,advert,forced,error", [
    ("host-a", ALL, TCP_ONLY, "ucx", r"'ucx' is forced but the peer on 'host-a' offers only"),
    ("host-b", ALL, PEER, "shm", "'shm' is forced but the peer is on host 'host-a', not 'host-b'"),
    ("host-a", ("tcp",), PEER, "ucx", "'ucx' is forced but is not available here"),
    ("host-b", ("shm",), SHM_ONLY, None, "no transfer backend in common with 'host-a'"),
])
def test_choose_refuses_what_cannot_work(local_host, local, advert, forced, error):
    with pytest.raises(TransferError, match=error):
        choose(local_host, local, advert, forced)


def test_adverts_are_checked():
    with pytest.raises(ValueError, match="not a ucx address"):
        make_advert("h", {"ucx": "tcp://h:1"})
    with pytest.raises(ValueError, match="host_id"):
        choose("h", ALL, KVAdvert(host_id="", endpoints={"tcp": "tcp://h:1"}))
    with pytest.raises(ValueError, match="unknown transfer backend"):
        choose("h", ALL, PEER, forced="rdma")
    with pytest.raises(ValueError, match="KVAdvert"):  # the record, not a map of it
        choose("h", ALL, {"host_id": "h", "endpoints": {"tcp": "tcp://h:1"}})
    assert type(PEER) is KVAdvert and PEER.host_id == "host-a"  # make_advert makes the record


async def test_multi_receiver_serves_every_backend_into_one_table():
    got = []
    rx = MultiReceiver(host_id="here", sink=lambda r, layer, b, p: got.append((layer, bytes(p))))
    await rx.start()
    near, far = MultiSender(host_id="here"), MultiSender(host_id="away", backends=("ucx", "tcp"))
    try:
        advert = rx.advert()
        assert set(advert.endpoints) == {"shm", "tcp"} | (set() if UCX_MISSING else {"ucx"})
        here, there = near.address_for(advert), far.address_for(advert)
        assert here.startswith("shm://") and there.startswith("tcp://" if UCX_MISSING else "ucx://")
        # One transfer, chunks over two backends.
        transfer = rx.expect("mixed", lease_s=10, token=TOKEN)
        await near.send(here, "mixed", 0, [4], b"over shared memory", token=TOKEN)
        for _ in range(500):  # no order across backends: let the first land before the rest
            if transfer.chunks_received:
                break
            await asyncio.sleep(0.002)
        await far.send(there, "mixed", 1, [5], b"over the network", token=TOKEN)
        await far.finish(there, "mixed", 2, token=TOKEN)
        await transfer.wait()
        assert got == [(0, b"over shared memory"), (1, b"over the network")]
    finally:
        for peer in (near, far, rx):
            await peer.close()


def test_ucx_without_ucxx_names_the_missing_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "ucxx", None)  # as if not installed
    for build in (lambda: make_receiver("ucx", sink=print), lambda: make_sender("ucx")):
        with pytest.raises(BackendUnavailable, match="ucxx-cu12") as info:
            build()
        assert isinstance(info.value, ImportError) and isinstance(info.value, TransferError)
        assert info.value.name == "ucxx-cu12"
    assert "ucx" not in available_backends() and "tcp" in available_backends()


def test_new_backends_import_without_torch_or_numpy():
    modules = ["shm", "shm_sender", "shm_receiver", "ucx", "ucx_sender", "ucx_receiver",
               "multi", "negotiate", "factory", "backends"]
    code = "import sys;" + "".join(f"import common.transfer.{m};" for m in modules)
    code += "bad = {'torch', 'numpy'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30, cwd=ROOT)


@pytest.mark.skipif(UCX_MISSING is not None, reason=str(UCX_MISSING))
async def test_idle_ucx_connection_does_not_keep_a_core_busy(serve):
    # Connected both ways (a run receive posted on the receiver, a verdict receive on
    # the sender), then idle: ucxx's own wait would poll them without a pause.
    got = []
    rx = await serve("ucx", lambda r, layer, b, p: got.append(bytes(p)))
    tx = make_sender("ucx")
    try:
        transfer = rx.expect("r", lease_s=30, token=TOKEN)
        await tx.send(rx.address, "r", 0, [1], b"v" * 4096, token=TOKEN)
        await tx.finish(rx.address, "r", 1, token=TOKEN)
        await transfer.wait()
        await asyncio.sleep(0.2)
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        await asyncio.sleep(3)
        after, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - start
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        assert cpu / wall < 0.2, f"idle ucx pair used {cpu / wall:.0%} of a core"
        # Still connected and quick to answer after the pause.
        again = rx.expect("again", lease_s=30, token=TOKEN)
        await tx.send(rx.address, "again", 0, [2], b"w" * 4096, token=TOKEN)
        await tx.finish(rx.address, "again", 1, token=TOKEN)
        await again.wait()
        assert got == [b"v" * 4096, b"w" * 4096] and tx.connections == 1
    finally:
        await tx.close()
