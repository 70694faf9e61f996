"""The data-plane interface: how KV bytes move from a prefill worker to a decode worker.

The decode side owns a ``KVReceiver``. Before asking for a remote prefill it calls
``expect(request_id, lease_s, token=secrets.token_bytes(16))`` and hands the receiver's
``address`` and the token to the prefill worker over the (authenticated) control plane.
The prefill side owns a ``KVSender`` and, per request::

    send(address, rid, layer, block_ids, payload, token=t)   per layer and run of blocks
    ...
    finish(address, rid, num_chunks, token=t)          or abort(address, rid, reason, token=t)

Anyone who can reach the receiver's port may send it messages; only those presenting the
transfer's token act on it (``table.py``), so a guessed request id is not enough.

Every chunk is checked end to end (xxh3_64 of its payload) and handed to the receiver's
``ChunkSink``, which copies it into the paged KV cache. The receiver answers each chunk
(``wire.py``: ok, dropped, resend, failed); a chunk that arrives corrupted is sent once
more, from the payload the sender kept; a FINISH that overtakes it waits for it. The
transfer ends exactly once::

    PENDING --first chunk--> TRANSFERRING --finish(n), n chunks verified--> DONE
       |                         |
       +-------------------------+--> FAILED     checksum mismatch on both attempts,
       |                         |               wrong chunk count, sender abort, lease
       |                         |               expired, sink raised, sender connection
       |                         |               lost mid-message
       +-------------------------+--> CANCELLED  cancel(), receiver closed

The first terminal state reached wins; anything that arrives afterwards is dropped.
A transfer may come from several senders (each tensor-parallel rank of a prefill
worker sends its KV heads' slice): its chunks carry their head slice (``wire.py``),
go to the receiver's ``SliceSink``, and one FINISH counts them all; the transfer is
DONE once that many have landed and every head of every block and layer is in.

This module imports neither torch nor numpy: payloads are bytes-like objects.
"""

from __future__ import annotations

import asyncio
import enum
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Protocol

ChunkSink = Callable[[str, int, list[int], memoryview], None]
"""``sink(request_id, layer, block_ids, payload)``.

Called on the receiver's event loop for each verified chunk of an expected, live
transfer, in arrival order. ``payload`` is valid only during the call (the receiver
reuses its buffer): copy what you keep. If the sink raises, that transfer fails with
the exception recorded as its error; the receiver keeps serving.
"""

SliceSink = Callable[[str, int, list[int], tuple[int, int, int], memoryview], None]
"""``sink(request_id, layer, block_ids, (head_start, head_count, total_heads), payload)``:
a ``ChunkSink`` for chunks that hold a slice of the KV heads; the same rules. It
raises (failing the transfer, writing nothing) for a slice that does not fit its layout.
"""


class LandingSink(Protocol):
    """A ``ChunkSink`` that can also name where a chunk's bytes belong, so a receiver
    that must copy them out of somewhere anyway (shm: the sender's segment) copies them
    there and hashes them in the same pass (``kernels/cpu_copysum.py``), instead of
    hashing them where they lie and the sink copying them after.

    ``landing(request_id, layer, block_ids, nbytes)``: writable buffers in the request's
    own reserved destination that, back to back, hold the chunk's ``nbytes`` bytes in
    payload order; or None to take this chunk through the call instead. Bytes written
    there are not yet the chunk's: they may be corrupt, and nothing may read them as
    KV (no prefix index, no pool write-back, no "KV complete") until ``landed(request_id,
    layer, block_ids, nbytes)`` says they were verified. A chunk that fails
    verification is never ``landed``: it is sent again into the same place, or the
    transfer fails as on any checksum mismatch. Either method raising fails the transfer
    as the call raising does. Backends without such a pass call the sink as usual.

    Optional, and what a receiver calls where a sink has them: the same two steps for a
    whole BATCH at once, ``landing_many(request_id, layers, block_ids, sizes)`` (every
    chunk's buffers, back to back in payload order, or None for the whole batch) and
    ``landed_many(request_id, layers, block_ids, sizes)``, the columns as ``batch.Batch``
    holds them (``landing.py``). One call each a batch instead of one each a chunk.
    """

    def __call__(self, request_id: str, layer: int, block_ids: list[int],
                 payload: memoryview) -> None: ...

    def landing(self, request_id: str, layer: int, block_ids: list[int],
                nbytes: int) -> list | None: ...

    def landed(self, request_id: str, layer: int, block_ids: list[int], nbytes: int) -> None: ...


class TransferState(enum.Enum):
    PENDING = "pending"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_live(self) -> bool:
        return self in (TransferState.PENDING, TransferState.TRANSFERRING)


_LIVE = frozenset((TransferState.PENDING, TransferState.TRANSFERRING))


class TransferError(RuntimeError):
    """A transfer failed or was cancelled, or a peer could not be reached.

    ``reason`` is the short cause ("lease expired", "checksum mismatch ...");
    ``request_id`` is set when the error concerns one request.
    """

    def __init__(self, reason: str, request_id: str | None = None) -> None:
        self.reason = reason
        self.request_id = request_id
        super().__init__(reason if request_id is None else f"transfer {request_id!r}: {reason}")


class Transfer:
    """One request's incoming KV on the receiving side.

    Created by ``KVReceiver.expect`` on the receiver's event loop; the lease timer starts
    then and is not renewed by progress. ``bytes_received`` and ``chunks_received`` count
    chunks that were verified and accepted by the sink. ``error`` is set when the state
    is FAILED or CANCELLED.

    Methods starting with an underscore are for receiver backends only.
    """

    def __init__(self, request_id: str, lease_s: float, on_end: Callable[[Transfer], None]) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if not (isinstance(lease_s, int | float) and math.isfinite(lease_s) and lease_s > 0):
            raise ValueError(f"lease_s must be a finite number > 0, got {lease_s!r}")
        loop = asyncio.get_running_loop()
        self.request_id = request_id
        self.state = TransferState.PENDING
        self.bytes_received = 0
        self.chunks_received = 0
        self.error: str | None = None
        self.token = b""  # set by expect: what its messages must present
        self._on_end = on_end
        self._ended = asyncio.Event()
        self._lease = loop.call_later(lease_s, self._end, TransferState.FAILED, "lease expired")

    @property
    def is_live(self) -> bool:
        return self.state.is_live

    async def wait(self) -> None:
        """Return once the transfer is DONE.

        Raises TransferError (with ``reason`` = ``error``) when it ends FAILED or
        CANCELLED, including when its lease expires. Never waits past the lease.
        """
        await self._ended.wait()
        if self.state is not TransferState.DONE:
            raise TransferError(self.error or self.state.value, self.request_id)

    def _accept_chunk(self, nbytes: int, count: int = 1) -> None:
        """Count ``count`` chunks of ``nbytes`` bytes in all as verified and taken."""
        if self.state in _LIVE:  # once a chunk: not through two properties
            self.state = TransferState.TRANSFERRING
            self.bytes_received += nbytes
            self.chunks_received += count

    def _end(self, state: TransferState, error: str | None = None) -> bool:
        """Move to terminal ``state``; False (and no change) if already ended."""
        if self.state not in _LIVE:  # once a transfer: not through two properties
            return False
        if state in _LIVE:
            raise ValueError(f"{state} is not a terminal state")
        self.state = state
        self.error = error
        self._lease.cancel()
        self._ended.set()
        self._on_end(self)
        return True

    def __repr__(self) -> str:
        return (
            f"Transfer({self.request_id!r}, {self.state.name}, chunks={self.chunks_received}, "
            f"bytes={self.bytes_received}, error={self.error!r})"
        )


class KVReceiver(ABC):
    """Accepts KV chunks from any number of senders and hands them to a ChunkSink.

    All methods run on one event loop, the one ``start`` ran on.
    """

    @property
    @abstractmethod
    def address(self) -> str:
        """What senders connect to, e.g. ``tcp://127.0.0.1:40123``.

        Raises RuntimeError before ``start``.
        """

    @abstractmethod
    async def start(self) -> None:
        """Bind and begin serving. Raises RuntimeError if called twice, OSError if the
        bind fails."""

    @abstractmethod
    async def close(self) -> None:
        """Cancel every live transfer (CANCELLED, "receiver closed") and close all
        sockets. Idempotent."""

    @abstractmethod
    def expect(self, request_id: str, lease_s: float, token: bytes) -> Transfer:
        """Register a transfer; call before any of its chunks can arrive. Only messages
        presenting ``token`` (1 to 64 bytes; draw it with ``secrets.token_bytes(16)``)
        act on the transfer; others are refused and counted (``refused``).

        Chunks for request ids that are not live (never expected, or already ended) are
        read, dropped and logged, never fatal. Raises ValueError if ``request_id`` is
        already live, ``lease_s`` is not > 0 or ``token`` is not 1 to 64 bytes,
        RuntimeError if the receiver is not serving. An id may be expected again once its
        previous transfer has ended.
        """

    @abstractmethod
    def cancel(self, request_id: str) -> None:
        """End the transfer CANCELLED: later chunks are dropped, ``wait`` raises.

        A no-op for ids that are not live.
        """

    @abstractmethod
    def live(self) -> int:
        """Number of PENDING or TRANSFERRING transfers."""

    @property
    def retried(self) -> int:
        """Chunks whose checksum did not match and that were asked for again."""
        return 0

    @property
    def refused(self) -> int:
        """Messages for a live transfer that did not present its token."""
        return 0


class KVSender(ABC):
    """Sends KV chunks to receivers, keeping one connection per address.

    Messages to one address arrive in the order their calls started writing; concurrent
    calls never interleave bytes of two messages. A connection that breaks is dropped
    and the next call reconnects. A call cancelled mid-write drops its connection too,
    so the receiver fails that message's transfer; one cancelled before it wrote (while
    waiting for its turn or for room) or after (its message is whole in the backend's
    hands) leaves the connection as it is.

    Raises TransferError when the receiver cannot be reached or the connection breaks,
    ValueError for a malformed address or argument. Returning from ``send`` means the
    chunk is on its way (tcp and shm: one under 1 MiB queued with the request's other
    chunks sent before the event loop's next turn, which then go as one BATCH,
    ``coalesce.py``; a larger one handed to the OS or staged in shared memory; ucx:
    posted to UCX); its verdict comes back later (so sends pipeline), and ``finish``
    returns once every chunk of the request has its final verdict. The receiver's
    ``Transfer`` is the authority on the outcome. ``resent`` counts chunks sent a second
    time.
    """

    resent: int = 0

    @abstractmethod
    async def send(
        self,
        address: str,
        request_id: str,
        layer: int,
        block_ids: list[int],
        payload: bytes | bytearray | memoryview,
        *,
        token: bytes,
        heads: tuple[int, int, int] = (0, 0, 0),
    ) -> None:
        """Send one chunk: ``payload`` holds ``layer``'s KV for ``block_ids``; ``token`` is
        the one the receiver expects the transfer with. ``heads`` ``(start, count,
        total)``: the payload is that slice of the KV heads (one tensor-parallel rank's),
        sent by each rank on its own connection, all counting towards one ``finish``
        (``wire.py``); the default, every head.

        ``payload`` must be C-contiguous. It is kept, not copied, until the receiver's
        verdict, since the chunk may have to go again: leave it unchanged until
        ``finish`` or ``abort`` for the request returns. If the receiver's checksum does
        not match, the chunk is sent again, once. Raises TransferError, with the
        receiver's reason, if an earlier chunk of the request failed there (a second
        checksum mismatch: "checksum mismatch ...", sink raised, too large) or its
        connection was lost.
        """

    async def send_many(
        self,
        address: str,
        request_id: str,
        chunks: list[tuple[int, list[int], bytes | bytearray | memoryview]],
        *,
        token: bytes,
    ) -> None:
        """Send several chunks of one request, ``(layer, block_ids, payload)`` each, as
        ``send`` would one by one (each counts as one chunk towards ``finish``; the same
        rules for payloads, resends and errors). Backends that can group them into
        batches (``batch.py``: one message, one verdict each) do; this default sends
        them one by one."""
        for layer, block_ids, payload in chunks:
            await self.send(address, request_id, layer, block_ids, payload, token=token)

    @abstractmethod
    async def finish(self, address: str, request_id: str, num_chunks: int, *,
                     token: bytes) -> None:
        """Declare the transfer complete after ``num_chunks`` chunks; return once every
        chunk sent has its final verdict. The receiver ends it DONE if it verified
        exactly that many, else FAILED ("expected N chunks, got M"). Raises
        TransferError with the receiver's reason if one of the request's chunks failed
        (the receiver's transfer is FAILED then)."""

    @abstractmethod
    async def abort(self, address: str, request_id: str, reason: str, *,
                    token: bytes) -> None:
        """Tell the receiver the transfer will not complete: it ends FAILED with
        ``reason``. Verdicts still to come for the request are ignored."""

    @abstractmethod
    async def close(self) -> None:
        """Close every connection it keeps. Idempotent; later calls raise TransferError."""
