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


def tune_socket(sock: socket.socket, buffer_bytes: int) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
