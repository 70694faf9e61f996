"""Receiver-side bookkeeping shared by every backend: which transfers are live, and what
each incoming message does to them.

A backend only parses its wire and calls ``on_chunk`` / ``on_finish`` / ``on_abort`` /
``fail``; checksum verification, the sink call, state changes and each chunk's verdict
(``wire.Verdict``, which the backend sends back) happen here, so every backend ends
transfers for the same reasons with the same error strings.

Every transfer is expected with a ``token`` and takes only messages that present it
(``admits``, constant-time): any other is refused (``refused`` counts them) and changes nothing, not
even a failure, so a peer that guesses a request id can neither write into its blocks
nor end it. ``table_receiver.TableReceiver`` is the receiver around the table.
"""

from __future__ import annotations

import hmac
from collections import OrderedDict

import structlog

from common.transfer.base import ChunkSink, SliceSink, Transfer, TransferState
from common.transfer.batch import Batch
from common.transfer.landing import Landings
from common.transfer.slices import SliceLedger
from common.transfer.wire import DROPPED, MAX_ATTEMPTS, OK, WHOLE, Status, Verdict, checksum

log = structlog.get_logger("pdserve.transfer")

_REMEMBER_ENDED = 4096


class TransferTable:
    """The live transfers of one receiver. Runs on the receiver's event loop only.

    ``dropped`` counts messages for request ids that were not live when they arrived;
    ``retried`` counts chunks whose checksum did not match and that were asked for again;
    ``refused`` messages for a live transfer that did not present its token.
    """

    def __init__(self, sink: ChunkSink, slice_sink: SliceSink | None = None) -> None:
        if not callable(sink):
            raise TypeError(f"sink must be callable, got {sink!r}")
        self._sink = sink
        # A sink that offers destinations (base.LandingSink) has a chunk copied into them
        # and hashed in the same pass where the backend can (``scatter``), instead.
        # Asked once a batch, not once a chunk (``landing.py``).
        self._landings = Landings.of(sink)
        self.lands = self._landings is not None  # whether a backend's fused pass is of use
        self._slice_sink = slice_sink  # None: head slices are refused
        # Per live transfer sent as head slices (slices.py): the heads landed so far.
        self._slices: dict[str, SliceLedger] = {}
        self._live: dict[str, Transfer] = {}
        # Only to tell "late" from "never expected" in logs; bounded.
        self._ended: OrderedDict[str, TransferState] = OrderedDict()
        self.dropped = 0
        self.retried = 0
        self.refused = 0
        self._tokens: dict[str, bytes] = {}  # of every live transfer
        # Per live transfer: chunks asked for again and not back yet, and the chunk
        # count of a FINISH that arrived before them (it is settled once they are in).
        self._resends_due: dict[str, int] = {}
        self._finish_due: dict[str, int] = {}
        # Called at each expect: a backend whose receives wait less eagerly while no
        # transfer is expected (ucx.py's Pacer) hurries them.
        self.on_expect: list = []

    def expect(self, request_id: str, lease_s: float, token: bytes) -> Transfer:
        if request_id in self._live:
            raise ValueError(f"transfer {request_id!r} is already expected")
        if not (isinstance(token, bytes) and 0 < len(token) <= 64):
            raise ValueError("token must be 1 to 64 bytes")
        transfer = Transfer(request_id, lease_s, self._forget)
        self._live[request_id] = transfer
        self._tokens[request_id] = transfer.token = token
        self._ended.pop(request_id, None)
        for hook in self.on_expect:
            hook()
        return transfer

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        transfer = self._live.get(request_id)
        if transfer is not None:
            transfer._end(TransferState.CANCELLED, reason)

    def fail(self, request_id: str, reason: str) -> Verdict:
        """End ``request_id`` FAILED with ``reason`` if it is live; the verdict for the
        chunk that caused it."""
        transfer = self._live.get(request_id)
        if transfer is not None:
            transfer._end(TransferState.FAILED, reason)
        return Verdict(Status.FAILED, reason)

    def cancel_all(self, reason: str) -> None:
        for transfer in list(self._live.values()):
            transfer._end(TransferState.CANCELLED, reason)

    def live(self) -> int:
        return len(self._live)

    def is_live(self, request_id: str) -> bool:
        return request_id in self._live

    def admits(self, request_id: str, token: bytes) -> bool:
        """Whether a message for ``request_id`` presenting ``token`` may act on it: the
        transfer is live and was expected with this token. A live transfer's wrong token
        is counted in ``refused`` and logged."""
        if request_id not in self._live:
            return False
        if hmac.compare_digest(self._tokens[request_id], token):
            return True
        self.refused += 1
        log.warning("kv_transfer.refused_bad_token", request_id=request_id)
        return False

    def fail_untokened(self, request_id: str, reason: str) -> Verdict:
        """``fail`` for a message whose token could not be read (a malformed header): it
        cannot speak for a live transfer (refused and counted), only answer FAILED."""
        if request_id in self._tokens:
            self.refused += 1
            log.warning("kv_transfer.refused_malformed", request_id=request_id, reason=reason)
            return Verdict(Status.FAILED, reason)
        return self.fail(request_id, reason)

    def on_chunk(
        self,
        request_id: str,
        layer: int,
        block_ids: list[int],
        payload: memoryview,
        expected_checksum: int,
        attempt: int = 0,
        token: bytes = b"",
        heads: tuple[int, int, int] = WHOLE,
        actual: int | None = None,
        scatter=None,
    ) -> Verdict:
        """Verify one chunk and hand it to the sink; ``payload`` is borrowed for the call.
        ``actual``: the payload's checksum where the receiver hashed it as it came in
        (its own bytes, not the sender's word), else it is hashed here. ``scatter(payload,
        destinations)``: copies the payload into a ``LandingSink``'s destinations and
        returns the digest of what landed (the shm receiver's fused pass), else None.

        A checksum mismatch on any attempt but the last asks for the chunk again and
        leaves the transfer as it was; on the last attempt it fails the transfer. A chunk
        the transfer does not ``admit`` is dropped.
        """
        transfer = self._live.get(request_id)
        if transfer is None or not self.admits(request_id, token):
            if transfer is None:
                self.drop(request_id, "chunk")
            return DROPPED
        if heads != WHOLE or request_id in self._slices:
            verdict = self._verify_slice(transfer, layer, block_ids, payload,
                                         expected_checksum, attempt, heads)
        elif attempt == 0:  # the usual chunk: straight back
            return self._verify(transfer, layer, block_ids, payload, expected_checksum, 0,
                                actual, scatter)
        else:
            verdict = self._verify(transfer, layer, block_ids, payload, expected_checksum,
                                   attempt, actual, scatter)
        if attempt:
            self._resent_in(transfer)
        elif request_id in self._finish_due and request_id not in self._resends_due \
                and transfer.is_live:  # a FINISH waits for other ranks' slices
            self._settle(transfer, self._finish_due.pop(request_id))
        return verdict

    def _verify_slice(self, transfer: Transfer, layer: int, block_ids: list[int],
                      payload: memoryview, expected: int, attempt: int,
                      heads: tuple[int, int, int]) -> Verdict:
        """``_verify`` for a chunk holding a slice of the heads: refused, before the sink
        sees it, when it overlaps a slice already landed, or in a transfer of whole
        chunks."""
        request_id = transfer.request_id
        ledger = self._slices.get(request_id)
        if heads == WHOLE or (ledger is None and transfer.chunks_received):
            return self.fail(request_id, "a transfer mixes head slices and whole chunks")
        if self._slice_sink is None:
            return self.fail(request_id, "this receiver takes no head slices")
        if ledger is None:
            ledger = self._slices[request_id] = SliceLedger(heads[2])
        refused = ledger.refuse(layer, block_ids, heads)
        if refused:
            return self.fail(request_id, refused)
        actual = checksum(payload)
        if actual != expected:
            return self._mismatch(transfer, layer, block_ids, expected, actual, attempt)
        try:
            self._slice_sink(request_id, layer, block_ids, heads, payload)
        except Exception as exc:
            return self._sink_raised(request_id, layer, exc)
        ledger.land(layer, block_ids, heads)
        transfer._accept_chunk(payload.nbytes)
        return OK

    def on_batch(self, batch: Batch, payload: memoryview | None, actual: int | None = None,
                 scatter=None) -> Verdict:
        """Verify a BATCH's chunks (``batch.py``) and hand each to the sink, in order;
        ``payload`` (their bytes back to back) is borrowed for the call. Its one checksum
        is checked before the first sink call: a mismatch asks for the whole batch again
        (or fails the transfer on the last attempt) having changed nothing but the bytes
        of a ``LandingSink``'s destinations, never ``landed``. ``actual``, ``scatter`` as
        for ``on_chunk``; no ``payload``: the bytes are where ``where`` named, ``actual``
        their digest (the tcp receiver read them there)."""
        request_id = batch.request_id
        transfer = self._live.get(request_id)
        if transfer is None or not self.admits(request_id, batch.token):
            if transfer is None:
                self.drop(request_id, "batch")
            return DROPPED
        if request_id in self._slices:
            return self.fail(request_id, "a transfer mixes head slices and whole chunks")
        landed = payload is None  # whether the bytes are where the sink wants them
        if actual is None and scatter is not None and self.lands:
            try:
                actual = self._scatter(request_id, batch.layers, batch.block_ids,
                                       batch.sizes, payload, scatter)
            except Exception as exc:
                return self._sink_raised(request_id, batch.layers[0], exc)
            landed = actual is not None
        if actual is None:
            actual = checksum(payload)  # one pass over every byte the batch holds
        if actual != batch.checksum:
            layers = batch.layers
            verdict = self._mismatch(transfer, layers[0], batch.block_ids[0], batch.checksum,
                                     actual, batch.attempt,
                                     f"layers {layers[0]}..{layers[-1]} ({len(layers)} chunks)")
        elif landed:  # in place already: one word to the sink for the whole batch
            try:
                self._landings.landed(request_id, batch.layers, batch.block_ids, batch.sizes)
            except Exception as exc:
                verdict = self._sink_raised(request_id, batch.layers[0], exc)
            else:
                verdict = OK
                transfer._accept_chunk(sum(batch.sizes), len(batch.layers))
        else:
            verdict = OK
            take, layers, blocks, i, start = self._sink, batch.layers, batch.block_ids, 0, 0
            try:
                for i, size in enumerate(batch.sizes):
                    take(request_id, layers[i], blocks[i], payload[start : start + size])
                    start += size
            except Exception as exc:
                transfer._accept_chunk(start, i)  # those it took before raising
                log.exception("kv_transfer.sink_raised", request_id=request_id,
                              layer=layers[i])
                verdict = self.fail(request_id, f"sink raised {type(exc).__name__}: {exc}")
            else:
                transfer._accept_chunk(start, len(layers))  # once for the batch
        if batch.attempt:
            self._resent_in(transfer)
        return verdict

    def _resent_in(self, transfer: Transfer) -> None:
        """A chunk or batch that was asked for again is in: settle a FINISH that waits
        for the last of them."""
        request_id = transfer.request_id
        due = self._resends_due.get(request_id, 0) - 1
        if due > 0:
            self._resends_due[request_id] = due
        else:
            self._resends_due.pop(request_id, None)
            if request_id in self._finish_due and transfer.is_live:
                self._settle(transfer, self._finish_due.pop(request_id))

    def _verify(self, transfer: Transfer, layer: int, block_ids: list[int],
                payload: memoryview, expected_checksum: int, attempt: int,
                actual: int | None = None, scatter=None) -> Verdict:
        request_id = transfer.request_id
        take = self._sink
        if actual is None and scatter is not None and self.lands:
            try:
                actual = self._scatter(request_id, [layer], [block_ids], [payload.nbytes],
                                       payload, scatter)
            except Exception as exc:
                return self._sink_raised(request_id, layer, exc)
            take = self._take_landed if actual is not None else take
        if actual is None:
            actual = checksum(payload)
        if actual != expected_checksum:
            return self._mismatch(transfer, layer, block_ids, expected_checksum, actual, attempt)
        try:
            take(request_id, layer, block_ids, payload)
        except Exception as exc:
            return self._sink_raised(request_id, layer, exc)
        transfer._accept_chunk(payload.nbytes)
        return OK

    def where(self, batch: Batch) -> list | None:
        """The sink's destinations for ``batch`` (admitted), or None where it names none;
        raising as the sink did (the caller fails the transfer)."""
        landings, b = self._landings, batch
        return None if landings is None else \
            landings.where(b.request_id, b.layers, b.block_ids, b.sizes)

    def _scatter(self, request_id: str, layers: list[int], block_ids: list[list[int]],
                 sizes: list[int], payload: memoryview, scatter) -> int | None:
        """The digest of ``payload`` as ``scatter`` landed it where the sink names, or
        None, having copied nothing, where it declines (its call takes the chunks)."""
        destinations = self._landings.where(request_id, layers, block_ids, sizes)
        return None if destinations is None else scatter(payload, destinations)

    def _take_landed(self, request_id: str, layer: int, block_ids: list[int],
                     payload: memoryview) -> None:  # a verified chunk, in place already
        self._landings.landed(request_id, [layer], [block_ids], [payload.nbytes])

    def _sink_raised(self, request_id: str, layer: int, exc: Exception) -> Verdict:
        log.exception("kv_transfer.sink_raised", request_id=request_id, layer=layer)
        return self.fail(request_id, f"sink raised {type(exc).__name__}: {exc}")

    def _mismatch(self, transfer: Transfer, layer: int, block_ids: list[int], expected: int,
                  actual: int, attempt: int, where: str | None = None) -> Verdict:
        request_id = transfer.request_id
        where = where or f"layer {layer} blocks {block_ids}"
        reason = (f"checksum mismatch on {where}: "
                  f"expected {expected:#018x}, got {actual:#018x}")
        if attempt + 1 < MAX_ATTEMPTS:
            self.retried += 1
            self._resends_due[request_id] = self._resends_due.get(request_id, 0) + 1
            log.warning("kv_transfer.chunk_resend", request_id=request_id, layer=layer,
                        reason=reason)
            return Verdict(Status.RESEND, reason)
        return self.fail(request_id, f"{reason} (attempt {attempt + 1} of {MAX_ATTEMPTS})")

    def on_finish(self, request_id: str, num_chunks: int, token: bytes = b"") -> None:
        """Settle the transfer, or, while chunks it was asked to resend are due (they come
        after the FINISH that the sender did not hold back), once they are in."""
        transfer = self._live.get(request_id)
        if transfer is None:
            self.drop(request_id, "finish")
        elif not self.admits(request_id, token):
            return  # refused and counted
        elif request_id in self._resends_due:
            self._finish_due[request_id] = num_chunks
        else:
            self._settle(transfer, num_chunks)

    def _settle(self, transfer: Transfer, num_chunks: int) -> None:
        ledger = self._slices.get(transfer.request_id)
        waits = ledger is not None or (self._slice_sink is not None
                                       and not transfer.chunks_received)
        if waits and transfer.chunks_received < num_chunks:
            # Other ranks' slices come on their own connections: wait for them (within
            # the lease), also before the first: a FINISH may come from a rank that
            # sent this receiver no slice.
            self._finish_due[transfer.request_id] = num_chunks
        elif ledger is not None and transfer.chunks_received == num_chunks:
            missing = ledger.missing()
            if missing:
                self.fail(transfer.request_id, f"head slices missing: {missing}")
            else:
                transfer._end(TransferState.DONE)
        elif transfer.chunks_received == num_chunks:
            transfer._end(TransferState.DONE)
        else:
            self.fail(
                transfer.request_id, f"expected {num_chunks} chunks, got {transfer.chunks_received}"
            )

    def on_abort(self, request_id: str, reason: str, token: bytes = b"") -> None:
        if request_id not in self._live:
            self.drop(request_id, "abort")
        elif self.admits(request_id, token):
            self.fail(request_id, reason)

    def drop(self, request_id: str, what: str) -> None:
        """Record a message for a request id that is not live."""
        self.dropped += 1
        ended = self._ended.get(request_id)
        if ended is None:
            log.warning("kv_transfer.dropped_unknown", request_id=request_id, message=what)
        else:
            log.debug(
                "kv_transfer.dropped_late", request_id=request_id, message=what, state=ended.value
            )

    def _forget(self, transfer: Transfer) -> None:
        if self._live.get(transfer.request_id) is transfer:
            del self._live[transfer.request_id]
            self._resends_due.pop(transfer.request_id, None)
            self._finish_due.pop(transfer.request_id, None)
            self._slices.pop(transfer.request_id, None)
            self._tokens.pop(transfer.request_id, None)
        self._ended[transfer.request_id] = transfer.state
        # One logger method looked up (each lookup on the module's lazy logger binds one),
        # and none built for the other two states.
        state = transfer.state
        emit = log.debug if state is TransferState.DONE else \
            log.warning if state is TransferState.FAILED else log.info
        emit(
            "kv_transfer.ended",
            request_id=transfer.request_id,
            state=transfer.state.value,
            error=transfer.error,
            chunks=transfer.chunks_received,
            bytes=transfer.bytes_received,
        )
        while len(self._ended) > _REMEMBER_ENDED:
            self._ended.popitem(last=False)
