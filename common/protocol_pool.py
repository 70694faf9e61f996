"""The cache pool's control-plane messages (docs/cache_pool.md); part of the catalog that
:mod:`common.protocol` re-exports. Import them from there.

This module must never import torch or numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.codec import message
from common.records import KVAdvert

# --- cache pool (docs/cache_pool.md) -------------------------------------------------------
# Keys are 64-bit chained block hashes (``common.block_hash``), in prefix order.


@message("pool_put")
@dataclass(frozen=True, slots=True)
class PoolPut:
    """Pool client -> cache pool (DEALER -> ROUTER): store blocks ``keys``, each exactly
    ``block_bytes`` long.

    Without ``transfer_id`` the blocks come as bulk frames, one per key in order. Reply:
    Ack (``detail`` = how many blocks were new to the pool) or Error("bad_request").
    With ``transfer_id`` no frames: the pool expects that data-plane transfer for
    ``lease_s`` and replies PoolReady; the client sends the blocks to its ``kv_advert``
    and then asks for the outcome with PoolCommit."""

    keys: list[int]
    depths: list[int]
    block_bytes: int
    transfer_id: str = ""
    lease_s: float = 0.0


@message("pool_ready")
@dataclass(frozen=True, slots=True)
class PoolReady:
    """Cache pool -> client, the reply to a PoolPut with ``transfer_id``: the transfer is
    expected; send to ``kv_advert`` (the pool's data-plane receiver), presenting
    ``kv_token`` in every data-plane message of the transfer. No reply."""

    kv_advert: KVAdvert
    kv_token: bytes = b""


@message("pool_commit")
@dataclass(frozen=True, slots=True)
class PoolCommit:
    """Pool client -> cache pool (DEALER -> ROUTER), after the blocks of the PoolPut with
    ``transfer_id`` were sent (or, with ``abort``, could not be). Reply: Ack (``detail`` =
    how many blocks were new to the pool) once the transfer ended DONE and was stored;
    Error("transfer_failed") if it failed or was aborted; Error("not_found") for an
    unknown or already committed id."""

    transfer_id: str
    abort: str = ""


@message("pool_get")
@dataclass(frozen=True, slots=True)
class PoolGet:
    """Pool client -> cache pool (DEALER -> ROUTER). Reply: PoolBlocks or Error.

    With ``transfer_id`` the blocks travel on the data plane: the client has expected
    that transfer on the receiver ``kv_advert`` describes, and the pool sends each found
    block there within ``lease_s``, presenting ``kv_token`` (the transfer's token)."""

    keys: list[int]
    transfer_id: str = ""
    kv_advert: KVAdvert | None = None
    lease_s: float = 0.0
    kv_token: bytes = b""


@message("pool_blocks")
@dataclass(frozen=True, slots=True)
class PoolBlocks:
    """Cache pool -> client, the reply to PoolGet: the longest prefix of the asked keys
    that is present and readable, as ``found`` bulk frames in key order, or (for a
    PoolGet with ``transfer_id``) as ``found`` data-plane chunks sent after this reply.
    No reply."""

    found: int


@message("pool_exists")
@dataclass(frozen=True, slots=True)
class PoolExists:
    """Pool client -> cache pool (DEALER -> ROUTER). Reply: PoolFound or Error."""

    keys: list[int]


@message("pool_found")
@dataclass(frozen=True, slots=True)
class PoolFound:
    """Cache pool -> client, the reply to PoolExists: the longest held prefix and the
    tier ("dram" or "ssd") of each of its blocks. No reply."""

    found: int
    tiers: list[str]


@message("pool_remove")
@dataclass(frozen=True, slots=True)
class PoolRemove:
    """Pool client -> cache pool (DEALER -> ROUTER). Reply: Ack (``detail`` = how many
    were held) or Error."""

    keys: list[int]


@message("kv_event")
@dataclass(frozen=True, slots=True)
class KVEvent:
    """Worker or cache pool -> conductor (PUB -> SUB, topic b"kv"): blocks ``source``
    now holds ("stored"), no longer holds ("removed"), or "cleared" (it holds nothing;
    ``hashes`` is empty). No reply."""

    source: str
    kind: str
    hashes: list[int]
    tier: str = ""


@message("resync")
@dataclass(frozen=True, slots=True)
class Resync:
    """Conductor -> any holder of KV blocks (DEALER -> ROUTER). Reply: HeldBlocks."""


@message("held_blocks")
@dataclass(frozen=True, slots=True)
class HeldBlocks:
    """A holder of KV blocks -> conductor, the reply to Resync: every block ``source``
    holds, and the tier of each. No reply."""

    source: str
    hashes: list[int]
    tiers: list[str]
