"""Request/reply over ZeroMQ: ``RpcServer`` (ROUTER) and ``RpcClient`` (DEALER).

A reply carries ``parent`` = the request's message id and the request's request id; the
client matches replies by parent, so any number of calls may be in flight on one
socket. A request that fails to decode is answered with ``Error``, a reply that fails
to decode is logged and dropped: neither side's loop dies on bad input. Sockets have
LINGER 0, ``close()`` may be called more than once, and ``bulk`` frames are sent
without a copy (do not modify them after the send returns).

With CURVE keys on the context (``common.zmq_auth``) the server is a CURVE server; given
``allowed`` (sender role -> message types) it answers a request its sender's role may
not send with ``Error("forbidden")`` and counts it (``forbidden``, and the context's
``pdserve:control_forbidden`` metric, ``common.zmq_metrics``). A client names the
role of the server it connects to (``server=``).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import structlog
import zmq
import zmq.asyncio

from common.protocol import MAX_FRAME_BYTES, Error, Message, ProtocolError, decode, encode
from common.zmq_auth import Policy, allows, peer_role, secure_bind, secure_connect
from common.zmq_io import RECV_RETRY_S, bound_endpoint, new_socket, socket_gone
from common.zmq_metrics import refusals_of

log = structlog.get_logger(__name__)

Handler = Callable[[Message], Awaitable[Any | None]]


class RemoteError(RuntimeError):
    """The peer answered a call with ``Error``; ``code``, ``message`` and
    ``retry_after_s`` are its fields."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None):
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


class RpcTimeout(TimeoutError):
    """No reply arrived within the call's timeout."""


class RpcServer:
    """ROUTER socket that runs ``handler`` for every request, each in its own task.

    The handler returns a record, ``(record, bulk_frames)``, or None for no reply. A
    reply goes back with parent = the request's id and the same request id. A request
    that does not decode is answered with ``Error(code=<ProtocolError code>)``; a
    handler that raises is answered with ``Error("internal", str(exc))``. Either way the
    server keeps serving. Peers must be DEALERs (no REQ empty delimiter frame).
    """

    def __init__(self, ctx: zmq.asyncio.Context, bind: str, handler: Handler, *, name: str,
                 max_frame_bytes: int = MAX_FRAME_BYTES, allowed: Policy | None = None):
        self._ctx = ctx
        self._allowed = allowed
        self._checked = False  # whether sender roles are known (CURVE), set at start
        self.forbidden = 0
        self._bind = bind
        self._handler = handler
        self._name = name
        self._max_frame_bytes = max_frame_bytes
        self._sock: zmq.asyncio.Socket | None = None
        self._address: str | None = None
        self._loop_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    async def start(self) -> None:
        """Bind and start serving. Raises RuntimeError if started twice or closed."""
        if self._sock is not None or self._closed:
            raise RuntimeError(f"{self._name}: RpcServer already started or closed")
        self._sock = new_socket(self._ctx, zmq.ROUTER)
        try:
            self._checked = secure_bind(self._ctx, self._sock) and self._allowed is not None
            self._sock.bind(self._bind)
        except zmq.ZMQError:
            self._sock.close()
            self._closed = True
            raise
        self._address = bound_endpoint(self._sock)
        self._loop_task = asyncio.create_task(self._serve(), name=f"{self._name}-rpc-server")
        log.debug("rpc_server_started", server=self._name, address=self._address)

    @property
    def address(self) -> str:
        """The bound endpoint. Raises RuntimeError before ``start``."""
        if self._address is None:
            raise RuntimeError(f"{self._name}: RpcServer not started")
        return self._address

    async def close(self) -> None:
        """Stop serving, cancel running handlers, close the socket. Idempotent."""
        self._closed = True
        tasks = [t for t in (self._loop_task, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        self._loop_task = None
        if self._sock is not None and not self._sock.closed:
            self._sock.close(linger=0)

    async def _serve(self) -> None:
        sock = self._sock
        while True:
            try:
                frames = await sock.recv_multipart(copy=False)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if socket_gone(sock, exc):
                    return
                log.exception("rpc_recv_failed", server=self._name)
                await asyncio.sleep(RECV_RETRY_S)
                continue
            task = asyncio.create_task(self._handle(frames[0].bytes, frames[1:]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _handle(self, identity: bytes, frames: list[zmq.Frame]) -> None:
        try:
            await self._handle_one(identity, frames)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must cost one request, never the server
            log.exception("rpc_request_failed", server=self._name)

    async def _handle_one(self, identity: bytes, frames: list[zmq.Frame]) -> None:
        try:
            request = decode(frames, self._max_frame_bytes)
        except ProtocolError as exc:
            env = exc.envelope
            log.warning("rpc_bad_request", server=self._name, code=exc.code,
                        error=exc.message, msg_id=env.id if env else None)
            await self._reply(identity, Error(code=exc.code, message=exc.message),
                              parent=env.id if env else None,
                              request_id=env.request_id if env else None)
            return
        env = request.envelope
        if self._checked:
            role = peer_role(frames[-1])
            if not allows(self._allowed, role, env.type):
                self.forbidden += 1
                if (refusals := refusals_of(self._ctx)) is not None:
                    refusals.add("control", role, env.type)
                log.warning("rpc_forbidden", server=self._name, role=role, type=env.type,
                            request_id=env.request_id)
                await self._reply(identity, Error(code="forbidden", message=(
                    f"{role or 'an unknown peer'} may not send {env.type}")),
                                  parent=env.id, request_id=env.request_id)
                return
        try:
            result = await self._handler(request)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("rpc_handler_failed", server=self._name, type=env.type,
                          request_id=env.request_id)
            result = Error(code="internal", message=str(exc) or type(exc).__name__)
        if result is not None:
            await self._reply(identity, result, parent=env.id, request_id=env.request_id)

    async def _reply(self, identity: bytes, result: Any, *, parent: str | None,
                     request_id: str | None) -> None:
        """Send ``result`` (a record or ``(record, bulk)``); one that cannot be encoded
        is replaced by ``Error("internal")`` so the caller does not wait for nothing."""
        try:
            if isinstance(result, tuple):
                if len(result) != 2:
                    raise TypeError(f"handler returned a {len(result)}-tuple, expected 2")
                record, bulk = result
            else:
                record, bulk = result, ()
            frames = encode(record, parent=parent, request_id=request_id, bulk=bulk)
        except (ProtocolError, TypeError) as exc:
            log.exception("rpc_reply_unencodable", server=self._name, request_id=request_id)
            frames = encode(Error(code="internal", message=f"reply not encodable: {exc}"),
                            parent=parent, request_id=request_id)
        try:
            await self._sock.send_multipart([identity, *frames], copy=False)
        except zmq.ZMQError:
            if not self._sock.closed:
                log.exception("rpc_reply_failed", server=self._name, request_id=request_id)


class RpcClient:
    """DEALER socket connected to one RpcServer; many calls may be in flight at once.

    A reply that does not decode, or that answers no pending call (late after a
    timeout, or to a ``send``), is logged and dropped. After ``close`` pending calls
    raise ConnectionError.
    """

    def __init__(self, ctx: zmq.asyncio.Context, connect: str, *, name: str,
                 max_frame_bytes: int = MAX_FRAME_BYTES, server: str | None = None):
        self._name = name
        self._max_frame_bytes = max_frame_bytes
        self._sock = new_socket(ctx, zmq.DEALER)
        try:
            secure_connect(ctx, self._sock, server)
            self._sock.connect(connect)
        except (zmq.ZMQError, ValueError):
            self._sock.close()
            raise
        self._pending: dict[str, asyncio.Future[Message]] = {}
        self._loop_task: asyncio.Task | None = None

    async def call(self, record: Any, *, request_id: str | None = None, timeout: float = 5.0,
                   bulk: Sequence[bytes | memoryview] = (), trace: str | None = None) -> Message:
        """Send ``record`` (``trace``: the request's traceparent) and return the reply.

        Raises RemoteError if the reply is ``Error``, RpcTimeout if none arrives within
        ``timeout`` seconds (a later reply is dropped), ConnectionError if closed.
        """
        self._ensure_receiving()
        msg_id = uuid.uuid4().hex
        frames = encode(record, request_id=request_id, msg_id=msg_id, bulk=bulk, trace=trace)
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._pending[msg_id] = future
        try:
            async with asyncio.timeout(timeout):
                await self._sock.send_multipart(frames, copy=False)
                return await future
        except TimeoutError:
            raise RpcTimeout(
                f"{self._name}: no reply to {type(record).__name__} within {timeout}s"
            ) from None
        finally:
            self._pending.pop(msg_id, None)

    async def send(self, record: Any, *, request_id: str | None = None,
                   bulk: Sequence[bytes | memoryview] = (), trace: str | None = None) -> None:
        """Send ``record`` expecting no reply (any reply is dropped)."""
        self._ensure_receiving()
        await self._sock.send_multipart(
            encode(record, request_id=request_id, bulk=bulk, trace=trace), copy=False)

    async def close(self) -> None:
        """Stop receiving, fail pending calls with ConnectionError, close. Idempotent."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._loop_task
            self._loop_task = None
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ConnectionError(f"{self._name}: RpcClient closed"))
        self._pending.clear()
        if not self._sock.closed:
            self._sock.close(linger=0)

    def _ensure_receiving(self) -> None:
        if self._sock.closed:
            raise ConnectionError(f"{self._name}: RpcClient closed")
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._receive(), name=f"{self._name}-rpc")

    async def _receive(self) -> None:
        while True:
            try:
                frames = await self._sock.recv_multipart(copy=False)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if socket_gone(self._sock, exc):
                    return
                log.exception("rpc_recv_failed", client=self._name)
                await asyncio.sleep(RECV_RETRY_S)
                continue
            try:
                self._dispatch(frames)
            except Exception:  # a bug here must cost one reply, never the client
                log.exception("rpc_dispatch_failed", client=self._name)

    def _dispatch(self, frames: list[zmq.Frame]) -> None:
        try:
            reply = decode(frames, self._max_frame_bytes)
        except ProtocolError as exc:
            log.warning("rpc_bad_reply_dropped", client=self._name, code=exc.code,
                        error=exc.message)
            return
        future = self._pending.get(reply.envelope.parent or "")
        if future is None or future.done():
            log.debug("rpc_unmatched_reply", client=self._name, type=reply.envelope.type,
                      parent=reply.envelope.parent)
        elif isinstance(reply.record, Error):
            future.set_exception(RemoteError(reply.record.code, reply.record.message,
                                             reply.record.retry_after_s))
        else:
            future.set_result(reply)
