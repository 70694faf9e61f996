"""asyncio ZeroMQ sockets that speak ``common.protocol`` messages, one way.

Patterns (see docs/protocol.md, "Socket patterns"):

- ``Publisher`` (PUB) / ``Subscriber`` (SUB): heartbeats and events. Frame 0 is the topic,
  then the message frames.
- ``PushSocket`` (PUSH) / ``PullSocket`` (PULL): token streams.

Request/reply (ROUTER/DEALER) is ``common.zmq_rpc``, built on the helpers here.

Receivers never die on bad input: a message that fails to decode is logged and skipped.

With CURVE keys on the context (``common.zmq_auth``) a bound socket is a CURVE server
and a connecting one names the role of the server it expects (``server=``). A bound
receiver given ``allowed`` (sender role -> message types) drops, logs and counts
(``forbidden``) any message its sender's role may not send.
Every socket has LINGER 0, and every ``close()`` may be called more than once. Frames
passed as ``bulk`` are sent without a copy: do not modify them after the send returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import structlog
import zmq
import zmq.asyncio

from common.protocol import MAX_FRAME_BYTES, Message, ProtocolError, decode, encode
from common.zmq_auth import Policy, allows, peer_role, secure_bind, secure_connect
from common.zmq_metrics import refusals_of

log = structlog.get_logger(__name__)


def new_socket(ctx: zmq.asyncio.Context, kind: int) -> zmq.asyncio.Socket:
    """A socket of ``kind`` with LINGER 0, so that closing it never waits on a dead peer."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


def bound_endpoint(sock: zmq.asyncio.Socket) -> str:
    """The endpoint ``sock`` last bound, with a wildcard port resolved."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


RECV_RETRY_S = 0.05  # pause after an unexpected receive error, so a persistent one cannot spin


def socket_gone(sock: zmq.asyncio.Socket, exc: BaseException) -> bool:
    """True when ``exc`` means the socket or its context was closed under us."""
    gone = isinstance(exc, zmq.ZMQError) and exc.errno in (zmq.ETERM, zmq.ENOTSOCK)
    return gone or sock.closed


class _Endpoint:
    """A socket that binds or connects at construction; ``address`` is the bound one."""

    def __init__(self, ctx: zmq.asyncio.Context, kind: int, addr: str, *, bind: bool,
                 server: str | None = None, allowed: Policy | None = None,
                 max_frame_bytes: int = MAX_FRAME_BYTES):
        self._sock = new_socket(ctx, kind)
        self._bound = bind
        self._max_frame_bytes = max_frame_bytes
        self.forbidden = 0  # messages dropped because their sender's role may not send them
        self._refusals = refusals_of(ctx)  # the same, as a metric (common.zmq_metrics)
        try:
            if bind:
                # Roles are known only on the CURVE server side; a connecting socket
                # already pinned its peer by the server key.
                self._allowed = allowed if secure_bind(ctx, self._sock) else None
                self._sock.bind(addr)
            else:
                self._allowed = None
                secure_connect(ctx, self._sock, server)
                self._sock.connect(addr)
        except (zmq.ZMQError, ValueError):
            self._sock.close()
            raise
        self._address = bound_endpoint(self._sock) if bind else addr

    @property
    def address(self) -> str:
        """The real endpoint (``tcp://127.0.0.1:*`` resolved) if bound, else the peer's."""
        return self._address

    async def close(self) -> None:
        """Close the socket at once, dropping unsent messages. Idempotent."""
        if not self._sock.closed:
            self._sock.close(linger=0)

    async def _recv_valid(self, skip: int, what: str) -> Message:
        """Next message that decodes and that its sender may send, skipping ``skip``
        leading frames; log and drop others."""
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            try:
                if len(frames) <= skip:
                    raise ProtocolError("malformed", f"{len(frames)} frames, expected > {skip}")
                msg = decode(frames[skip:], self._max_frame_bytes)
            except ProtocolError as exc:
                log.warning("bad_message_dropped", socket=what, code=exc.code,
                            error=exc.message)
                continue
            if self._allowed is None:
                return msg
            role = peer_role(frames[-1])
            if allows(self._allowed, role, msg.envelope.type):
                return msg
            self.forbidden += 1
            if self._refusals is not None:
                self._refusals.add(what, role, msg.envelope.type)
            log.warning("forbidden_message_dropped", socket=what, role=role,
                        type=msg.envelope.type, request_id=msg.envelope.request_id)


class Publisher(_Endpoint):
    """PUB socket: ``publish`` sends [topic, *message frames]. Never blocks: PUB drops
    messages for subscribers that are slow or not yet connected (ZeroMQ semantics)."""

    def __init__(self, ctx: zmq.asyncio.Context, addr: str, *, bind: bool,
                 server: str | None = None):
        super().__init__(ctx, zmq.PUB, addr, bind=bind, server=server)

    async def publish(self, record: Any, topic: bytes = b"") -> None:
        await self._sock.send_multipart([topic, *encode(record)], copy=False)


class Subscriber(_Endpoint):
    """SUB socket subscribed to ``topics`` (prefix match; b"" is everything)."""

    def __init__(self, ctx: zmq.asyncio.Context, addr: str, *, bind: bool,
                 topics: Sequence[bytes] = (b"",), max_frame_bytes: int = MAX_FRAME_BYTES,
                 server: str | None = None, allowed: Policy | None = None):
        super().__init__(ctx, zmq.SUB, addr, bind=bind, server=server, allowed=allowed,
                         max_frame_bytes=max_frame_bytes)
        for topic in topics:
            self._sock.setsockopt(zmq.SUBSCRIBE, topic)

    async def recv(self) -> Message:
        """The next valid message; bad ones are logged and skipped."""
        return await self._recv_valid(1, "sub")


class PushSocket(_Endpoint):
    """PUSH socket for token streams. ``send`` waits while the peer's queue is full."""

    def __init__(self, ctx: zmq.asyncio.Context, addr: str, *, bind: bool,
                 server: str | None = None):
        super().__init__(ctx, zmq.PUSH, addr, bind=bind, server=server)

    async def send(self, record: Any, *, request_id: str | None = None) -> None:
        await self._sock.send_multipart(encode(record, request_id=request_id), copy=False)


class PullSocket(_Endpoint):
    """PULL socket for token streams."""

    def __init__(self, ctx: zmq.asyncio.Context, addr: str, *, bind: bool,
                 max_frame_bytes: int = MAX_FRAME_BYTES, server: str | None = None,
                 allowed: Policy | None = None):
        super().__init__(ctx, zmq.PULL, addr, bind=bind, server=server, allowed=allowed,
                         max_frame_bytes=max_frame_bytes)

    async def recv(self) -> Message:
        """The next valid message; bad ones are logged and skipped."""
        return await self._recv_valid(0, "pull")
