"""The shm backend's control channel over a Unix-domain socket (shm_control.py): used
where both ends can, in a directory no other user can enter, with the TCP address as
the fallback whenever it cannot be."""

from __future__ import annotations

import os
import random
import secrets
import socket
import stat

import pytest

from common.address import dial_target
from common.transfer import shm_control
from common.transfer.shm_receiver import ShmReceiver
from common.transfer.shm_sender import ShmSender
from tests.kv_sink import Sink

pytestmark = pytest.mark.timeout(60)
TOKEN = secrets.token_bytes(16)


async def send_one(tmp_path, rx: ShmReceiver, rid: str) -> int:
    """One request of three layers from a new sender, checked as it landed; the family
    of the control socket it went over."""
    tx = ShmSender(directory=str(tmp_path))
    chunks = [(layer, [layer, 9], random.Random(layer).randbytes(5000 + layer))
              for layer in range(3)]
    try:
        transfer = rx.expect(rid, lease_s=10, token=TOKEN)
        await tx.send_many(rx.address, rid, chunks, token=TOKEN)
        await tx.finish(rx.address, rid, 3, token=TOKEN)
        await transfer.wait()
        family = tx._conns[rx.address].transport.get_extra_info("socket").family
    finally:
        await tx.close()
    assert rx.sink.of(rid) == [(rid, layer, blocks, data) for layer, blocks, data in chunks]
    return family


@pytest.fixture
async def receiver(tmp_path):
    rx = ShmReceiver(sink=(sink := Sink()), directory=str(tmp_path))
    rx.sink = sink
    await rx.start()
    yield rx
    await rx.close()


async def test_a_transfer_goes_over_the_receivers_unix_socket(tmp_path, receiver):
    host, port = dial_target(receiver.address, "shm")
    path = shm_control.socket_path(str(tmp_path), host, port)
    assert path is not None and stat.S_ISSOCK(os.lstat(path).st_mode)
    folder = os.lstat(os.path.dirname(path))
    assert folder.st_uid == os.getuid() and stat.S_IMODE(folder.st_mode) == 0o700
    assert await send_one(tmp_path, receiver, "a") == socket.AF_UNIX
    await receiver.close()
    assert not os.path.exists(path)  # the receiver takes its socket with it


async def test_a_socket_gone_or_a_directory_not_private_falls_back_to_tcp(tmp_path, receiver):
    host, port = dial_target(receiver.address, "shm")
    path = shm_control.socket_path(str(tmp_path), host, port)
    os.unlink(path)  # as if removed under the receiver: nothing to connect to
    assert await send_one(tmp_path, receiver, "gone") == socket.AF_INET
    os.chmod(os.path.dirname(path), 0o755)  # others could list and reach it: not used
    assert shm_control.socket_path(str(tmp_path), host, port) is None
    assert await send_one(tmp_path, receiver, "open") == socket.AF_INET


async def test_a_stale_socket_left_at_the_name_is_replaced(tmp_path):
    probe = ShmReceiver(sink=Sink(), directory=str(tmp_path))
    await probe.start()
    host, port = dial_target(probe.address, "shm")
    await probe.close()
    path = shm_control.socket_path(str(tmp_path), host, port, create=True)
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(path)  # a receiver that died without removing its socket
    dead.close()
    rx = ShmReceiver("127.0.0.1", port, sink=(sink := Sink()), directory=str(tmp_path))
    rx.sink = sink
    await rx.start()
    try:
        assert await send_one(tmp_path, rx, "s") == socket.AF_UNIX
    finally:
        await rx.close()


def test_the_name_is_per_address_and_only_in_a_directory_of_this_users(tmp_path):
    a = shm_control.socket_path(str(tmp_path), "127.0.0.1", 7000, create=True)
    assert a == shm_control.socket_path(str(tmp_path), "127.0.0.1", 7000)
    assert a != shm_control.socket_path(str(tmp_path), "127.0.0.1", 7001)
    assert a != shm_control.socket_path(str(tmp_path), "127.0.0.2", 7000)
    assert shm_control.socket_path(str(tmp_path), "127.0.0.1", 0) is None
    folder = os.path.dirname(a)
    if os.getuid() == 0:  # a directory another user made first is never used
        os.chown(folder, 4321, -1)
        assert shm_control.socket_path(str(tmp_path), "127.0.0.1", 7000) is None
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    assert shm_control.socket_path(str(deep), "127.0.0.1", 7000, create=True) is None


async def test_a_file_that_is_no_socket_at_the_name_falls_back_to_tcp(tmp_path, receiver):
    host, port = dial_target(receiver.address, "shm")
    path = shm_control.socket_path(str(tmp_path), host, port)
    os.unlink(path)
    with open(path, "wb") as f:  # something else at the name: connecting there fails
        f.write(b"not a socket")
    assert await send_one(tmp_path, receiver, "file") == socket.AF_INET
