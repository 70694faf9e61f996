"""What every backend's sender shares: per-address connections, dialled once and reused
while they work, and what becomes of each chunk once its verdict comes back.

A chunk's life on the sending side::

    send ──write attempt 0──► returns (the payload is kept, not copied)
                                 │ verdict
          ok / dropped ◄─────────┤
          resend ──write attempt 1 (same bytes, same checksum)──► verdict ──► as above,
                                 │                                 but resend counts
          failed / connection lost ──► the request is failed here: its next send and
                                       its finish raise TransferError with the reason

    finish ──FINISH──► waits until every chunk of the request has its final verdict
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import structlog

from common.transfer import batch, fault_hook, wire
from common.transfer.base import KVSender, TransferError
from common.transfer.coalesce import COALESCE_BYTES, Coalescer

log = structlog.get_logger("pdserve.transfer")

_REMEMBER_REQUESTS = 4096


class _Request:
    """One request's chunks awaiting their verdicts, and its failure once there is one."""

    __slots__ = ("pending", "failed", "settled")

    def __init__(self) -> None:
        self.pending = 0
        self.failed: str | None = None
        self.settled: asyncio.Future | None = None  # made by finish while chunks pend

    def fail(self, reason: str) -> None:
        self.failed = self.failed or reason

    def settle(self) -> None:
        self.pending -= 1
        if not self.pending and self.settled is not None and not self.settled.done():
            self.settled.set_result(None)

    async def wait(self) -> None:
        if self.pending:
            self.settled = asyncio.get_running_loop().create_future()
            await self.settled


class InFlight:
    """One attempt of a chunk, written and waiting for its verdict.

    A backend's ``_post`` sets ``claimed`` (the checksum it announces) before writing
    and keeps the attempt until it calls ``answered(verdict)`` with the receiver's
    verdict or ``lost(reason)`` when the connection goes first; the first of those
    calls counts. It holds ``view``, the bytes this attempt sends, and ``source``, the
    caller's payload (the same but under a test-only fault hook), until then: a resend
    needs the bytes.
    """

    __slots__ = ("sender", "address", "request", "chunk", "view", "nbytes", "claimed", "over",
                 "source")

    def __init__(self, sender, address, request, chunk, view, claimed=None,
                 source=None, nbytes=None) -> None:
        self.sender, self.address, self.request = sender, address, request
        self.chunk: wire.Chunk | batch.Batch = chunk
        # A batch's payloads are a list of views, its claimed checksum their whole one.
        self.view: memoryview | list[memoryview] = view
        if nbytes is None:  # else known to the caller
            nbytes = view.nbytes if type(view) is memoryview else sum(v.nbytes for v in view)
        self.nbytes = nbytes
        # What the caller gave: the same as view, except under a test-only fault hook.
        self.source = view if source is None else source
        self.claimed = claimed
        self.over = False

    def answered(self, verdict: wire.Verdict) -> None:
        if self.over:
            return
        self.over = True
        status = verdict.status
        if status is wire.Status.OK or status is wire.Status.DROPPED:
            self.request.settle()
        elif status is wire.Status.RESEND and self.chunk.attempt + 1 < wire.MAX_ATTEMPTS:
            self.sender._resend(self, verdict.reason)
        else:
            self.request.fail(verdict.reason)
            self.request.settle()

    def lost(self, reason: str) -> None:
        if not self.over:
            self.over = True
            self.request.fail(reason)
            self.request.settle()


class ConnectionSender(KVSender):
    """A sender keeping one connection per receiver address.

    The subclass implements ``_dial(address)``, ``_drop(address, conn)``, ``_post``
    (write one attempt of a chunk, return the future of its verdict) and ``_write_end``
    (write a FINISH or ABORT); its connections, in ``_conns`` by address, answer
    ``usable()``; its ``close`` sets ``_closed`` and calls ``_stop_resending``.
    Concurrent callers for one address share a single dial; a broken connection is
    dropped and replaced on the next call.
    """

    def __init__(self) -> None:
        self._conns: dict[str, Any] = {}
        self._dialing: dict[str, asyncio.Lock] = {}
        self._closed = False
        self._requests: dict[str, _Request] = {}
        self._resending: set[asyncio.Task] = set()
        self._corrupt = fault_hook.from_env()  # None unless a test asks for spoiled KV
        # Small chunks queued per receiver and request, posted as one BATCH at the next
        # turn (coalesce.py); not under the fault hook, which spoils single chunks.
        coalesce = self.BATCHES and self._corrupt is None
        self._coalescer = Coalescer(self._start, self._connection) if coalesce else None

    async def _dial(self, address: str) -> Any:
        raise NotImplementedError

    def _drop(self, address: str, conn: Any) -> None:
        raise NotImplementedError

    async def _post(self, attempt: InFlight) -> None:
        """Write ``attempt.chunk`` (validated, but for its checksum) with its payload
        ``attempt.view``, announcing ``attempt.claimed`` or, if None, the checksum it
        computes and stores there; then hand ``attempt`` its verdict (see InFlight).

        If it raises, the caller tells ``attempt`` it is lost.
        """
        raise NotImplementedError

    async def _write_end(self, address: str, message: wire.Finish | wire.Abort) -> None:
        raise NotImplementedError

    async def _connection(self, address: str) -> Any:
        conn = self._conns.get(address)
        if conn is not None and conn.usable():
            return conn
        async with self._dialing.setdefault(address, asyncio.Lock()):
            conn = self._conns.get(address)
            if conn is not None and conn.usable():
                return conn
            if conn is not None:
                self._drop(address, conn)
            if self._closed:
                raise TransferError("sender is closed")
            conn = self._conns[address] = await self._dial(address)
            return conn

    async def send(self, address, request_id, layer, block_ids, payload, *,
                   token: bytes, heads: tuple[int, int, int] = wire.WHOLE) -> None:
        view = byte_view(payload)
        if not isinstance(block_ids, list | tuple):
            raise ValueError(f"block_ids must be a list of integers, got {block_ids!r}")
        chunk = wire.Chunk(request_id, layer, list(block_ids), 0, 0, token, tuple(heads))
        wire.validate(chunk)
        request = self._request(request_id)  # as _start, without its await: once a chunk
        if request.failed is not None:
            raise TransferError(request.failed, request_id)
        if self._coalescer is not None:
            # A BATCH carries whole chunks only: a head slice goes on its own.
            if view.nbytes < COALESCE_BYTES and chunk.heads == wire.WHOLE:
                await self._coalescer.add(address, request_id, layer, chunk.block_ids, view,
                                          token)
                return
            await self._coalescer.flush(address, request_id)  # what came before goes first
            if request.failed is not None:
                raise TransferError(request.failed, request_id)
        request.pending += 1
        sent, claimed = (view, None) if self._corrupt is None else \
            self._corrupt.apply(view, 0)
        attempt = InFlight(self, address, request, chunk, sent, claimed, view)
        try:
            await self._post(attempt)
        except BaseException as exc:
            attempt.lost(getattr(exc, "reason", None) or repr(exc))
            raise

    BATCHES = False  # whether _post takes a Batch (its view: a list of payloads)
    BATCH_BYTES = batch.MAX_BYTES  # send_many's batches hold at most this many bytes

    async def send_many(self, address, request_id, chunks, *, token: bytes) -> None:
        items = _items(chunks, self.BATCH_BYTES)
        probe = wire.Chunk(request_id, 0, [], 0, 0, token)
        wire.validate(probe)  # the request id and token, once
        if not self.BATCHES:
            for layer, blocks, view in items:
                await self.send(address, request_id, layer, blocks, view, token=token)
            return
        if self._coalescer is not None and self._coalescer.busy:
            await self._coalescer.flush(address, request_id)  # what send queued goes first
        if type(items) is batch.Run:  # the usual request: one batch, its columns already built
            layers, blocks, views, sizes = items.layers, items.blocks, items.views, items.sizes
            message = batch.Batch(request_id, layers, [blocks] * len(layers), 0, sizes, 0,
                                  token)
            await self._start(address, request_id, message, views, sum(sizes))
            return
        for run in batch.groups(items, self.BATCH_BYTES):
            if len(run) == 1:
                layer, blocks, view = run[0]
                await self.send(address, request_id, layer, blocks, view, token=token)
                continue
            message = batch.Batch(request_id, [i[0] for i in run], [i[1] for i in run], 0,
                                  [i[2].nbytes for i in run], 0, token)
            await self._start(address, request_id, message, [i[2] for i in run])

    async def _start(self, address, request_id, message, view, nbytes=None) -> None:
        request = self._request(request_id)
        if request.failed is not None:
            raise TransferError(request.failed, request_id)
        request.pending += 1
        attempt = InFlight(self, address, request, message, view, nbytes=nbytes)
        try:
            await self._post(attempt)
        except BaseException as exc:
            attempt.lost(getattr(exc, "reason", None) or repr(exc))
            raise

    async def finish(self, address: str, request_id: str, num_chunks: int, *,
                     token: bytes) -> None:
        message = wire.Finish(request_id, num_chunks, token)
        wire.validate(message)
        if self._coalescer is not None and self._coalescer.busy:
            await self._coalescer.flush(address, request_id)  # the FINISH comes after them
        request = self._requests.pop(request_id, None)
        if request is not None and request.failed is not None:
            raise TransferError(request.failed, request_id)
        # Not held back for the verdicts: the receiver settles the transfer only once
        # the chunks it asked for again are in, and flushes its verdicts on a FINISH.
        await self._write_end(address, message)
        if request is not None:
            await request.wait()
            if request.failed is not None:
                raise TransferError(request.failed, request_id)

    async def abort(self, address: str, request_id: str, reason: str, *,
                    token: bytes) -> None:
        message = wire.Abort(request_id, reason, token)
        wire.validate(message)
        if self._coalescer is not None:  # what send queued goes, as it would have
            await self._coalescer.flush(address, request_id)
        self._requests.pop(request_id, None)
        await self._write_end(address, message)

    def _request(self, request_id: str) -> _Request:
        request = self._requests.get(request_id)
        if request is None:
            if len(self._requests) >= _REMEMBER_REQUESTS:  # never finished nor aborted
                for rid in [r for r, q in self._requests.items() if not q.pending]:
                    del self._requests[rid]
            request = self._requests[request_id] = _Request()
        return request

    def _resend(self, attempt: InFlight, reason: str) -> None:
        self.resent += 1
        log.warning("kv_transfer.chunk_resent", request_id=attempt.chunk.request_id, reason=reason)
        chunk = attempt.chunk._replace(attempt=attempt.chunk.attempt + 1)
        # The test-only fault hook spoils single chunks; a batch is resent as it was.
        sent = attempt.source if self._corrupt is None or type(attempt.source) is list \
            else self._corrupt.apply(attempt.source, chunk.attempt)[0]
        again = InFlight(self, attempt.address, attempt.request, chunk, sent,
                         attempt.claimed, attempt.source)
        task = asyncio.ensure_future(self._post_again(again))
        self._resending.add(task)
        task.add_done_callback(self._resending.discard)

    async def _post_again(self, attempt: InFlight) -> None:
        try:
            await self._post(attempt)
        except BaseException as exc:
            attempt.lost(getattr(exc, "reason", None) or repr(exc))
            if not isinstance(exc, Exception):
                raise

    async def _stop_resending(self) -> None:
        if self._coalescer is not None:
            await self._coalescer.close()
        tasks = list(self._resending)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def byte_view(payload: bytes | bytearray | memoryview) -> memoryview:
    """``payload`` as a flat memoryview of bytes; TypeError / ValueError if it cannot be."""
    try:
        view = memoryview(payload)
    except TypeError:
        raise TypeError(f"payload must be bytes-like, got {type(payload).__name__}") from None
    if not view.c_contiguous:
        raise ValueError("payload must be C-contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class StreamSender(ConnectionSender):
    """A connection sender that writes every message as a head plus an optional payload
    through ``_write(address, request_id, head, payload, attempt)`` (tcp, ucx): the
    chunk and end messages are built here once for both."""

    @property
    def connections(self) -> int:
        """Connections kept that are still usable (the peer has not closed them)."""
        return sum(conn.usable() for conn in self._conns.values())

    async def _write(self, address: str, request_id: str, head: bytes,
                     payload: memoryview | None = None,
                     attempt: InFlight | None = None) -> None:
        raise NotImplementedError

    async def _post(self, attempt: InFlight) -> None:
        view = attempt.view
        if type(view) is list:  # a Batch
            if attempt.claimed is None:
                attempt.claimed = batch.checksum(view)
            head = batch.encode(attempt.chunk, attempt.claimed, attempt.nbytes)
            head = wire.PREFIX.pack(wire.MAGIC, wire.VERSION, wire.Kind.BATCH, 0, len(head),
                                    attempt.nbytes) + head
            await self._write(attempt.address, attempt.chunk.request_id, head, view, attempt)
            return
        if attempt.claimed is None:
            attempt.claimed = wire.checksum(view)
        head = wire.encode_chunk_message(attempt.chunk, attempt.claimed, view.nbytes)
        await self._write(attempt.address, attempt.chunk.request_id, head, view, attempt)

    async def _write_end(self, address: str, message: wire.Finish | wire.Abort) -> None:
        await self._write(address, message.request_id, wire.encode(message), None)


def _items(items: list, max_bytes: int = batch.MAX_BYTES,
           ) -> batch.Run | list[tuple[int, list[int], memoryview]]:
    """``send_many``'s chunks as ``(layer, block_ids, payload view)``; ValueError or
    TypeError for anything a single ``send`` would refuse. Checked for the whole list at
    once where it can be (a request's layers: 30 chunks of plain ints sharing one block
    list), one by one otherwise, with the same errors. The usual case, whole-list checked
    and within one batch of ``max_bytes``, comes back as a ``batch.Run`` of columns: no
    tuple per chunk built and then taken apart again."""
    if not isinstance(items, list | tuple) or not items:
        raise ValueError("chunks must be a non-empty list of (layer, block_ids, payload)")
    columns = None
    if set(map(type, items)) <= _TUPLE:
        # Not all of three fields (ValueError): checked one by one below, with its error.
        with contextlib.suppress(ValueError):
            columns = tuple(zip(*items, strict=True))
    if columns is not None and len(columns) == 3:
        layers, blocks, payloads = columns
        shared = blocks[0]
        # One block list (or equal ones) for all: counted at C speed, by identity mostly.
        if (wire._are_uints(layers) and isinstance(shared, list | tuple)
                and _all_same(blocks, shared) and wire._are_uints(shared)):
            shared = list(shared)
            views = list(payloads) if batch.flat_views(payloads) else list(map(_flat, payloads))
            sizes = list(map(batch.NBYTES, views))
            if 1 < len(views) <= batch.MAX_CHUNKS and sum(sizes) <= max_bytes:
                return batch.Run(list(layers), shared, views, sizes)
            return list(zip(layers, [shared] * len(views), views, strict=True))
    checked, seen, runs = [], None, None
    for item in items:
        if not isinstance(item, tuple | list) or len(item) != 3:
            raise ValueError(f"each chunk must be (layer, block_ids, payload), got {item!r:.80}")
        layer, blocks, payload = item
        if not wire._is_uint(layer):
            raise wire.WireError(f"layer must be an integer >= 0, got {layer!r}")
        if blocks is not seen:  # a request's layers mostly share one list: checked once
            if not isinstance(blocks, list | tuple) or not wire._are_uints(list(blocks)):
                raise wire.WireError(
                    f"block_ids must be a list of integers >= 0, got {blocks!r:.80}")
            seen, runs = blocks, list(blocks)
        checked.append((layer, runs, byte_view(payload)))
    return checked


_TUPLE = frozenset({tuple})


def _all_same(values: tuple, first) -> bool:
    """Whether all ``values`` are (or equal) ``first``; False where comparing raises."""
    try:
        return values.count(first) == len(values)
    except (TypeError, ValueError):
        return False


def _flat(payload) -> memoryview:
    """``byte_view``, without a new view for one that is already flat bytes."""
    if type(payload) is memoryview and payload.format == "B" and payload.ndim == 1 \
            and payload.c_contiguous:
        return payload
    return byte_view(payload)
