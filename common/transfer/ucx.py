"""The ucx backend: UCX through ``ucxx`` (the optional extra ``pdserve[ucx]``, package
``ucxx-cu12``). UCX picks the transport itself: RDMA where the hardware has it, else its
own TCP and shared-memory transports (CPU-only hosts included). The sender is in
``ucx_sender.py``.

Address: ``ucx://host:port``, the port of a ucxx listener. The listener binds every
interface (ucxx offers no bind address); ``host`` is only what the receiver advertises.

Messages go on the sender's endpoint in runs, a run to a tagged message: its length
(u32, little-endian), then ``wire.py`` messages back to back, each its prefix, its
msgpack header and, when its payload is at most ``INLINE_BYTES``, its payload. A payload
larger than that follows its run as a tagged message of its own, and ends the run. The
sender adds each message to the endpoint's run and posts the run at the event loop's
next turn, once it holds ``RUN_BYTES``, or at once with a FINISH, an ABORT or a large
payload: a request of small chunks costs a few UCX messages, not two a chunk (each one
costs hundreds of µs inside ucxx). The receiver keeps a run's receive posted (into one
of two buffers, used by turns, as large as a run can be); on each run it posts the
receive of a payload that follows, of the size its prefix announced, straight into one
of two buffers it uses by turns for the connection (grown, never shrunk), then the next
run's. Once such a payload is in, the next run has usually come too (the sender does not
wait for one send to end before posting the next): its own payload's receive is posted
before this one is verified, so that a payload is always on its way while the receiver
works; an unmatched payload would wait in UCX until then. A payload nobody wants is
received into one byte and its truncation ignored. Verdicts go back on the same
endpoint, in chunk order, batched as the tcp receiver does (``frame_reader.py``), a
batch to a tagged message framed as a run: its length then its VERDICT messages. The
sender keeps a receive posted for them.

Configuration: ``UCX_*`` environment variables (``UCX_TLS=tcp,self,sm``, device
choices...) as read by UCX when ucxx first starts in the process; ucxx keeps one
context per process. ``ucxx`` is imported only when a ucx receiver or sender is built:
importing it loads numpy, which the rest of ``common/`` never does.

Dead peer: when a sender's endpoint fails or closes, each live transfer that carried a
message on it fails at once ("sender connection lost"); ``send`` raises TransferError
when the receiver's endpoint fails.
"""

from __future__ import annotations

import asyncio
import collections
import os
import struct
from typing import NamedTuple

import structlog

from common.transfer import wire
from common.transfer.base import ChunkSink
from common.transfer.frame_reader import VERDICT_BATCH, VERDICT_BATCH_BYTES
from common.transfer.negotiate import BackendUnavailable
from common.transfer.table import TableReceiver, TransferTable
from common.transfer.tcp import format_address, parse_address

log = structlog.get_logger("pdserve.transfer")

SCHEME = "ucx://"
PACKAGE = "ucxx-cu12"
BATCH_LENGTH = struct.Struct("<I")
INLINE_BYTES = 1 << 20  # payloads up to this travel inside their run
RUN_BYTES = 4 << 20  # a run is posted once this full; larger only with a single message
_RUN_BUFFER_BYTES = BATCH_LENGTH.size + max(
    RUN_BYTES, wire.PREFIX.size + wire.MAX_HEADER_BYTES + INLINE_BYTES
)


def load_ucxx():
    """The ``ucxx`` module; BackendUnavailable (an ImportError) naming the package if it
    cannot be imported."""
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # ucxx sets a few itself
    try:
        import ucxx
    except Exception as exc:  # ImportError, or OSError from a missing shared library
        raise BackendUnavailable(
            "ucx",
            f"cannot import ucxx ({type(exc).__name__}: {exc}); install the 'ucx' "
            f"extra (pip install 'pdserve[ucx]', package {PACKAGE})",
            PACKAGE,
        ) from exc
    return ucxx


def parse_ucx_address(address: str) -> tuple[str, int]:
    """``"ucx://host:port"`` -> ``(host, port)``; ValueError if malformed."""
    if not isinstance(address, str) or not address.startswith(SCHEME):
        raise ValueError(f"not a ucx address (ucx://host:port): {address!r}")
    try:
        return parse_address("tcp://" + address[len(SCHEME) :])
    except ValueError:
        raise ValueError(f"not a ucx address (ucx://host:port): {address!r}") from None


class UcxReceiver(TableReceiver):
    """KVReceiver over UCX. Give ``sink`` or a ``table`` shared with other receivers
    (``multi.py``), not both. Raises BackendUnavailable if ucxx cannot be imported."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        sink: ChunkSink | None = None,
        table: TransferTable | None = None,
        max_payload_bytes: int = 1 << 30,
    ) -> None:
        if (sink is None) == (table is None):
            raise TypeError("give exactly one of sink and table")
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {port!r}")
        if max_payload_bytes <= 0:
            raise ValueError(f"max_payload_bytes must be > 0, got {max_payload_bytes}")
        self._ucxx = load_ucxx()
        self._host, self._port = host, port
        self.table = table if table is not None else TransferTable(sink)
        self.max_payload = max_payload_bytes
        self._listener = None
        self._endpoints: dict[object, asyncio.Task] = {}
        self._answering: set[asyncio.Future] = set()  # verdict batches being sent
        self._address: str | None = None
        self._closed = False

    @property
    def connections(self) -> int:
        return len(self._endpoints)

    def _serving(self) -> bool:
        return self._listener is not None and not self._closed

    async def start(self) -> None:
        if self._listener is not None or self._closed:
            raise RuntimeError("receiver already started" if self._listener else "receiver closed")
        self._listener = self._ucxx.create_listener(self._serve, port=self._port)
        port = self._listener.port
        self._address = format_address(self._host, port).replace("tcp://", SCHEME, 1)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.table.cancel_all("receiver closed")
        if self._answering:  # verdicts given deserve to arrive (a sender's finish waits)
            await asyncio.wait(self._answering, timeout=1.0)
        for ep in list(self._endpoints):
            ep.abort()  # fails the endpoint's pending receive; its task then ends
        await asyncio.gather(*self._endpoints.values(), return_exceptions=True)
        if self._listener is not None:
            self._listener.close()

    async def _serve(self, ep) -> None:
        if self._closed:
            ep.abort()
            return
        self._endpoints[ep] = asyncio.current_task()
        carried: set[str] = set()
        reason = "sender connection lost"
        try:
            await self._read_messages(ep, carried)
        except self._ucxx.exceptions.UCXError:
            pass
        except wire.WireError as exc:
            log.warning("kv_transfer.protocol_error", backend="ucx", error=str(exc))
            reason = f"sender protocol error: {exc}"
        except Exception as exc:  # ucxx raises a few non-UCX errors on a closed endpoint
            log.warning("kv_transfer.endpoint_failed", backend="ucx", error=repr(exc))
        finally:
            for rid in carried:
                self.table.fail(rid, reason)
            del self._endpoints[ep]
            if not ep.closed:
                ep.abort()

    async def _read_messages(self, ep, carried: set[str]) -> None:
        table, truncated = self.table, self._ucxx.exceptions.UCXMessageTruncatedError
        runs = [bytearray(_RUN_BUFFER_BYTES), bytearray(_RUN_BUFFER_BYTES)]  # by turns
        payloads = [bytearray(), bytearray()]  # by turns too
        answering = self._answering
        verdicts: list[bytes] = []  # encoded, not sent yet
        held = 0  # payload bytes they answer for
        run_turn = payload_turn = 0

        def flush() -> None:
            # One tagged message for the batch, posted now, in order (tasks start in
            # creation order).
            nonlocal held
            batch = b"".join(verdicts)
            answer = asyncio.ensure_future(ep.send(BATCH_LENGTH.pack(len(batch)) + batch))
            verdicts.clear()
            held = 0
            answering.add(answer)
            answer.add_done_callback(answering.discard)
            answer.add_done_callback(_consume)

        def take() -> None:
            """Queue the messages of the run just received, with the receive of a
            payload that follows them posted, then the next run's (tags match in
            posting order). The other run buffer is free by then: of the run it held,
            only a last message whose payload came on its own may not be applied yet.
            A message that breaks the spec queues its error after those before it."""
            nonlocal next_run, run_turn, payload_turn
            try:
                for kind, raw, size, inline in split_run(runs[run_turn]):
                    message = _decode_header(table, kind, raw)
                    rid = message.request_id
                    wanted = isinstance(message, wire.Chunk) and table.is_live(rid)
                    verdict = None
                    if wanted and size > self.max_payload:
                        limit = self.max_payload
                        reason = f"chunk of {size} bytes exceeds the {limit}-byte limit"
                        verdict = table.fail(rid, reason)
                        wanted = False
                    view, body = inline, None
                    if inline is None:  # it follows, received into a buffer of its own
                        view = memoryview(b"")
                        if wanted:
                            payload_turn ^= 1
                            if len(payloads[payload_turn]) < size:
                                # New, not resized: a view may be held.
                                payloads[payload_turn] = bytearray(size)
                            view = memoryview(payloads[payload_turn])[:size]
                        body = asyncio.ensure_future(ep.recv(view if wanted else bytearray(1)))
                    waiting.append(_Incoming(message, size, wanted, verdict, view, body))
            except wire.WireError as exc:
                waiting.append(exc)
                return
            run_turn ^= 1
            next_run = asyncio.ensure_future(ep.recv(runs[run_turn]))

        # What came and is not applied yet, in order; an error is raised when reached.
        waiting: collections.deque[_Incoming | Exception] = collections.deque()
        next_run = asyncio.ensure_future(ep.recv(runs[0]))
        item = None
        try:
            while True:
                if not waiting:
                    await next_run
                    take()
                item = waiting.popleft()
                if isinstance(item, Exception):
                    raise item
                message, size, wanted, verdict, view, body = item
                if body is not None:  # the last of its run: nothing else is waiting
                    try:
                        await body
                    except truncated:
                        if wanted:
                            raise
                    # The next run has usually come while this payload did: its
                    # payload's receive is then posted (into the other buffer) before
                    # this one is verified. Never waited for: the sender may send
                    # nothing more until it hears back.
                    if not next_run.done():
                        await asyncio.sleep(0)  # a completion may be queued behind us
                    if next_run.done():
                        try:
                            next_run.result()
                        except Exception as exc:
                            waiting.append(exc)  # after this message, which is whole
                        else:
                            take()
                if len(carried) > 4096:
                    carried.difference_update({r for r in carried if not table.is_live(r)})
                carried.add(message.request_id)
                if verdicts and not isinstance(message, wire.Chunk):
                    flush()  # first: the sender's finish waits for them
                applied = _dispatch(table, message, wanted, view, carried)
                verdict = verdict or applied
                if verdict is not None:
                    verdicts.append(wire.encode_verdict(verdict))
                    held += size
                    if (
                        wire.is_urgent(verdict, message)
                        or len(verdicts) >= VERDICT_BATCH
                        or held >= VERDICT_BATCH_BYTES
                    ):
                        flush()
        finally:
            left = (m for m in (item, *waiting) if isinstance(m, _Incoming))
            for posted in (next_run, *(m.body for m in left)):
                if posted is not None:
                    posted.cancel()
                    posted.add_done_callback(_consume)


def split_run(buffer: bytearray) -> list[tuple[wire.Kind, memoryview, int, memoryview | None]]:
    """The messages of the run at the start of ``buffer``, as ``(kind, header, payload
    length, payload)``; ``payload`` is None for one that follows on its own (the last
    message's only). WireError if the run does not follow the spec."""
    (length,) = BATCH_LENGTH.unpack_from(buffer)
    end = BATCH_LENGTH.size + length
    if length == 0 or end > len(buffer):
        limit = len(buffer) - BATCH_LENGTH.size
        raise wire.WireError(f"a run of {length} bytes, outside (0, {limit}]")
    view, offset, messages = memoryview(buffer), BATCH_LENGTH.size, []
    while offset < end:
        if messages and messages[-1][3] is None:
            raise wire.WireError("a message after one whose payload follows on its own")
        if end - offset < wire.PREFIX.size:
            raise wire.WireError("a run that ends inside a message")
        kind, header_len, size = wire.decode_prefix(view[offset : offset + wire.PREFIX.size])
        if kind is wire.Kind.VERDICT:
            raise wire.WireError("VERDICT goes from receiver to sender, not back")
        start = offset + wire.PREFIX.size
        offset = start + header_len
        payload = None
        if size <= INLINE_BYTES:
            payload, offset = view[offset : offset + size], offset + size
        if offset > end:
            raise wire.WireError("a run that ends inside a message")
        messages.append((kind, view[start : start + header_len], size, payload))
    return messages


class _Incoming(NamedTuple):
    message: wire.Message
    size: int  # of its payload
    wanted: bool  # its payload is received (else into one byte, and dropped)
    verdict: wire.Verdict | None  # given before its payload came
    view: memoryview  # where its payload is received
    body: asyncio.Future | None  # the payload's receive


def _consume(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: the endpoint's failure is handled by _serve


def _decode_header(table: TransferTable, kind: wire.Kind, raw: bytearray) -> wire.Message:
    try:
        return wire.decode_header(kind, raw)
    except wire.WireError as exc:
        if exc.request_id is not None:
            table.fail(exc.request_id, f"malformed message: {exc}")
        raise


def _dispatch(
    table: TransferTable, message, wanted: bool, view: memoryview, carried
) -> wire.Verdict | None:
    """Apply one message; a chunk's verdict (DROPPED when it was not ``wanted``)."""
    rid = message.request_id
    if isinstance(message, wire.Chunk):
        if wanted:
            return table.on_chunk(
                rid, message.layer, message.block_ids, view, message.checksum, message.attempt
            )
        table.drop(rid, "chunk")
        return wire.DROPPED
    if isinstance(message, wire.Finish):
        table.on_finish(rid, message.num_chunks)
    else:
        table.on_abort(rid, message.reason)
    carried.discard(rid)
