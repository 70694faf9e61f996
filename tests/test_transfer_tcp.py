"""The tcp data plane on loopback: exact delivery, integrity, leases, cancellation, and
the failures a real network produces (dead senders, garbage, closed ports)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import xxhash

from common.transfer import TransferError, TransferState, make_receiver, make_sender, wire
from common.transfer.tcp_receiver import TcpReceiver
from common.transfer.tcp_sender import TcpSender
from tests.kv_sink import Sink

# Every transfer is expected with a token and every message presents it; one drawn per run
# serves these tests (tests/test_transfer_tokens.py checks that the wrong one is refused).
TOKEN = secrets.token_bytes(16)



@pytest.fixture
def sink() -> Sink:
    return Sink()


@pytest.fixture
async def receiver(sink):
    rx = make_receiver("tcp", sink=sink)
    await rx.start()
    yield rx
    assert rx.live() == 0, "a test left a transfer live"
    await rx.close()


@pytest.fixture
async def sender():
    tx = make_sender("tcp")
    yield tx
    await tx.close()


async def until(predicate, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


def chunks_for(request_id: str, seed: int, sizes=(1000, 4096, 77)):
    """3 layers x two non-contiguous, out-of-order runs of block ids, random bytes."""
    rng = random.Random(seed)
    runs = [[9, 3], [17, 4, 12]]
    return [
        (request_id, layer, list(run), rng.randbytes(sizes[layer % len(sizes)] * len(run)))
        for layer in range(3)
        for run in runs
    ]


async def send_all(sender, address, chunks) -> None:
    for rid, layer, blocks, data in chunks:
        await sender.send(address, rid, layer, blocks, data, token=TOKEN)
    await sender.finish(address, chunks[0][0], len(chunks), token=TOKEN)


async def raw_connection(address: str):
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def test_chunks_arrive_byte_exact_with_layers_and_block_ids(receiver, sender, sink):
    transfer = receiver.expect("r1", lease_s=5, token=TOKEN)
    assert transfer.state is TransferState.PENDING and receiver.live() == 1
    chunks = chunks_for("r1", seed=1)
    await send_all(sender, receiver.address, chunks)
    await transfer.wait()
    assert transfer.state is TransferState.DONE and transfer.error is None
    assert sink.chunks == chunks
    assert transfer.chunks_received == 6
    assert transfer.bytes_received == sum(len(c[3]) for c in chunks)
    assert receiver.live() == 0


async def test_64_mib_payload_round_trip(receiver, sender, sink):
    data = bytearray(random.Random(2).randbytes(64 << 20))
    transfer = receiver.expect("big", lease_s=20, token=TOKEN)
    await sender.send(receiver.address, "big", 5, [0, 1], memoryview(data), token=TOKEN)
    await sender.finish(receiver.address, "big", 1, token=TOKEN)
    await transfer.wait()
    [(_, layer, blocks, got)] = sink.chunks
    assert (layer, blocks, len(got)) == (5, [0, 1], 64 << 20)
    assert xxhash.xxh3_64_intdigest(got) == xxhash.xxh3_64_intdigest(data)
    assert transfer.bytes_received == 64 << 20


async def test_four_senders_into_one_receiver_at_once(receiver, sink):
    senders = [make_sender("tcp") for _ in range(4)]
    plans = [chunks_for(f"s{i}", seed=10 + i, sizes=(65536, 3, 200000)) for i in range(4)]
    transfers = [receiver.expect(f"s{i}", lease_s=10, token=TOKEN) for i in range(4)]
    try:
        await asyncio.gather(
            *(send_all(s, receiver.address, p) for s, p in zip(senders, plans, strict=True))
        )
        await asyncio.gather(*(t.wait() for t in transfers))
    finally:
        for s in senders:
            await s.close()
    for i, plan in enumerate(plans):
        assert sink.of(f"s{i}") == plan


async def test_concurrent_calls_on_one_connection_never_interleave(sink):
    # Tiny socket buffers fill at once, so every message waits in drain() mid-payload:
    # without the per-connection lock, bytes of different messages would mix.
    rx = TcpReceiver(sink=sink, socket_buffer_bytes=16384)
    await rx.start()
    tx = TcpSender(write_slice_bytes=4096, socket_buffer_bytes=16384)
    plans = [chunks_for(f"c{i}", seed=20 + i, sizes=(30000, 50000, 7)) for i in range(6)]
    transfers = [rx.expect(f"c{i}", lease_s=10, token=TOKEN) for i in range(6)]
    try:
        await asyncio.gather(*(send_all(tx, rx.address, p) for p in plans))
        await asyncio.gather(*(t.wait() for t in transfers))
        assert tx.connections == 1 and rx.connections == 1
    finally:
        await tx.close()
        await rx.close()
    for i, plan in enumerate(plans):
        assert sink.of(f"c{i}") == plan


async def mutate_after_send_scenario(sink) -> None:
    """finish() returning means the payloads may be reused: the sender keeps each until
    its verdict (it may have to send it again), and not a moment longer."""
    rx = TcpReceiver(sink=sink, socket_buffer_bytes=16384)
    await rx.start()
    tx = TcpSender(socket_buffer_bytes=16384)
    try:
        transfer = rx.expect("reuse", lease_s=5, token=TOKEN)
        buffer = bytearray(random.Random(13).randbytes(3 << 20))
        original = bytes(buffer)
        await tx.send(rx.address, "reuse", 0, [0], buffer, token=TOKEN)
        await tx.finish(rx.address, "reuse", 1, token=TOKEN)
        buffer[:] = bytes(len(buffer))  # the KV slot is reused at once
        buffer.extend(b"grown")  # would raise BufferError if the sender still held it
        await transfer.wait()
        assert sink.of("reuse") == [("reuse", 0, [0], original)]
    finally:
        await tx.close()
        await rx.close()


async def test_payload_may_be_reused_once_finish_returns(sink):
    await mutate_after_send_scenario(sink)


async def read_verdict(reader: asyncio.StreamReader) -> wire.Verdict:
    kind, header_len, payload_len = wire.decode_prefix(await reader.readexactly(wire.PREFIX.size))
    assert (kind, payload_len) == (wire.Kind.VERDICT, 0)
    return wire.decode_header(kind, await reader.readexactly(header_len))


async def test_corrupted_payload_is_asked_for_again_and_then_arrives_exact(receiver, sink):
    transfer = receiver.expect("flaky", lease_s=5, token=TOKEN)
    data = random.Random(3).randbytes(10000)
    corrupted = bytearray(data)
    corrupted[1234] ^= 0x10  # one bit flipped in flight
    reader, writer = await raw_connection(receiver.address)
    chunk = wire.Chunk("flaky", 0, [1], wire.checksum(data), token=TOKEN)
    writer.write(wire.encode(chunk, len(data)) + corrupted)
    verdict = await read_verdict(reader)
    assert verdict.status is wire.Status.RESEND
    assert verdict.reason.startswith("checksum mismatch on layer 0 blocks [1]")
    assert transfer.state is TransferState.PENDING and sink.chunks == []
    assert receiver.retried == 1
    writer.write(wire.encode(wire.Finish("flaky", 1, token=TOKEN)))  # before the resent chunk
    writer.write(wire.encode(chunk._replace(attempt=1), len(data)) + data)
    await transfer.wait()  # settled once the chunk asked for again is in
    assert await read_verdict(reader) == wire.OK
    assert sink.chunks == [("flaky", 0, [1], data)] and transfer.chunks_received == 1
    writer.close()


async def test_a_large_payload_is_hashed_as_it_comes_in_and_a_late_flipped_bit_is_caught(
        receiver, sink, monkeypatch):
    # Read straight into place, a payload is hashed piece by piece as it lands: the
    # table does not hash it again, and a bit flipped in its last piece still counts.
    from common.transfer import table as table_module

    rehashed: list[int] = []
    real = table_module.checksum
    monkeypatch.setattr(table_module, "checksum", lambda p: rehashed.append(len(p)) or real(p))
    transfer = receiver.expect("big", lease_s=10, token=TOKEN)
    data = random.Random(5).randbytes(3 << 20)
    corrupted = bytearray(data)
    corrupted[-10] ^= 0x01
    reader, writer = await raw_connection(receiver.address)
    chunk = wire.Chunk("big", 0, [1], wire.checksum(data), token=TOKEN)
    for attempt, payload in enumerate((corrupted, data)):
        writer.write(wire.encode(chunk._replace(attempt=attempt), len(data)))
        for start in range(0, len(payload), 700_001):  # pieces that cut the stripes
            writer.write(payload[start : start + 700_001])
            await writer.drain()
            await asyncio.sleep(0.01)
        if attempt == 0:
            verdict = await read_verdict(reader)
            assert verdict.status is wire.Status.RESEND, verdict
            assert verdict.reason.startswith("checksum mismatch on layer 0 blocks [1]")
            writer.write(wire.encode(wire.Finish("big", 1, token=TOKEN)))
    await transfer.wait()
    assert await read_verdict(reader) == wire.OK
    assert sink.chunks == [("big", 0, [1], data)] and receiver.retried == 1
    assert rehashed == []
    writer.close()


async def test_corrupted_twice_fails_with_checksum_and_connection_keeps_serving(receiver, sink):
    bad = receiver.expect("bad", lease_s=5, token=TOKEN)
    good = receiver.expect("good", lease_s=5, token=TOKEN)
    data = random.Random(3).randbytes(10000)
    corrupted = bytearray(data)
    corrupted[1234] ^= 0x10
    reader, writer = await raw_connection(receiver.address)
    chunk = wire.Chunk("bad", 0, [1], wire.checksum(data), token=TOKEN)
    writer.write(wire.encode(chunk, len(data)) + corrupted)
    # Another transfer's chunk between the two attempts, on the same connection.
    head = wire.encode(wire.Chunk("good", 0, [2], wire.checksum(data), token=TOKEN), len(data))
    writer.write(head + data)
    assert (await read_verdict(reader)).status is wire.Status.RESEND  # written at once
    writer.write(wire.encode(wire.Finish("bad", 1, token=TOKEN)))  # waits for the resent chunk
    writer.write(wire.encode(wire.Finish("good", 1, token=TOKEN)))  # flushes good's verdict
    assert await read_verdict(reader) == wire.OK
    await good.wait()
    assert bad.state is TransferState.PENDING
    writer.write(wire.encode(chunk._replace(attempt=1), len(data)) + corrupted)
    verdict = await read_verdict(reader)
    assert verdict.status is wire.Status.FAILED and verdict.reason.endswith("(attempt 2 of 2)")
    with pytest.raises(TransferError, match=r"checksum mismatch on layer 0 blocks \[1\]"):
        await bad.wait()
    assert bad.state is TransferState.FAILED and bad.chunks_received == 0
    assert sink.chunks == [("good", 0, [2], data)] and receiver.retried == 1
    after = receiver.expect("after", lease_s=5, token=TOKEN)
    head = wire.encode(wire.Chunk("after", 1, [3], wire.checksum(data), token=TOKEN), len(data))
    writer.write(head + data)
    writer.write(wire.encode(wire.Finish("after", 1, token=TOKEN)))
    await after.wait()
    assert await read_verdict(reader) == wire.OK
    writer.close()


async def test_verdicts_say_dropped_and_failed(sink):
    rx = TcpReceiver(sink=sink, max_payload_bytes=100)
    await rx.start()
    try:
        reader, writer = await raw_connection(rx.address)
        big = rx.expect("big", lease_s=5, token=TOKEN)
        for rid, size in (("ghost", 10), ("big", 200)):
            writer.write(wire.encode(wire.Chunk(rid, 0, [0], 0, token=TOKEN), size) + bytes(size))
        assert await read_verdict(reader) == wire.DROPPED  # held back, then flushed with:
        verdict = await read_verdict(reader)
        assert verdict == (wire.Status.FAILED, "chunk of 200 bytes exceeds the 100-byte limit")
        with pytest.raises(TransferError, match="exceeds"):
            await big.wait()
        writer.close()
    finally:
        await rx.close()


async def test_finish_with_wrong_count_fails(receiver, sender):
    transfer = receiver.expect("r", lease_s=5, token=TOKEN)
    await sender.send(receiver.address, "r", 0, [1], b"a" * 10, token=TOKEN)
    await sender.send(receiver.address, "r", 1, [1], b"b" * 10, token=TOKEN)
    await sender.finish(receiver.address, "r", 3, token=TOKEN)
    with pytest.raises(TransferError) as info:
        await transfer.wait()
    assert info.value.reason == "expected 3 chunks, got 2"
    assert info.value.request_id == "r" and transfer.state is TransferState.FAILED


async def test_abort_fails_with_the_senders_reason(receiver, sender):
    transfer = receiver.expect("r", lease_s=5, token=TOKEN)
    await sender.abort(receiver.address, "r", "prefill worker out of memory", token=TOKEN)
    with pytest.raises(TransferError, match="prefill worker out of memory"):
        await transfer.wait()
    assert transfer.error == "prefill worker out of memory"


async def test_lease_expiry_fails_the_transfer_on_time(receiver, sender):
    start = time.monotonic()
    transfer = receiver.expect("slow", lease_s=0.3, token=TOKEN)
    with pytest.raises(TransferError, match="lease expired"):
        await transfer.wait()
    assert 0.3 <= time.monotonic() - start < 2.0  # at the lease, not at some later timeout
    assert transfer.state is TransferState.FAILED and receiver.live() == 0
    await sender.send(receiver.address, "slow", 0, [0], b"late", token=TOKEN)
    await until(lambda: receiver.dropped == 1)


async def test_cancel_drops_later_chunks(receiver, sender, sink):
    transfer = receiver.expect("r", lease_s=5, token=TOKEN)
    await sender.send(receiver.address, "r", 0, [1], b"first", token=TOKEN)
    await until(lambda: transfer.chunks_received == 1)
    receiver.cancel("r")
    receiver.cancel("r")  # idempotent
    assert transfer.state is TransferState.CANCELLED and receiver.live() == 0
    await sender.send(receiver.address, "r", 1, [1], b"second", token=TOKEN)
    await sender.finish(receiver.address, "r", 2, token=TOKEN)
    await until(lambda: receiver.dropped == 2)
    with pytest.raises(TransferError, match="cancelled"):
        await transfer.wait()
    assert sink.chunks == [("r", 0, [1], b"first")]


@pytest.mark.parametrize("hang_up", ["close", "abort"])
async def test_sender_killed_mid_payload_fails_at_once_and_receiver_keeps_serving(
    receiver, sender, sink, hang_up
):
    transfer = receiver.expect("dying", lease_s=30, token=TOKEN)
    data = random.Random(4).randbytes(1 << 20)
    _, writer = await raw_connection(receiver.address)
    head = wire.encode(wire.Chunk("dying", 0, [0], wire.checksum(data), token=TOKEN), len(data))
    writer.write(head)
    writer.write(data[: len(data) // 2])
    await writer.drain()
    await asyncio.sleep(0.05)
    if hang_up == "close":  # FIN, as when a process exits
        writer.close()
    else:  # RST
        writer.transport.abort()
    with pytest.raises(TransferError, match="connection lost mid-message"):
        await asyncio.wait_for(transfer.wait(), 1.0)  # the lease is 30 s
    assert receiver.live() == 0
    good = receiver.expect("next", lease_s=5, token=TOKEN)
    chunks = chunks_for("next", seed=5)
    await send_all(sender, receiver.address, chunks)
    await good.wait()
    assert sink.chunks == chunks


async def test_chunks_for_unknown_request_are_dropped(receiver, sender, sink):
    await sender.send(receiver.address, "ghost", 0, [1], b"x" * 100, token=TOKEN)
    await sender.finish(receiver.address, "ghost", 1, token=TOKEN)
    await until(lambda: receiver.dropped == 2)
    transfer = receiver.expect("real", lease_s=5, token=TOKEN)
    chunks = chunks_for("real", seed=6)
    await send_all(sender, receiver.address, chunks)
    await transfer.wait()
    assert sink.chunks == chunks


async def test_sink_error_fails_only_its_transfer():
    sink = Sink(raise_for="doomed")
    rx = make_receiver("tcp", sink=sink)
    await rx.start()
    tx = make_sender("tcp")
    try:
        doomed = rx.expect("doomed", lease_s=5, token=TOKEN)
        fine = rx.expect("fine", lease_s=5, token=TOKEN)
        with pytest.raises(TransferError, match="sink raised RuntimeError") as info:
            await send_all(tx, rx.address, chunks_for("doomed", seed=7))  # the sender hears
        assert info.value.request_id == "doomed"
        await send_all(tx, rx.address, chunks_for("fine", seed=8))
        await fine.wait()
        with pytest.raises(TransferError, match="sink raised RuntimeError"):
            await doomed.wait()
        assert rx.live() == 0 and tx.connections == 1
    finally:
        await tx.close()
        await rx.close()


async def test_oversized_chunk_fails_its_transfer_and_is_skipped(sender):
    sink = Sink()
    rx = TcpReceiver(sink=sink, max_payload_bytes=1024)
    await rx.start()
    try:
        big = rx.expect("big", lease_s=5, token=TOKEN)
        small = rx.expect("small", lease_s=5, token=TOKEN)
        await sender.send(rx.address, "big", 0, [0], bytes(4096), token=TOKEN)
        await sender.send(rx.address, "small", 0, [0], bytes(1024), token=TOKEN)
        with pytest.raises(TransferError, match="exceeds the 1024-byte limit"):
            await sender.finish(rx.address, "big", 1, token=TOKEN)  # the verdict said so
        await sender.finish(rx.address, "small", 1, token=TOKEN)
        await small.wait()
        with pytest.raises(TransferError, match="exceeds the 1024-byte limit"):
            await big.wait()
    finally:
        await rx.close()


async def test_garbage_closes_only_that_connection(receiver, sender, sink):
    reader, writer = await raw_connection(receiver.address)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    with contextlib.suppress(ConnectionResetError):  # hung up with our bytes unread: RST
        assert await asyncio.wait_for(reader.read(), 1.0) == b""
    writer.close()
    transfer = receiver.expect("after", lease_s=5, token=TOKEN)
    await send_all(sender, receiver.address, chunks_for("after", seed=9))
    await transfer.wait()


async def test_receiver_close_cancels_live_transfers(sink):
    rx = make_receiver("tcp", sink=sink)
    await rx.start()
    transfer = rx.expect("r", lease_s=5, token=TOKEN)
    await rx.close()
    with pytest.raises(TransferError, match="receiver closed"):
        await transfer.wait()
    assert transfer.state is TransferState.CANCELLED and rx.live() == 0
    with pytest.raises(RuntimeError):
        rx.expect("again", lease_s=5, token=TOKEN)


async def test_broken_pooled_connection_is_replaced(sender, sink):
    first = make_receiver("tcp", sink=sink)
    await first.start()
    await sender.send(first.address, "nobody", 0, [0], b"warm up the pool", token=TOKEN)
    assert sender.connections == 1
    port = int(first.address.rsplit(":", 1)[1])
    await first.close()
    await until(lambda: sender.connections == 0)  # the sender saw the receiver hang up
    second = make_receiver("tcp", port=port, sink=sink)
    await second.start()
    try:
        transfer = second.expect("r", lease_s=5, token=TOKEN)
        await send_all(sender, second.address, chunks_for("r", seed=11))
        await transfer.wait()
        assert sender.connections == 1
    finally:
        await second.close()


async def test_sending_to_a_closed_port_raises_transfer_error(sender):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(TransferError, match="cannot connect"):
        await sender.send(f"tcp://127.0.0.1:{port}", "r", 0, [0], b"x", token=TOKEN)
    assert sender.connections == 0


async def test_bad_arguments_raise_value_error(receiver, sender):
    address = receiver.address
    with pytest.raises(ValueError, match="layer"):
        await sender.send(address, "r", -1, [0], b"x", token=TOKEN)
    with pytest.raises(ValueError, match="block_ids"):
        await sender.send(address, "r", 0, [0, "1"], b"x", token=TOKEN)
    with pytest.raises(ValueError, match="request_id"):
        await sender.finish(address, "", 1, token=TOKEN)
    with pytest.raises(ValueError, match="tcp address"):
        await sender.send("http://127.0.0.1:80", "r", 0, [0], b"x", token=TOKEN)
    with pytest.raises(ValueError, match="lease_s"):
        receiver.expect("r", lease_s=0, token=TOKEN)
    receiver.expect("r", lease_s=5, token=TOKEN)
    with pytest.raises(ValueError, match="already expected"):
        receiver.expect("r", lease_s=5, token=TOKEN)
    receiver.cancel("r")
    with pytest.raises(ValueError, match="unknown transfer backend"):
        make_sender("carrier-pigeon")


def test_wire_round_trip_and_rejections():
    chunk = wire.Chunk("r", 3, [7, 2], 2**64 - 1)
    frame = wire.encode(chunk, 99)
    kind, header_len, payload_len = wire.decode_prefix(frame[: wire.PREFIX.size])
    assert (kind, payload_len) == (wire.Kind.CHUNK, 99)
    assert wire.decode_header(kind, frame[wire.PREFIX.size :]) == chunk
    assert len(frame) == wire.PREFIX.size + header_len
    with pytest.raises(wire.WireError, match="magic"):
        wire.decode_prefix(b"XXXX" + frame[4 : wire.PREFIX.size])
    finish = wire.encode(wire.Finish("r", 1))
    assert wire.decode_header(wire.Kind.FINISH, finish[wire.PREFIX.size :]) == wire.Finish("r", 1)
    with pytest.raises(wire.WireError, match="lengths say"):  # a msgpack map is no CHUNK
        wire.decode_header(wire.Kind.CHUNK, finish[wire.PREFIX.size :])
    # A CHUNK header whose request id can be read names it, so its transfer can fail.
    retried_twice = wire.CHUNK_HEAD.pack(0, 0, wire.MAX_ATTEMPTS, 0, 1, 0, 0, 0, 0) + b"r"
    with pytest.raises(wire.WireError, match="attempt") as info:
        wire.decode_header(wire.Kind.CHUNK, retried_twice)
    assert info.value.request_id == "r"
    huge = wire.Chunk("r", 0, [2**64], 0)
    with pytest.raises(wire.WireError, match="block_ids"):
        wire.encode(huge, 1)


def test_verdicts_round_trip_and_split_before_a_partial_one():
    resend = wire.Verdict(wire.Status.RESEND, "checksum mismatch on layer 3")
    long = wire.Verdict(wire.Status.FAILED, "sink raised " + "x" * 5000)
    frames = [wire.encode_verdict(v) for v in (wire.OK, resend, wire.DROPPED, long)]
    data = b"".join(frames)
    whole = [wire.OK, resend, wire.DROPPED]
    assert wire.split_verdicts(data[:-3]) == (whole, len(data) - len(frames[3]))
    verdicts, parsed = wire.split_verdicts(data)
    assert parsed == len(data) and verdicts[:3] == whole
    assert verdicts[3].status is wire.Status.FAILED and len(verdicts[3].reason) == 1003  # cut
    assert len(frames[3]) <= wire.MAX_VERDICT_BYTES
    assert wire.split_verdicts(frames[1][:30]) == ([], 0)  # not whole yet
    with pytest.raises(wire.WireError, match="only VERDICT"):
        wire.split_verdicts(wire.encode(wire.Finish("r", 1)))
    with pytest.raises(wire.WireError, match="status"):
        wire.encode(wire.Verdict("maybe"))


def test_works_under_uvloop():
    uvloop = pytest.importorskip("uvloop")

    async def scenario():
        sink = Sink()
        rx = make_receiver("tcp", sink=sink)
        await rx.start()
        tx = make_sender("tcp")
        try:
            transfer = rx.expect("u", lease_s=5, token=TOKEN)
            chunks = chunks_for("u", seed=12, sizes=(300000, 1, 5000))
            await send_all(tx, rx.address, chunks)
            await transfer.wait()
            assert sink.chunks == chunks
            dying = rx.expect("dying", lease_s=30, token=TOKEN)
            _, writer = await raw_connection(rx.address)
            writer.write(wire.encode(wire.Chunk("dying", 0, [0], 0, token=TOKEN), 1000) + bytes(10))
            await writer.drain()
            writer.transport.abort()
            with pytest.raises(TransferError, match="mid-message"):
                await asyncio.wait_for(dying.wait(), 1.0)
            await mutate_after_send_scenario(Sink())
        finally:
            await tx.close()
            await rx.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())


def test_data_plane_imports_without_torch_or_numpy():
    code = (
        "import sys, common.transfer, common.transfer.tcp_sender, common.transfer.tcp_receiver;"
        "bad = {'torch', 'numpy'} & set(sys.modules); assert not bad, bad"
    )
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30, cwd=root)


async def test_sender_gone_between_messages_fails_its_transfer_at_once(receiver):
    transfer = receiver.expect("between", lease_s=30, token=TOKEN)
    reader, writer = await raw_connection(receiver.address)
    data = bytes(range(256)) * 4
    head = wire.encode(wire.Chunk("between", 0, [0], wire.checksum(data), token=TOKEN), len(data))
    writer.write(head)
    writer.write(data)  # one whole chunk, then the sender vanishes before finishing
    await writer.drain()
    await until(lambda: transfer.chunks_received == 1)
    start = time.monotonic()
    writer.close()
    with pytest.raises(TransferError, match="sender connection lost"):
        await transfer.wait()
    assert time.monotonic() - start < 5.0  # the lease is 30 s
    assert receiver.live() == 0


class CountingSocket:
    """Stands in for a sender connection's socket to count its system calls."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.sendmsgs, self.buffers = sock, 0, 0

    def sendmsg(self, buffers):
        self.sendmsgs += 1
        self.buffers += len(buffers)
        return self.sock.sendmsg(buffers)


@pytest.mark.parametrize("chunk_bytes", [24576, 49152])  # 0.7 MiB and 1.4 MiB a request
async def test_a_run_of_small_sends_goes_out_in_one_system_call(receiver, sender, sink,
                                                                chunk_bytes):
    # One warm-up transfer opens the connection, then 30 small chunks (a layer each, as
    # a few hundred tokens of KV are) sent without the loop turning in between.
    warm = receiver.expect("warm", lease_s=5, token=TOKEN)
    await send_all(sender, receiver.address, chunks_for("warm", seed=1))
    await warm.wait()
    conn = sender._conns[receiver.address]
    counting = conn.sock = CountingSocket(conn.sock)
    plan = [("r", layer, [layer, 40 + layer], random.Random(layer).randbytes(chunk_bytes))
            for layer in range(30)]
    transfer = receiver.expect("r", lease_s=5, token=TOKEN)
    await send_all(sender, receiver.address, plan)
    await transfer.wait()
    assert sink.of("r") == plan
    # Queued as one BATCH (coalesce.py), corked until the FINISH: its head, 30
    # payloads and the FINISH in one sendmsg.
    assert (counting.sendmsgs, counting.buffers) == (1, 32)


async def test_corked_bytes_go_out_at_the_next_turn_without_a_finish(receiver, sender, sink):
    transfer = receiver.expect("r", lease_s=5, token=TOKEN)
    await sender.send(receiver.address, "r", 0, [1], b"k" * 1000, token=TOKEN)
    await until(lambda: len(sink.of("r")) == 1)  # no finish: the loop's next turn sent it
    await sender.finish(receiver.address, "r", 1, token=TOKEN)
    await transfer.wait()
    assert sink.of("r") == [("r", 0, [1], b"k" * 1000)]


async def test_small_and_large_messages_keep_their_order_on_one_connection(receiver, sink):
    # Small chunks are corked, large ones written in slices: a large one must not
    # overtake the small ones corked before it, nor they it.
    tx = TcpSender(write_slice_bytes=64 << 10)
    sizes = [100, 600 << 10, 200, 300, 2 << 20, 50]
    plan = [("m", i, [i], random.Random(i).randbytes(n)) for i, n in enumerate(sizes)]
    transfer = receiver.expect("m", lease_s=10, token=TOKEN)
    try:
        await send_all(tx, receiver.address, plan)
        await transfer.wait()
    finally:
        await tx.close()
    assert sink.of("m") == plan


async def test_a_large_payload_is_never_copied_whole_into_the_transport(sink):
    # What the kernel does not take at once, the event loop's transport copies (and, on
    # Python 3.11, shifts down after each partial send): a large payload goes straight
    # from its view while the kernel takes it, then a 256 KiB slice at a time through the
    # transport, so at most one slice is ever held there, not the chunk.
    rx = TcpReceiver(sink=sink, socket_buffer_bytes=16384)
    await rx.start()
    tx = TcpSender(socket_buffer_bytes=16384)
    held: list[int] = []
    try:
        first = rx.expect("open", lease_s=10, token=TOKEN)
        await tx.send(rx.address, "open", 0, [0], b"x" * 100, token=TOKEN)
        await tx.finish(rx.address, "open", 1, token=TOKEN)
        await first.wait()
        writer = tx._conns[rx.address].writer
        write = writer.write

        def watched(data) -> None:
            write(data)
            held.append(writer.transport.get_write_buffer_size())

        writer.write = watched
        payload = random.Random(7).randbytes(4 << 20)
        big = rx.expect("big", lease_s=10, token=TOKEN)
        await tx.send(rx.address, "big", 0, [1], payload, token=TOKEN)
        await tx.finish(rx.address, "big", 1, token=TOKEN)
        await big.wait()
    finally:
        await tx.close()
        await rx.close()
    assert sink.of("big") == [("big", 0, [1], payload)]
    assert len(held) > 8 and 0 < max(held) <= 256 << 10, (len(held), max(held))


async def test_send_cancelled_while_waiting_for_its_turn_writes_nothing(sink):
    # Tiny buffers: a 3 MiB chunk leaves bytes in the transport, so the next send (of
    # 1 MiB: smaller ones are queued, coalesce.py) waits its turn; cancelled there it
    # wrote nothing and the stream stays framed.
    rx = TcpReceiver(sink=sink, socket_buffer_bytes=16384)
    await rx.start()
    tx = TcpSender(socket_buffer_bytes=16384, write_slice_bytes=8 << 20)
    try:
        big = rx.expect("big", lease_s=10, token=TOKEN)
        stuck = asyncio.ensure_future(
            tx.send(rx.address, "big", 0, [0], bytes(3 << 20), token=TOKEN))
        await until(lambda: rx.address in tx._conns)
        small = asyncio.ensure_future(
            tx.send(rx.address, "gone", 0, [1], b"s" * (1 << 20), token=TOKEN))
        await asyncio.sleep(0)
        small.cancel()
        await asyncio.gather(stuck, small, return_exceptions=True)
        await tx.finish(rx.address, "big", 1, token=TOKEN)
        await big.wait()
        assert [c[0] for c in sink.chunks] == ["big"] and rx.dropped == 0
    finally:
        await tx.close()
        await rx.close()


async def test_large_payloads_wake_the_receiver_once_a_mib_but_a_first_in_tenths(
        receiver, sink, monkeypatch):
    # SO_RCVLOWAT follows what is left of a large payload: each read brings at least
    # 1 MiB (or the rest) even from a sender that trickles it in 64 KiB pieces; and a
    # large chunk's prefix and header come in one read, not two. A transfer's first
    # large payload (the connection's first, or the first after a FINISH) is read in
    # tenths instead, as it comes. Marks are checked as set, reads only by their size
    # and an upper bound on their count: on a loaded machine reads grow, never shrink.
    from common.transfer import frame_reader
    from common.transfer.tcp import ReadMark

    marks: list[tuple[bool, int, int]] = []  # fresh, bytes left, the mark set for them
    marking = ReadMark.payload

    def recording(self, left):
        fresh = self.fresh
        marking(self, left)
        marks.append((fresh, left, self.nbytes))

    monkeypatch.setattr(ReadMark, "payload", recording)

    reads: dict[tuple[str, int], list[tuple[int, int]]] = {}  # bytes read, left before
    counted = frame_reader.FrameReader.buffer_updated

    def counting(self, nbytes):
        if self._stage.name == "PAYLOAD":
            key = (self._message.request_id, self._message.layer)
            reads.setdefault(key, []).append((nbytes, len(self._view) - self._filled))
        counted(self, nbytes)

    monkeypatch.setattr(frame_reader.FrameReader, "buffer_updated", counting)
    size = 2 << 20
    plans = {rid: [(rid, i, [i], random.Random(f"{rid}{i}").randbytes(size))
                   for i in range(n)] for rid, n in (("big", 2), ("next", 1))}
    stream = b"".join(
        b"".join(wire.encode_chunk_message(wire.Chunk(rid, layer, blocks, 0, token=TOKEN),
                                           wire.checksum(payload), len(payload)) + payload
                 for rid, layer, blocks, payload in plan)
        + wire.encode(wire.Finish(rid, len(plan), TOKEN))
        for rid, plan in plans.items())
    transfers = [receiver.expect(rid, lease_s=30, token=TOKEN) for rid in plans]
    host, port = receiver.address.removeprefix("tcp://").rsplit(":", 1)

    def trickle() -> None:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            for start in range(0, len(stream), 64 << 10):
                sock.sendall(stream[start : start + (64 << 10)])
                time.sleep(0.001)
            # Every chunk's verdict (big's come at its FINISH, before next is all read):
            # the receiver has it all, and closing now resets nothing it still reads.
            answers = bytearray()
            while len(wire.split_verdicts(answers)[0]) < 3 and (data := sock.recv(4096)):
                answers += data

    await asyncio.to_thread(trickle)
    for transfer in transfers:
        await transfer.wait()
    assert sink.of("big") == plans["big"] and sink.of("next") == plans["next"]
    # One mark a payload, in stream order: big's two chunks, then next's one.
    assert [fresh for fresh, _, _ in marks] == [True, False, True], marks
    assert all(0 < left < size for _, left, _ in marks), marks
    for (fresh, left, mark), key in zip(marks, [("big", 0), ("big", 1), ("next", 0)], strict=True):
        want = left // ReadMark.FIRST_WAKES if fresh else min(left, ReadMark.MAX_BYTES)
        assert mark == want, (key, marks)
        assert all(n >= min(rest, mark) for n, rest in reads[key]), (key, reads[key])
        # Each read brings at least the mark: a tenth at a time, or a MiB.
        assert len(reads[key]) <= (ReadMark.FIRST_WAKES + 1 if fresh else 2), reads[key]


class _TakesSome:
    """A socket whose kernel takes ``takes[i]`` bytes on the i-th sendmsg (0: it is
    full, BlockingIOError), recording what each call was offered."""

    def __init__(self, takes: list[int]) -> None:
        self.takes, self.offered, self.out = list(takes), [], bytearray()

    def sendmsg(self, buffers) -> int:
        self.offered.append(sum(b.nbytes for b in buffers))
        take = self.takes.pop(0) if self.takes else 1 << 30
        if not take:
            raise BlockingIOError
        data = b"".join(bytes(b) for b in buffers)[:take]
        self.out += data
        return len(data)


class _Transport:
    def __init__(self, sock: _TakesSome) -> None:
        self.sock, self.writes = sock, []

    def get_write_buffer_size(self) -> int:
        return 0  # drained by the time it is asked (drain below)

    def write(self, data) -> None:
        self.writes.append(len(data))
        self.sock.out += bytes(data)


class _Writer:
    def __init__(self, sock: _TakesSome) -> None:
        self.transport = _Transport(sock)

    def write(self, data) -> None:
        self.transport.write(data)

    async def drain(self) -> None:
        pass


@pytest.mark.parametrize("takes", [[], [5, 0, 70_000, 0, 0], [300_000, 0, 1, 2, 3],
                                   [0, 0, 0, 0, 0, 0]])
async def test_a_large_message_is_written_in_order_whatever_the_kernel_takes(takes):
    from common.transfer.tcp_sender import _Connection

    sock = _TakesSome(takes)
    conn = object.__new__(_Connection)
    conn.sock, conn.writer = sock, _Writer(sock)
    tx = TcpSender(write_slice_bytes=100_000)
    rng = random.Random(len(takes))
    parts = [b"head", rng.randbytes(250_000), rng.randbytes(10), rng.randbytes(180_000)]
    await tx._write_through(conn, [memoryview(p) for p in parts])
    assert bytes(sock.out) == b"".join(parts)  # every byte once, in order
    # What the kernel did not take went a slice at a time, never more than a slice.
    assert all(n <= 100_000 for n in conn.writer.transport.writes)
    if not takes:  # a kernel with room: one system call, nothing through the transport
        assert sock.offered == [sum(map(len, parts))] and conn.writer.transport.writes == []


@pytest.mark.parametrize("status", [[1], {"a": 1}, 7, None, "maybe"])
async def test_a_malformed_verdict_fails_the_transfer_at_once(sender, status):
    """Whatever a peer at a receiver's address answers, the sender's transfer fails with
    a protocol error (not a hang, not a dead verdict reader), and the next connection
    to a real receiver works."""
    import msgpack

    header = msgpack.packb({"status": status, "reason": "x"})
    answer = wire.PREFIX.pack(wire.MAGIC, wire.VERSION, wire.Kind.VERDICT, 0, len(header), 0)

    async def hostile(reader, writer):
        await reader.read(1 << 16)  # the chunk, or some of it
        writer.write(answer + header)
        await writer.drain()
        await reader.read()  # until the sender hangs up

    server = await asyncio.start_server(hostile, "127.0.0.1", 0)
    address = f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        with pytest.raises(TransferError, match="receiver protocol error"):
            async with asyncio.timeout(5):
                await sender.send(address, "r", 0, [1], b"kv" * 100, token=TOKEN)
                await sender.finish(address, "r", 1, token=TOKEN)
        assert sender.connections == 0
    finally:
        server.close()
        await server.wait_closed()


def test_decoders_refuse_short_prefixes_and_odd_verdict_fields_with_wire_errors():
    """What a peer can put on the wire comes back as WireError, never another type."""
    import msgpack

    with pytest.raises(wire.WireError, match="a prefix of 7 bytes"):
        wire.decode_prefix(b"PDKV\x07\x04\x00")
    for status in ([1], {"a": 1}, 7, None, b"ok", "maybe"):
        header = msgpack.packb({"status": status, "reason": "x"})
        frame = wire.PREFIX.pack(wire.MAGIC, wire.VERSION, wire.Kind.VERDICT, 0, len(header),
                                 0) + header
        with pytest.raises(wire.WireError, match="status must be one of"):
            wire.split_verdicts(bytearray(frame))
    ok = wire.encode_verdict(wire.Verdict(wire.Status.RESEND, "again"))
    assert wire.split_verdicts(bytearray(ok)) == ([wire.Verdict(wire.Status.RESEND, "again")],
                                                  len(ok))
