"""The receiver around a ``TransferTable`` (``table.py``): its checks, start, serving
and close, the same for every backend, which adds only its wire."""

from __future__ import annotations

from common.address import format_address
from common.transfer.base import ChunkSink, KVReceiver, Transfer
from common.transfer.table import TransferTable


class TableReceiver(KVReceiver):
    """What every backend's receiver shares: its constructor's checks, its transfers in
    ``self.table``, the sender connections it serves, and start / idempotent close.

    Give ``sink``, or a ``table`` shared with other receivers (``multi.py``), not both.
    A backend sets ``SCHEME`` and implements its wire: ``_listen`` binds and begins
    serving and returns the port it got; ``_stop`` stops listening and ends every
    connection (the table's transfers are cancelled by then). Each sender connection is
    registered with ``_track`` while it lasts and removed with ``_untrack``.
    """

    SCHEME: str

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
        self._host, self._port = host, port
        self.table = table if table is not None else TransferTable(sink)
        self.max_payload = max_payload_bytes
        # Sender connection -> what its backend keeps with it (ucx: its task).
        self._connections: dict[object, object] = {}
        self._address: str | None = None
        self._listening = False
        self._closed = False

    async def _listen(self) -> int:
        raise NotImplementedError

    async def _stop(self) -> None:
        raise NotImplementedError

    @property
    def connections(self) -> int:
        """Sender connections open right now."""
        return len(self._connections)

    def _track(self, connection: object, kept: object = None) -> None:
        self._connections[connection] = kept

    def _untrack(self, connection: object) -> None:
        self._connections.pop(connection, None)

    def _serving(self) -> bool:
        return self._listening and not self._closed

    async def start(self) -> None:
        if self._listening or self._closed:
            raise RuntimeError("receiver already started" if self._listening else "receiver closed")
        port = await self._listen()
        self._listening = True
        self._address = format_address(self.SCHEME, self._host, port)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.table.cancel_all("receiver closed")
        await self._stop()

    @property
    def address(self) -> str:
        if self._address is None:
            raise RuntimeError("receiver has no address before start()")
        return self._address

    @property
    def dropped(self) -> int:
        return self.table.dropped

    @property
    def retried(self) -> int:
        return self.table.retried

    @property
    def refused(self) -> int:
        return self.table.refused

    def expect(self, request_id: str, lease_s: float, token: bytes) -> Transfer:
        if not self._serving():
            raise RuntimeError("receiver is not serving (start() it; it must not be closed)")
        return self.table.expect(request_id, lease_s, token)

    def cancel(self, request_id: str) -> None:
        self.table.cancel(request_id)

    def live(self) -> int:
        return self.table.live()
