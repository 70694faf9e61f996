"""Transfer tokens on the data plane: a receiver that expected a transfer with a token
takes only messages presenting it, on every backend (tcp, shm, and ucx where ucxx
imports). A peer that knows the request id but not the token writes nothing, ends
nothing and is counted; the sender holding the token completes the transfer."""

from __future__ import annotations

import asyncio
import secrets

import pytest

from common.transfer import (
    MultiReceiver,
    MultiSender,
    TransferState,
    make_receiver,
    make_sender,
    wire,
)
from common.transfer.table import TransferTable
from tests.kv_sink import Sink
from tests.ucx_probe import UCX_MISSING

pytestmark = pytest.mark.timeout(60)



@pytest.fixture(params=["tcp", "shm", "ucx"])
def kind(request) -> str:
    if request.param == "ucx" and UCX_MISSING:
        pytest.skip(UCX_MISSING)
    return request.param



@pytest.fixture
async def parts(kind):
    """(receiver, its sink, the real sender, an attacker's sender), all of ``kind``."""
    sink = Sink()
    rx = make_receiver(kind, sink=sink)
    await rx.start()
    real, rogue = make_sender(kind), make_sender(kind)
    yield rx, sink, real, rogue
    for tx in (real, rogue):
        await tx.close()
    await rx.close()


async def _until(cond, within_s: float = 5.0) -> None:
    async with asyncio.timeout(within_s):
        while not cond():
            await asyncio.sleep(0.01)


async def test_forged_messages_without_the_token_change_nothing(parts):
    rx, sink, real, rogue = parts
    token = secrets.token_bytes(16)
    transfer = rx.expect("victim", lease_s=30, token=token)
    forged = b"\xee" * 4096
    # Right request id; a wrong token, then none: both chunks are read and dropped.
    await rogue.send(rx.address, "victim", 0, [3, 4], forged, token=secrets.token_bytes(16))
    await rogue.send(rx.address, "victim", 1, [3, 4], forged, token=b"")
    await rogue.finish(rx.address, "victim", 2, token=b"guess")  # would settle it as FAILED
    await _until(lambda: rx.refused == 3)
    await rogue.abort(rx.address, "victim", "forged", token=b"")
    await _until(lambda: rx.refused == 4)
    await rogue.close()  # its connection lost: it carried nothing of the transfer
    await asyncio.sleep(0.2)
    assert sink.chunks == [] and transfer.state is TransferState.PENDING
    assert transfer.bytes_received == 0
    real_bytes = [bytes([layer]) * 2048 for layer in range(2)]
    for layer, data in enumerate(real_bytes):
        await real.send(rx.address, "victim", layer, [3, 4], data, token=token)
    await real.finish(rx.address, "victim", 2, token=token)
    await transfer.wait()
    assert sink.chunks == [("victim", layer, [3, 4], real_bytes[layer]) for layer in range(2)]
    assert transfer.state is TransferState.DONE and rx.refused == 4


async def test_the_token_holder_can_abort_it(parts):
    rx, sink, real, _ = parts
    token = secrets.token_bytes(16)
    transfer = rx.expect("r", lease_s=30, token=token)
    await real.send(rx.address, "r", 0, [1], b"\x01" * 512, token=token)
    await real.abort(rx.address, "r", "prefill failed", token=token)
    with pytest.raises(Exception, match="prefill failed"):
        await transfer.wait()
    assert len(sink.chunks) == 1 and rx.refused == 0


async def test_multi_receiver_checks_tokens_on_every_backend():
    sink = Sink()
    rx = MultiReceiver(sink=sink, host_id="h")
    await rx.start()
    tx = MultiSender(host_id="h")
    try:
        for kind in rx.kinds:
            address = rx.advert().endpoints[kind]
            token = secrets.token_bytes(16)
            transfer = rx.expect(f"m-{kind}", lease_s=30, token=token)
            await tx.send(address, f"m-{kind}", 0, [7], b"bad", token=token[::-1])
            await tx.send(address, f"m-{kind}", 0, [7], b"good", token=token)
            await tx.finish(address, f"m-{kind}", 1, token=token)
            await transfer.wait()
        assert [c[3] for c in sink.chunks] == [b"good"] * len(rx.kinds)
        assert rx.refused == len(rx.kinds)
    finally:
        await tx.close()
        await rx.close()


async def test_table_refuses_in_constant_time_and_every_transfer_has_a_token():
    seen = []
    table = TransferTable(lambda *a: seen.append(a[:3]))
    table.expect("t", 10, token=b"k" * 16)
    table.expect("u", 10, token=b"u" * 16)
    payload = memoryview(b"abc")
    assert table.on_chunk("t", 0, [1], payload, wire.checksum(payload)) == wire.DROPPED
    assert table.on_chunk("t", 0, [1], payload, wire.checksum(payload),
                          token=b"k" * 15 + b"j") == wire.DROPPED
    assert table.on_chunk("u", 0, [2], payload, wire.checksum(payload),
                          token=b"k" * 16) == wire.DROPPED  # another transfer's token
    assert table.on_chunk("t", 0, [1], payload, wire.checksum(payload),
                          token=b"k" * 16) == wire.OK
    assert seen == [("t", 0, [1])] and table.refused == 3
    table.fail_untokened("t", "malformed message")  # cannot speak for a transfer
    assert table.is_live("t") and table.refused == 4
    # No transfer without a token: not even one a test or benchmark opens.
    with pytest.raises(TypeError):
        table.expect("open", 10)
    for bad in (None, b"", b"x" * 65, "text"):
        with pytest.raises(ValueError, match="token"):
            table.expect(f"bad-{bad!r}", 10, token=bad)
    assert not table.is_live("open") and table.live() == 2


@pytest.mark.parametrize("call", ["send", "finish", "abort"])
async def test_every_sender_call_names_its_token(kind, call):
    """A sender call without a token is a programming error, caught before any byte
    goes out, not a message the receiver has to refuse."""
    tx = make_sender(kind)
    args = {"send": (0, [1], b"kv"), "finish": (1,), "abort": ("why",)}[call]
    try:
        with pytest.raises(TypeError, match="token"):
            await getattr(tx, call)("tcp://127.0.0.1:1", "r", *args)
        multi = MultiSender()
        with pytest.raises(TypeError, match="token"):
            await getattr(multi, call)("tcp://127.0.0.1:1", "r", *args)
        await multi.close()
    finally:
        await tx.close()


def test_wire_carries_the_token_and_checks_its_size():
    chunk = wire.Chunk("r", 0, [1], 5, 0, b"\x00\xff" * 8)
    head = wire.encode(chunk, 3)
    kind, header_len, _ = wire.decode_prefix(head[: wire.PREFIX.size])
    assert wire.decode_header(kind, head[wire.PREFIX.size:]) == chunk
    with pytest.raises(wire.WireError, match="token"):
        wire.encode(wire.Finish("r", 1, b"x" * (wire.MAX_TOKEN_BYTES + 1)))
