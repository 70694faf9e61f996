"""The limits ``bench/transfer.py`` holds each backend to: the same bytes in the same
messages between the same two kinds of process, moved the plainest way there is, the
receiver saying it has all by a stdout line (its CPU seconds at the end), which the
sender waits for as a backend's sender waits for its verdict.

Each limit is a context manager giving ``one(rep)``, one transfer; its receiving process
(``serve_raw_*``) is started through the ``Peer`` it is handed.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import struct
import sys
import time

MIB = 1 << 20

LIMIT_NAMES = {"tcp": "blocking sendall of each message / recv_into",
               "shm": "memcpy of each message into a mapped segment, a pipe line to wake the "
                      "receiver after each group of messages (sqrt(bytes / 300 kB) groups), "
                      "memcpy of each message out of it into a destination buffer as its "
                      "group lands",
               "ucx": "the whole payload in one ucxx send"}
# Beside tcp's limit, the same with the end-to-end check every backend makes (xxh3_64 of
# each batch, the receiver hashing what it reads): how near the checksum lets a backend get.
CHECKED_NAME = ("the tcp limit, checked: xxh3_64 of each batch of layers (batch.py's "
                "grouping) before its sendall, hashed again as it is read and compared")
_CHECKED_HEAD = struct.Struct("<QQQ")  # a batch's bytes, its checksum, whether it is the last


def serve_raw_tcp(checked: str = "") -> None:
    from common.transfer.tcp import SOCKET_BUFFER_BYTES, tune_socket

    listener = socket.socket()
    tune_socket(listener, SOCKET_BUFFER_BYTES)  # before listen, as the tcp backend does
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    print(f"addr {listener.getsockname()[1]}", flush=True)
    conn, buffer = listener.accept()[0], memoryview(bytearray(64 * MIB))
    if checked:
        return _serve_checked(conn, buffer)
    while total := int.from_bytes(conn.recv(8, socket.MSG_WAITALL) or b"", "little"):
        while total:
            total -= conn.recv_into(buffer[: min(total, len(buffer))])
        print(f"done {time.process_time()}", flush=True)


def _serve_checked(conn: socket.socket, buffer: memoryview) -> None:
    """The checked limit's receiver: each batch read into ``buffer`` and hashed as it
    comes, its checksum compared once it is all in; a mismatch ends the process (the
    measuring one then fails: "the receiving process died")."""
    import xxhash

    while len(head := conn.recv(_CHECKED_HEAD.size, socket.MSG_WAITALL)) == _CHECKED_HEAD.size:
        total, digest, last = _CHECKED_HEAD.unpack(head)
        if total > len(buffer):
            sys.exit(f"a batch of {total} bytes, more than the {len(buffer)} landed at once")
        hasher, at = xxhash.xxh3_64(), 0
        while at < total:
            n = conn.recv_into(buffer[at:total])
            if not n:
                sys.exit("sender closed mid-batch")
            hasher.update(buffer[at : at + n])
            at += n
        if hasher.intdigest() != digest:
            sys.exit("checksum mismatch")
        if last:
            print(f"done {time.process_time()}", flush=True)


def serve_raw_shm(name: str) -> None:
    from common.transfer.shm_segment import SHM_DIR, Segment

    segment = Segment.attach(SHM_DIR, name)
    # Where a worker lands KV (its cache): zeroed, so faulted in, as the backend's sink's.
    destination = memoryview(bytearray(segment.size))
    print("addr mapped", flush=True)
    # One line a group, "<start> <end> <bytes a message> <last>": its messages are in place.
    for line in sys.stdin:
        start, end, size, last = map(int, line.split())
        for at in range(start, end, size):  # each message copied out, as its group lands
            destination[at : min(end, at + size)] = segment.view[at : min(end, at + size)]
        if last:
            print(f"done {time.process_time()}", flush=True)
    segment.close()


def shm_groups(messages: int, nbytes: int) -> int:
    """How many wake-ups the shm limit sends a transfer: with G groups the receiver's copy
    of one group overlaps the sender's of the next, so the two copies take ~(G + 1) / G
    of one, while each wake-up costs some tens of microseconds; G ~ sqrt(copy time / wake
    cost), at ~10 GB/s and ~30 us, is where the two balance (1 MiB: 2, 16 MiB: 8,
    256 MiB: every message), so the limit is at its best at every size."""
    return max(1, min(messages, round(math.sqrt(nbytes / 3e5))))


async def serve_raw_ucx(max_bytes: str) -> None:
    import ucxx

    buffer, finished = bytearray(int(max_bytes)), asyncio.Event()

    async def handler(ep) -> None:
        try:
            while True:
                await ep.recv(buffer)
                print(f"done {time.process_time()}", flush=True)
        except Exception:
            finished.set()

    listener = ucxx.create_listener(handler)
    print(f"addr {listener.port}", flush=True)
    await finished.wait()
    del listener  # stops listening


async def _dial_raw_tcp(peer, *args: str) -> socket.socket:
    """A blocking socket to a raw tcp receiver started through ``peer`` (``args``: its
    mode after "raw tcp"), its buffers set before connect, as the tcp backend does."""
    from common.transfer.tcp import SOCKET_BUFFER_BYTES, tune_socket

    sock = socket.socket()
    tune_socket(sock, SOCKET_BUFFER_BYTES)
    sock.connect(("127.0.0.1", int(await peer.start("raw", "tcp", *args))))
    return sock


@contextlib.asynccontextmanager
async def tcp_limit(peer, chunks: list[memoryview], payload: memoryview):
    sock = await _dial_raw_tcp(peer)

    async def one(rep: int) -> None:
        sock.sendall(payload.nbytes.to_bytes(8, "little"))
        for chunk in chunks:
            sock.sendall(chunk)
        await peer.done()

    with sock:
        yield one


def _send_all(sock: socket.socket, buffers: list[memoryview]) -> None:
    """``sendall`` of ``buffers`` back to back, in one ``sendmsg`` where the kernel takes
    them all (a blocking socket's usual case)."""
    sent = sock.sendmsg(buffers)
    for buffer in buffers:
        if sent >= buffer.nbytes:
            sent -= buffer.nbytes
            continue
        sock.sendall(buffer[sent:])
        sent = 0


@contextlib.asynccontextmanager
async def tcp_checked_limit(peer, chunks: list[memoryview], payload: memoryview):
    """``tcp_limit`` with the end-to-end check: the layers in the tcp backend's batches
    (``batch.groups``), each batch hashed as the backend hashes it (``batch.checksum``)
    and sent behind a header holding its size and checksum."""
    from common.transfer import batch
    from common.transfer.tcp_sender import TcpSender

    runs = batch.groups([(i, [], c) for i, c in enumerate(chunks)], TcpSender.BATCH_BYTES)
    # Each batch's views, its size and whether it is the last: fixed, so not re-derived
    # per transfer; only the checksum is the per-transfer work being measured.
    groups = [([item[2] for item in run], sum(item[2].nbytes for item in run),
               g == len(runs) - 1) for g, run in enumerate(runs)]
    sock = await _dial_raw_tcp(peer, "checked")

    async def one(rep: int) -> None:
        for views, size, last in groups:
            head = _CHECKED_HEAD.pack(size, batch.checksum(views), last)
            _send_all(sock, [memoryview(head), views[0]])  # the header not alone in a segment
            for view in views[1:]:
                sock.sendall(view)
        await peer.done()

    with sock:
        yield one


@contextlib.asynccontextmanager
async def shm_limit(peer, chunks: list[memoryview], payload: memoryview):
    from common.transfer.shm_segment import SHM_DIR, Segment, new_prefix

    segment = Segment.create(SHM_DIR, new_prefix(), payload.nbytes)
    segment.view[:] = payload  # every page faulted in once, as the backend's ring is

    groups = shm_groups(len(chunks), payload.nbytes)
    bounds = [round(i * len(chunks) / groups) for i in range(groups + 1)]

    async def one(rep: int) -> None:
        offset = 0
        for g in range(groups):
            start = offset
            for chunk in chunks[bounds[g] : bounds[g + 1]]:
                segment.view[offset : offset + chunk.nbytes] = chunk
                offset += chunk.nbytes
            # Written at once (the pipe's buffer is empty): the receiver copies this
            # group out while the next one is copied in.
            peer.proc.stdin.write(
                f"{start} {offset} {chunks[0].nbytes} {int(g == groups - 1)}\n".encode())
        await peer.done()

    try:
        await peer.start("raw", "shm", segment.name)
        yield one
    finally:
        segment.unlink()
        segment.close()


@contextlib.asynccontextmanager
async def ucx_limit(peer, chunks: list[memoryview], payload: memoryview):
    import ucxx

    port = await peer.start("raw", "ucx", str(payload.nbytes))
    ep = await ucxx.create_endpoint("127.0.0.1", int(port))

    async def one(rep: int) -> None:
        await ep.send(payload)
        await peer.done()

    try:
        yield one
    finally:
        await ep.close()


LIMITS = {"tcp": tcp_limit, "shm": shm_limit, "ucx": ucx_limit}
CHECKED_LIMITS = {"tcp": tcp_checked_limit}
