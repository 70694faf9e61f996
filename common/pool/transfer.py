"""Cache-pool blocks on the data plane (``common/transfer``), for both ends: the pool
client's data-plane carrier (``common.pool.data_plane``) and the cache-pool process.

Control stays on ZeroMQ (``pool_put`` / ``pool_commit`` / ``pool_get``, see
docs/cache_pool.md); the block bytes of one call are one data-plane transfer, named by a
``transfer_id`` the client draws::

    chunk   request_id = transfer_id, layer 0, block_ids = [i], payload = block i of
            the call (i indexes the call's keys), checksummed by the data plane
    finish  num_chunks = the number of blocks sent, once every chunk was acknowledged

The receiving end ``open``s a transfer in its ``BlockInbox`` (which ``expect``s it on its
receiver, with a fresh token) before the sender can learn its id and token (they travel
in PoolReady / PoolGet over the authenticated control plane; every chunk, the finish and
an abort present the token, see ``common/transfer/wire.py``), and always ``take``s or
``discard``s it afterwards, whatever the outcome: a transfer that fails, is cancelled or
outlives its lease leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Sequence

from common.pool.keys import Buffer
from common.pool.landing import LandingArenas
from common.transfer import KVReceiver, KVSender, Transfer, TransferError

WINDOW = 8
"""Chunks one ``send_blocks`` keeps unacknowledged: enough to keep a connection busy
while earlier verdicts travel back, few enough to stay inside the shm ring."""

ABORT_TIMEOUT_S = 1.0
UCX_CHUNK_BYTES = 8 << 20


class BlockInbox:
    """The blocks of the open transfers of one receiver; ``sink`` is its ChunkSink.

    ``open`` reserves ``count`` slots under a transfer id; the sink copies each verified
    chunk into the slots its ``block_ids`` name (a chunk may carry several equal blocks)
    and fails the transfer for an index out of range, a slot filled twice, or a block of
    the wrong size. Runs on the receiver's event loop only.

    Each block becomes its own ``bytes``, or, given ``arenas``, a view into one arena
    per transfer (taken at its first chunk, ``count`` blocks of that chunk's size), for
    an end that copies the blocks on and drops them (a client into its KV cache, the
    pool into its tiers).
    """

    def __init__(self, arenas: LandingArenas | None = None) -> None:
        self.arenas = arenas
        # transfer id -> (slots, block size or 0 before the first chunk, landing view)
        self._open: dict[str, tuple[list[Buffer | None], int, memoryview | None]] = {}

    def __len__(self) -> int:
        return len(self._open)

    def open(self, receiver: KVReceiver, transfer_id: str, count: int, block_bytes: int,
             lease_s: float) -> Transfer:
        """Expect ``transfer_id`` on ``receiver`` for ``lease_s`` with room for ``count``
        blocks of ``block_bytes`` (0: any size, equal within the transfer), under a fresh
        token (``Transfer.token``: the sender must present it). Raises as
        ``KVReceiver.expect`` does (ValueError for an id already live)."""
        if transfer_id in self._open:
            raise ValueError(f"transfer {transfer_id!r} is already open")
        transfer = receiver.expect(transfer_id, lease_s, token=secrets.token_bytes(16))
        self._open[transfer_id] = ([None] * count, block_bytes, None)
        return transfer

    def sink(self, request_id: str, layer: int, block_ids: list[int],
             payload: memoryview) -> None:
        entry = self._open.get(request_id)
        if entry is None:
            raise ValueError(f"no pool transfer {request_id!r} is open")
        slots, size, land = entry
        n = len(block_ids)
        if layer != 0 or n == 0 or not payload.nbytes or payload.nbytes % n:
            raise ValueError(f"a chunk of {payload.nbytes} bytes for layer {layer} cannot "
                             f"hold blocks {block_ids[:4]}")
        each = payload.nbytes // n
        size = size or each  # 0: the first chunk sets it
        if each != size:
            raise ValueError(f"blocks of {each} bytes in a transfer of {size}-byte blocks")
        for i in block_ids:
            if not 0 <= i < len(slots) or slots[i] is not None:
                raise ValueError(f"block index {i} is out of range or sent twice")
        if n > 1 and len(set(block_ids)) != n:
            raise ValueError(f"block indices {block_ids[:4]} are sent twice in one chunk")
        if self.arenas is not None and land is None:
            land = self.arenas.take(len(slots) * size)
        self._open[request_id] = (slots, size, land)
        for j, i in enumerate(block_ids):
            piece = payload[j * each:(j + 1) * each]
            if land is None:
                slots[i] = bytes(piece)
            else:
                slot = land[i * size:(i + 1) * size]
                slot[:] = piece
                slots[i] = slot

    def take(self, transfer_id: str, count: int) -> list[Buffer] | None:
        """Close ``transfer_id``: its first ``count`` blocks if exactly those arrived,
        else None."""
        entry = self._open.pop(transfer_id, None)
        if entry is None:
            return None
        slots = entry[0]
        head, tail = slots[:count], slots[count:]
        if len(head) != count or any(b is None for b in head) or any(b is not None for b in tail):
            return None
        return head

    def discard(self, transfer_id: str) -> None:
        self._open.pop(transfer_id, None)


async def send_blocks(sender: KVSender, address: str, transfer_id: str,
                      blocks: Sequence[Buffer], window: int | None = None, *,
                      token: bytes = b"") -> None:
    """Send ``blocks[i]`` as chunk ``[i]`` with up to ``window`` (default ``WINDOW``)
    chunks unacknowledged, then ``finish``, each presenting the receiver's ``token``. On
    failure, tells the receiver (``abort``, best effort) and raises TransferError; a
    cancelled call aborts too."""
    window = window or WINDOW
    per_chunk = _blocks_per_chunk(address, blocks)
    runs = [(list(range(i, min(i + per_chunk, len(blocks)))), i)
            for i in range(0, len(blocks), per_chunk)]
    pending = iter(runs)

    async def lane() -> None:
        for ids, first in pending:  # shared: each lane takes the next run
            payload = blocks[first] if len(ids) == 1 else b"".join(
                blocks[first:first + len(ids)])
            await sender.send(address, transfer_id, 0, ids, payload, token=token)

    lanes = [asyncio.ensure_future(lane()) for _ in range(min(window, len(runs)))]
    try:
        try:
            await asyncio.gather(*lanes)
            await sender.finish(address, transfer_id, len(runs), token=token)
        except OSError as exc:
            raise TransferError(f"{type(exc).__name__}: {exc}", transfer_id) from exc
    except BaseException as exc:
        for task in lanes:
            task.cancel()
        await asyncio.gather(*lanes, return_exceptions=True)
        await abort_quietly(sender, address, transfer_id, _reason(exc), token)
        raise


async def abort_quietly(sender: KVSender, address: str, transfer_id: str, reason: str,
                        token: bytes = b"") -> None:
    """``sender.abort``, giving up silently after ``ABORT_TIMEOUT_S`` or on any error: the
    receiver's lease ends the transfer anyway."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(ABORT_TIMEOUT_S):
            await sender.abort(address, transfer_id, reason, token=token)


def _blocks_per_chunk(address: str, blocks: Sequence[Buffer]) -> int:
    """1, except on ucx: UCX over TCP pays a fixed cost per message (~2 ms) that dwarfs a
    720 KiB block, so runs of blocks go as one chunk of about UCX_CHUNK_BYTES (a copy,
    cheap beside that cost). tcp and shm stream one block per chunk with no copy."""
    if not address.startswith("ucx") or not blocks:
        return 1
    return max(1, UCX_CHUNK_BYTES // max(1, len(blocks[0])))


def _reason(exc: BaseException) -> str:
    if isinstance(exc, TransferError):
        return exc.reason
    if isinstance(exc, asyncio.CancelledError | TimeoutError):
        return "sender gave up"
    return f"{type(exc).__name__}: {exc}"
