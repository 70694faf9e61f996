"""``TableReceiver``: the lifecycle every backend's receiver shares (constructor checks,
start, address, serving, tracked connections, idempotent close), the same for each."""

from __future__ import annotations

import asyncio
import secrets

import pytest

from common.address import parse_address
from common.transfer import TransferError, TransferState
from common.transfer.backends import backend_receiver, backend_sender
from common.transfer.table import TransferTable
from common.transfer.table_receiver import TableReceiver
from tests.ucx_probe import UCX_MISSING

# Every transfer is expected with a token and every message presents it; one drawn per run
# serves these tests (tests/test_transfer_tokens.py checks that the wrong one is refused).
TOKEN = secrets.token_bytes(16)

pytestmark = pytest.mark.timeout(60)



@pytest.fixture(params=["tcp", "shm", "ucx"])
def kind(request) -> str:
    if request.param == "ucx" and UCX_MISSING:
        pytest.skip(UCX_MISSING)
    return request.param


def sink(request_id, layer, block_ids, payload) -> None:
    pass


def test_constructor_checks(kind):
    cls = type(backend_receiver(kind, "127.0.0.1", 0, sink=sink))
    assert issubclass(cls, TableReceiver)
    with pytest.raises(TypeError, match="exactly one of sink and table"):
        cls("127.0.0.1", 0)
    with pytest.raises(TypeError, match="exactly one of sink and table"):
        cls("127.0.0.1", 0, sink=sink, table=TransferTable(sink))
    for port in (-1, 65536, "7000"):
        with pytest.raises(ValueError, match="port must be in"):
            cls("127.0.0.1", port, sink=sink)
    with pytest.raises(ValueError, match="max_payload_bytes must be > 0"):
        cls("127.0.0.1", 0, sink=sink, max_payload_bytes=0)
    with pytest.raises(TypeError, match="sink must be callable"):
        cls("127.0.0.1", 0, sink="not callable")


async def test_start_serve_close(kind):
    table = TransferTable(sink)
    rx = backend_receiver(kind, "127.0.0.1", 0, table=table)
    assert rx.table is table and rx.connections == 0
    with pytest.raises(RuntimeError, match="no address before start"):
        _ = rx.address
    with pytest.raises(RuntimeError, match="not serving"):
        rx.expect("early", lease_s=5, token=TOKEN)
    await rx.start()
    address = parse_address(rx.address, kind)
    assert address.host == "127.0.0.1" and address.port > 0
    with pytest.raises(RuntimeError, match="already started"):
        await rx.start()

    tx = backend_sender(kind)
    transfer = rx.expect("r", lease_s=30, token=TOKEN)
    try:
        await tx.send(rx.address, "r", 0, [0], b"kv", token=TOKEN)
        await tx.finish(rx.address, "r", 1, token=TOKEN)
        await transfer.wait()
        assert rx.connections == 1  # the sender's connection, tracked while it lasts
        left = rx.expect("left", lease_s=30, token=TOKEN)
        await rx.close()
        assert left.state is TransferState.CANCELLED and left.error == "receiver closed"
        assert rx.live() == 0
        await rx.close()  # idempotent
        with pytest.raises(RuntimeError, match="already started"):
            await rx.start()
        with pytest.raises(RuntimeError, match="not serving"):
            rx.expect("late", lease_s=5, token=TOKEN)
        for _ in range(100):
            if rx.connections == 0:
                break
            await asyncio.sleep(0.01)
        assert rx.connections == 0
    finally:
        await tx.close()
        await rx.close()
    with pytest.raises(TransferError):
        await tx.send(rx.address, "r", 0, [0], b"kv", token=TOKEN)


async def test_close_before_start(kind):
    rx = backend_receiver(kind, "127.0.0.1", 0, sink=sink)
    await rx.close()
    await rx.close()
    with pytest.raises(RuntimeError, match="receiver closed"):
        await rx.start()
