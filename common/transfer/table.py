"""Receiver-side bookkeeping shared by every backend: which transfers are live, and what
each incoming message does to them.

A backend only parses its wire and calls ``on_chunk`` / ``on_finish`` / ``on_abort`` /
``fail``; checksum verification, the sink call and state changes happen here, so every
backend ends transfers for the same reasons with the same error strings.
"""

from __future__ import annotations

from collections import OrderedDict

import structlog

from common.transfer.base import ChunkSink, KVReceiver, Transfer, TransferState
from common.transfer.wire import checksum

log = structlog.get_logger("pdserve.transfer")

_REMEMBER_ENDED = 4096


class TransferTable:
    """The live transfers of one receiver. Runs on the receiver's event loop only.

    ``dropped`` counts messages for request ids that were not live when they arrived.
    """

    def __init__(self, sink: ChunkSink) -> None:
        if not callable(sink):
            raise TypeError(f"sink must be callable, got {sink!r}")
        self._sink = sink
        self._live: dict[str, Transfer] = {}
        # Only to tell "late" from "never expected" in logs; bounded.
        self._ended: OrderedDict[str, TransferState] = OrderedDict()
        self.dropped = 0

    def expect(self, request_id: str, lease_s: float) -> Transfer:
        if request_id in self._live:
            raise ValueError(f"transfer {request_id!r} is already expected")
        transfer = Transfer(request_id, lease_s, self._forget)
        self._live[request_id] = transfer
        self._ended.pop(request_id, None)
        return transfer

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        transfer = self._live.get(request_id)
        if transfer is not None:
            transfer._end(TransferState.CANCELLED, reason)

    def fail(self, request_id: str, reason: str) -> None:
        """End ``request_id`` FAILED with ``reason`` if it is live."""
        transfer = self._live.get(request_id)
        if transfer is not None:
            transfer._end(TransferState.FAILED, reason)

    def cancel_all(self, reason: str) -> None:
        for transfer in list(self._live.values()):
            transfer._end(TransferState.CANCELLED, reason)

    def live(self) -> int:
        return len(self._live)

    def is_live(self, request_id: str) -> bool:
        return request_id in self._live

    def on_chunk(
        self,
        request_id: str,
        layer: int,
        block_ids: list[int],
        payload: memoryview,
        expected_checksum: int,
    ) -> None:
        """Verify one chunk and hand it to the sink; ``payload`` is borrowed for the call."""
        transfer = self._live.get(request_id)
        if transfer is None:
            self.drop(request_id, "chunk")
            return
        actual = checksum(payload)
        if actual != expected_checksum:
            self.fail(
                request_id,
                f"checksum mismatch on layer {layer} blocks {block_ids}: "
                f"expected {expected_checksum:#018x}, got {actual:#018x}",
            )
            return
        try:
            self._sink(request_id, layer, block_ids, payload)
        except Exception as exc:
            log.exception("kv_transfer.sink_raised", request_id=request_id, layer=layer)
            self.fail(request_id, f"sink raised {type(exc).__name__}: {exc}")
            return
        transfer._accept_chunk(payload.nbytes)

    def on_finish(self, request_id: str, num_chunks: int) -> None:
        transfer = self._live.get(request_id)
        if transfer is None:
            self.drop(request_id, "finish")
        elif transfer.chunks_received == num_chunks:
            transfer._end(TransferState.DONE)
        else:
            self.fail(request_id, f"expected {num_chunks} chunks, got {transfer.chunks_received}")

    def on_abort(self, request_id: str, reason: str) -> None:
        if request_id in self._live:
            self.fail(request_id, reason)
        else:
            self.drop(request_id, "abort")

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
        self._ended[transfer.request_id] = transfer.state
        emit = {TransferState.DONE: log.debug, TransferState.FAILED: log.warning}.get(
            transfer.state, log.info
        )
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


class TableReceiver(KVReceiver):
    """What every backend's receiver shares: its transfers live in ``self.table``.

    A subclass sets ``self.table`` and, once listening, ``self._address``, and says
    whether it is serving (started and not closed) through ``_serving``.
    """

    table: TransferTable
    _address: str | None = None

    def _serving(self) -> bool:
        raise NotImplementedError

    @property
    def address(self) -> str:
        if self._address is None:
            raise RuntimeError("receiver has no address before start()")
        return self._address

    @property
    def dropped(self) -> int:
        return self.table.dropped

    def expect(self, request_id: str, lease_s: float) -> Transfer:
        if not self._serving():
            raise RuntimeError("receiver is not serving (start() it; it must not be closed)")
        return self.table.expect(request_id, lease_s)

    def cancel(self, request_id: str) -> None:
        self.table.cancel(request_id)

    def live(self) -> int:
        return self.table.live()
