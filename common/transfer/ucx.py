"""The ucx backend: UCX through ``ucxx`` (the optional extra ``pdserve[ucx]``, package
``ucxx-cu12``). UCX picks the transport itself: RDMA where the hardware has it, else its
own TCP and shared-memory transports (CPU-only hosts included). The sender is in
``ucx_sender.py``.

Address: ``ucx://host:port``, the port of a ucxx listener. The listener binds every
interface (ucxx offers no bind address); ``host`` is only what the receiver advertises.

Each message is sent on the sender's endpoint as tagged messages, in order: its head
(the ``wire.py`` prefix and msgpack header, one message) then, for a chunk with bytes,
its payload. The receiver keeps a head receive posted (into a buffer of the largest
head the spec allows; the prefix says how much arrived), and on each head posts the
payload's receive, of the size the prefix announced, straight into a buffer reused for
the connection (grown, never shrunk), then the next head's. A payload nobody wants is
received into one byte and its truncation ignored. Verdicts go back on the same
endpoint, in chunk order, batched as the tcp receiver does (``frame_reader.py``), a
batch to a tagged message: its length (u32, little-endian) then its VERDICT messages
(prefix and header each) back to back. The sender keeps a receive posted for them.

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
import os
import struct

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
_HEAD_BYTES = wire.PREFIX.size + wire.MAX_HEADER_BYTES
BATCH_LENGTH = struct.Struct("<I")


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
        head, payload = bytearray(_HEAD_BYTES), bytearray()
        answering = self._answering
        verdicts: list[bytes] = []  # encoded, not sent yet
        held = 0  # payload bytes they answer for

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

        next_head = asyncio.ensure_future(ep.recv(head))
        try:
            while True:
                await next_head
                kind, header_len, size = wire.decode_prefix(head[: wire.PREFIX.size])
                if kind is wire.Kind.VERDICT:
                    raise wire.WireError("VERDICT goes from receiver to sender, not back")
                message = _decode_header(table, kind, head[wire.PREFIX.size :][:header_len])
                rid = message.request_id
                if len(carried) > 4096:
                    carried -= {r for r in carried if not table.is_live(r)}
                carried.add(rid)
                wanted = isinstance(message, wire.Chunk) and table.is_live(rid)
                verdict = None
                if wanted and size > self.max_payload:
                    limit = self.max_payload
                    reason = f"chunk of {size} bytes exceeds the {limit}-byte limit"
                    verdict = table.fail(rid, reason)
                    wanted = False
                view = memoryview(b"")
                if wanted and size:
                    if len(payload) < size:
                        payload = bytearray(size)  # new, not resized: a view may be held
                    view = memoryview(payload)[:size]
                # The payload's receive is posted before the next head's (tags match in
                # posting order), and the next head is then already waiting.
                body = None
                if size:
                    body = asyncio.ensure_future(ep.recv(view if wanted else bytearray(1)))
                next_head = asyncio.ensure_future(ep.recv(head))
                if body is not None:
                    try:
                        await body
                    except truncated:
                        if wanted:
                            raise
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
            next_head.cancel()
            next_head.add_done_callback(_consume)


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
