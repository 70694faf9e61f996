"""Several backends behind one receiver and one sender, so that each sender can use the
best backend it shares with each receiver (``negotiate.py``).

``MultiReceiver`` serves every backend it was given at once, all feeding one
``TransferTable``: a transfer is expected once and its messages may arrive over any of
them. Messages are ordered only within one backend's connection, so a sender keeps each
transfer on one address.
``advert()`` is what the receiving peer publishes; ``address`` is the tcp one (or,
without tcp, the first it serves), for callers that know only one address.

``MultiSender`` sends to any address, dispatching on the scheme (``shm://``, ``ucx://``,
``tcp://``) to one sender per backend; ``address_for(advert)`` negotiates.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import structlog

from common.records import KVAdvert
from common.transfer.backends import backend_receiver, backend_sender
from common.transfer.base import (
    ChunkSink,
    KVReceiver,
    KVSender,
    SliceSink,
    Transfer,
    TransferError,
)
from common.transfer.negotiate import (
    PREFERENCE,
    BackendUnavailable,
    available_backends,
    choose,
    default_host_id,
    make_advert,
    scheme_of,
)
from common.transfer.table import TransferTable
from common.transfer.wire import WHOLE

log = structlog.get_logger("pdserve.transfer")


def _receiver(kind: str, host: str, port: int, table: TransferTable) -> KVReceiver:
    # shm's peers are on this host by definition: its control channel stays on loopback.
    return backend_receiver(kind, "127.0.0.1" if kind == "shm" else host, port, table=table)


class MultiReceiver(KVReceiver):
    """Serves ``kinds`` (default: ``available_backends()``) at once.

    ``port`` is the tcp backend's (the others pick free ports unless ``ports`` names
    one). With the default kinds a backend that turns out to be unavailable is logged
    once and left out; one named in ``kinds`` raises BackendUnavailable instead.
    """

    def __init__(
        self,
        kinds: Iterable[str] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        sink: ChunkSink,
        slice_sink: SliceSink | None = None,
        host_id: str | None = None,
        ports: Mapping[str, int] | None = None,
    ) -> None:
        strict = kinds is not None
        kinds = tuple(kinds) if strict else available_backends()
        unknown = set(kinds) - set(PREFERENCE)
        if unknown or not kinds:
            raise ValueError(f"kinds must be a non-empty subset of {PREFERENCE}, got {kinds}")
        ports = {"tcp": port, **(ports or {})}
        self.host_id = host_id or default_host_id()
        self._table = TransferTable(sink, slice_sink)
        self._receivers: dict[str, KVReceiver] = {}
        for kind in kinds:
            try:
                self._receivers[kind] = _receiver(kind, host, ports.get(kind, 0), self._table)
            except BackendUnavailable as exc:
                if strict:
                    raise
                log.warning("kv_transfer.backend_unavailable", kind=kind, error=str(exc))
        self._started = self._closed = False

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self._receivers)

    @property
    def address(self) -> str:
        receiver = self._receivers.get("tcp") or next(iter(self._receivers.values()))
        return receiver.address

    @property
    def dropped(self) -> int:
        return self._table.dropped

    @property
    def retried(self) -> int:
        return self._table.retried

    @property
    def refused(self) -> int:
        return self._table.refused

    def advert(self) -> KVAdvert:
        """Its ``KVAdvert`` (host id, one endpoint per kind); RuntimeError before start."""
        if not self._started:
            raise RuntimeError("receiver has no advert before start()")
        return make_advert(self.host_id, {k: r.address for k, r in self._receivers.items()})

    async def start(self) -> None:
        if self._started or self._closed:
            raise RuntimeError("receiver already started" if self._started else "receiver closed")
        self._started = True
        try:
            for receiver in self._receivers.values():
                await receiver.start()
        except BaseException:
            await self.close()
            raise
        log.info(
            "kv_transfer.receiver_started",
            host_id=self.host_id,
            endpoints={k: r.address for k, r in self._receivers.items()},
        )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._table.cancel_all("receiver closed")
        for receiver in self._receivers.values():
            await receiver.close()

    def expect(self, request_id: str, lease_s: float, token: bytes) -> Transfer:
        if not self._started or self._closed:
            raise RuntimeError("receiver is not serving (start() it; it must not be closed)")
        return self._table.expect(request_id, lease_s, token)

    def cancel(self, request_id: str) -> None:
        self._table.cancel(request_id)

    def live(self) -> int:
        return self._table.live()


class MultiSender(KVSender):
    """Sends over whichever backend an address names.

    ``backends`` (default: ``available_backends()``) are the kinds this side offers in
    negotiation; their senders are built at first use. ``forced`` makes
    ``address_for`` use that backend or raise.
    """

    def __init__(
        self,
        *,
        host_id: str | None = None,
        backends: Iterable[str] | None = None,
        forced: str | None = None,
    ) -> None:
        self.host_id = host_id or default_host_id()
        self.backends = tuple(backends) if backends is not None else available_backends()
        if forced is not None and forced not in PREFERENCE:
            raise ValueError(f"unknown transfer backend {forced!r}; known: {PREFERENCE}")
        self.forced = forced
        self._senders: dict[str, KVSender] = {}
        self._closed = False

    @property
    def resent(self) -> int:
        return sum(sender.resent for sender in self._senders.values())

    def address_for(self, peer_advert: KVAdvert) -> str:
        """Where to send to the advertising peer (see ``negotiate.choose``)."""
        return choose(self.host_id, self.backends, peer_advert, self.forced).address

    def sender(self, kind: str) -> KVSender:
        """This side's sender for ``kind``, built on first use.

        Raises BackendUnavailable if it cannot run here, TransferError once closed.
        """
        if self._closed:
            raise TransferError("sender is closed")
        sender = self._senders.get(kind)
        if sender is None:
            if kind not in self.backends:
                raise BackendUnavailable(kind, f"not among this sender's {self.backends}")
            sender = self._senders[kind] = backend_sender(kind)
        return sender

    async def send(self, address, request_id, layer, block_ids, payload, *,
                   token: bytes, heads: tuple[int, int, int] = WHOLE) -> None:
        await self.sender(scheme_of(address)).send(address, request_id, layer, block_ids,
                                                   payload, token=token, heads=heads)

    async def finish(self, address: str, request_id: str, num_chunks: int, *,
                     token: bytes) -> None:
        await self.sender(scheme_of(address)).finish(address, request_id, num_chunks,
                                                     token=token)

    async def abort(self, address: str, request_id: str, reason: str, *,
                    token: bytes) -> None:
        await self.sender(scheme_of(address)).abort(address, request_id, reason, token=token)

    async def close(self) -> None:
        self._closed = True
        for sender in self._senders.values():
            await sender.close()
