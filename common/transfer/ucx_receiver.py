"""Receiving side of the ucx backend (protocol and configuration: ``ucx.py``).

Bind address: libucxx binds a listener to one host, but ucxx's Python API
(``create_listener``, up to at least 0.52) takes only a port, so the listener is on
every interface whatever host is configured. Where the installed ucxx takes a host
(``ip_address``), the configured one is passed; otherwise a specific host is logged as
not honoured (``kv_transfer.ucx_listens_on_every_interface``), so that an operator
who needs the data plane on one interface knows to choose the tcp backend there."""

from __future__ import annotations

import asyncio
import collections
import inspect
from typing import NamedTuple

import structlog

from common.address import is_wildcard
from common.transfer import wire
from common.transfer.frame_reader import VERDICT_BATCH, VERDICT_BATCH_BYTES
from common.transfer.table import TransferTable
from common.transfer.table_receiver import TableReceiver
from common.transfer.ucx import (
    BATCH_LENGTH,
    RUN_BUFFER_BYTES,
    SCHEME,
    Pacer,
    load_ucxx,
    receive,
    split_run,
)

log = structlog.get_logger("pdserve.transfer")


class UcxReceiver(TableReceiver):
    """KVReceiver over UCX. Give ``sink`` or a ``table`` shared with other receivers
    (``multi.py``), not both. Raises BackendUnavailable if ucxx cannot be imported."""

    SCHEME = SCHEME

    def __init__(self, host: str = "127.0.0.1", port: int = 0, **common) -> None:
        """``common``: ``TableReceiver``'s sink, table and max_payload_bytes."""
        super().__init__(host, port, **common)
        self._ucxx = load_ucxx()
        self._listener = None
        self._answering: set[asyncio.Future] = set()  # verdict batches being sent
        self._pacer = Pacer(lambda: self.table.live() > 0)
        self.table.on_expect.append(self._pacer.wake)

    async def _listen(self) -> int:
        create = self._ucxx.create_listener
        if "ip_address" in inspect.signature(create).parameters:
            self._listener = create(self._serve, port=self._port, ip_address=self._host)
        else:
            self._listener = create(self._serve, port=self._port)
            if not is_wildcard(self._host):
                log.warning("kv_transfer.ucx_listens_on_every_interface", host=self._host,
                            port=self._listener.port,
                            reason="this ucxx's create_listener takes no host")
        return self._listener.port

    async def _stop(self) -> None:
        if self._pacer.wake in self.table.on_expect:  # a shared table outlives us
            self.table.on_expect.remove(self._pacer.wake)
        if self._answering:  # verdicts given deserve to arrive (a sender's finish waits)
            await asyncio.wait(self._answering, timeout=1.0)
        for ep in list(self._connections):
            ep.abort()  # fails the endpoint's pending receive; its task then ends
        await asyncio.gather(*self._connections.values(), return_exceptions=True)
        if self._listener is not None:
            self._listener.close()

    async def _serve(self, ep) -> None:
        if self._closed:
            ep.abort()
            return
        self._track(ep, asyncio.current_task())
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
            self._untrack(ep)
            if not ep.closed:
                ep.abort()

    async def _read_messages(self, ep, carried: set[str]) -> None:
        table, truncated = self.table, self._ucxx.exceptions.UCXMessageTruncatedError
        runs = [bytearray(RUN_BUFFER_BYTES), bytearray(RUN_BUFFER_BYTES)]  # by turns
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
                    wanted = isinstance(message, wire.Chunk) and table.admits(rid, message.token)
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
            next_run = asyncio.ensure_future(receive(ep, runs[run_turn], self._pacer))

        # What came and is not applied yet, in order; an error is raised when reached.
        waiting: collections.deque[_Incoming | Exception] = collections.deque()
        next_run = asyncio.ensure_future(receive(ep, runs[0], self._pacer))
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
                if wanted:  # a chunk its transfer admitted: losing the sender ends it
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
            table.fail_untokened(exc.request_id, f"malformed message: {exc}")
        raise


def _dispatch(
    table: TransferTable, message, wanted: bool, view: memoryview, carried
) -> wire.Verdict | None:
    """Apply one message; a chunk's verdict (DROPPED when it was not ``wanted``)."""
    rid = message.request_id
    if isinstance(message, wire.Chunk):
        if wanted:
            return table.on_chunk(rid, message.layer, message.block_ids, view,
                                  message.checksum, message.attempt, message.token,
                                  message.heads)
        if not table.is_live(rid):  # else refused by admits, and counted there
            table.drop(rid, "chunk")
        return wire.DROPPED
    if isinstance(message, wire.Finish):
        table.on_finish(rid, message.num_chunks, message.token)
    else:
        table.on_abort(rid, message.reason, message.token)
    carried.discard(rid)
