"""The tcp backend: plain asyncio sockets, the data plane that always works.

Addresses are ``tcp://host:port`` (IPv6 hosts in brackets: ``tcp://[::1]:7000``).
Messages are framed as in ``wire.py``. Sockets ask for 4 MiB send and receive buffers
(the kernel may cap them at net.core.wmem_max / rmem_max) and set TCP_NODELAY; the
listening socket gets its buffers before ``listen`` so the TCP window can scale.

The sender is in ``tcp_sender.py``, the receiver in ``tcp_receiver.py`` (its
per-connection reader: ``frame_reader.py``).
"""

from __future__ import annotations

import socket

SCHEME = "tcp"
SOCKET_BUFFER_BYTES = 4 << 20
JOIN_BYTES = 256 << 10  # payloads up to this are corked with their head (tcp_sender.py)
CORK_BYTES = 2 << 20  # corked messages go out once they hold this many bytes:
# a request of a few hundred tokens (about 1.4 MiB of KV) is one sendmsg, one wake-up


class ReadMark:
    """When the event loop wakes the reader of a large payload: its TCP socket's
    ``SO_RCVLOWAT``, in bytes (``nbytes``), moved by ``frame_reader.py``.

    While a large payload comes in, the mark is what is left of it, up to ``MAX_BYTES``:
    the loop then wakes once a MiB instead of once every 100-200 KiB the kernel happens
    to hold (89 turns for a 16 MiB request of 30 chunks, each 10-20 µs of Python on top
    of the copy). Between messages it is 1 byte; Linux wakes a reader at end of stream
    whatever the mark.

    A transfer's first large payload (the first since a FINISH or ABORT, ``fresh``) is
    read in ``FIRST_WAKES`` steps instead: a request of a few hundred tokens is one BATCH
    of about 1.4 MB, which at 1 MiB marks the reader slept through until most of it was
    sent, then had most of it to read after the sender was done (its last byte read
    130-150 µs after the ``sendmsg`` returned). In tenths its reads follow the sender's:
    60-90 µs after, the sender's ``sendmsg`` 5-10% slower, the transfer 5-11% sooner
    (1,000 alternated transfers a pair; bench/transfer.py: 0.75-0.90x of the raw socket
    against 0.70-0.75x). Later payloads keep the 1 MiB mark: a long request's reads are
    then behind by a batch at most, and each extra wake costs as much as the copy.
    """

    MAX_BYTES = 1 << 20  # at most a quarter of the receive buffer asked for
    FIRST_WAKES = 10

    __slots__ = ("sock", "nbytes", "fresh")

    def __init__(self, sock: socket.socket | None) -> None:
        self.sock = sock  # None: not a TCP socket, nothing to move
        self.nbytes = 1
        self.fresh = True

    def payload(self, left: int) -> None:
        """The mark for a large payload of which ``left`` bytes are still to come."""
        if self.fresh:
            self.fresh, left = False, max(1, left // self.FIRST_WAKES)
        self.at(min(left, self.MAX_BYTES))

    def coming(self, left: int) -> None:
        """``left`` bytes of the payload are still to come: never wait for more (1 once
        it is all in, for the next message)."""
        if left < self.nbytes:
            self.at(left or 1)

    def at(self, nbytes: int) -> None:
        """Wake the reader once ``nbytes`` can be read."""
        if self.sock is not None and nbytes != self.nbytes:
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
                self.nbytes = nbytes
            except OSError:  # not on this socket: wake at every byte, as before
                self.sock = None


def tune_socket(sock: socket.socket, buffer_bytes: int) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
