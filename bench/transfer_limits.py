"""The limits ``bench/transfer.py`` holds each backend to: the same bytes in the same
messages between the same two kinds of process, moved the plainest way there is, the
receiver saying it has all the same way (a stdout line, its CPU seconds at the end).

Each limit is a context manager giving ``one(rep)``, one transfer; its receiving process
(``serve_raw_*``) is started through the ``Peer`` it is handed.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import time

MIB = 1 << 20

LIMIT_NAMES = {"tcp": "blocking sendall of each message / recv_into",
               "shm": "memcpy of each message into a mapped segment, a pipe line to wake, "
                      "memcpy of each message out of it into a destination buffer",
               "ucx": "the whole payload in one ucxx send"}


def serve_raw_tcp() -> None:
    from common.transfer.tcp import SOCKET_BUFFER_BYTES, tune_socket

    listener = socket.socket()
    tune_socket(listener, SOCKET_BUFFER_BYTES)  # before listen, as the tcp backend does
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    print(f"addr {listener.getsockname()[1]}", flush=True)
    conn, buffer = listener.accept()[0], memoryview(bytearray(64 * MIB))
    while total := int.from_bytes(conn.recv(8, socket.MSG_WAITALL) or b"", "little"):
        while total:
            total -= conn.recv_into(buffer[: min(total, len(buffer))])
        print(f"done {time.process_time()}", flush=True)


def serve_raw_shm(name: str) -> None:
    from common.transfer.shm_segment import SHM_DIR, Segment

    segment = Segment.attach(SHM_DIR, name)
    # Where a worker lands KV (its cache): zeroed, so faulted in, as the backend's sink's.
    destination = memoryview(bytearray(segment.size))
    print("addr mapped", flush=True)
    for line in sys.stdin:  # one line a repetition, "<messages> <bytes each>": in place
        count, size = map(int, line.split())
        for at in range(0, count * size, size):  # each message copied out, as it lands
            destination[at : at + size] = segment.view[at : at + size]
        print(f"done {time.process_time()}", flush=True)
    segment.close()


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


@contextlib.asynccontextmanager
async def tcp_limit(peer, chunks: list[memoryview], payload: memoryview):
    from common.transfer.tcp import SOCKET_BUFFER_BYTES, tune_socket

    sock = socket.socket()
    tune_socket(sock, SOCKET_BUFFER_BYTES)  # before connect, as the tcp backend does
    sock.connect(("127.0.0.1", int(await peer.start("raw", "tcp"))))

    async def one(rep: int) -> None:
        sock.sendall(payload.nbytes.to_bytes(8, "little"))
        for chunk in chunks:
            sock.sendall(chunk)
        await peer.done()

    with sock:
        yield one


@contextlib.asynccontextmanager
async def shm_limit(peer, chunks: list[memoryview], payload: memoryview):
    from common.transfer.shm_segment import SHM_DIR, Segment, new_prefix

    segment = Segment.create(SHM_DIR, new_prefix(), payload.nbytes)
    segment.view[:] = payload  # every page faulted in once, as the backend's ring is

    async def one(rep: int) -> None:
        offset = 0
        for chunk in chunks:
            segment.view[offset : offset + chunk.nbytes] = chunk
            offset += chunk.nbytes
        peer.proc.stdin.write(f"{len(chunks)} {chunks[0].nbytes}\n".encode())
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
