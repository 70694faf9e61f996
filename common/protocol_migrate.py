"""Moving a running request, with its KV, from a stopping decode worker to another; part
of the catalog that :mod:`common.protocol` re-exports. Import them from there.

    stopping worker W                      target worker T               gateway
      ListWorkers ──► conductor (a live decode worker of the same layout)
      Migrate ─────────────────────────────► reserve blocks, expect KV
             ◄──────────────────── MigrateReady (block ids, token, advert)
      KV, one payload per layer ══ data plane ══► written into the blocks
      MigrateDone ─────────────────────────► adopt: decode from the next position
             ◄──────────────────────────────────── Ack     tokens ──────────► (same rid)
      StreamMoved ──────────────────────────────────────────────────────────► follows T

Any failure before T acknowledges MigrateDone leaves the request with W, which hands it
back to its gateway (``WORKER_LEAVING``: recomputed elsewhere); nothing is lost.

This module must never import torch or numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.codec import message
from common.records import KVAdvert, SamplingParams


@message("migrate")
@dataclass(frozen=True, slots=True)
class Migrate:
    """Stopping decode worker -> another decode worker (DEALER -> ROUTER), under the
    request id its gateway knows: take over this running request. Reply: MigrateReady,
    or Error ("overloaded" when its blocks are not free, "unavailable" when it stops
    too, "bad_request")."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far on the sender, in this stream
    sampling: SamplingParams  # the request's, unchanged: max_tokens counts the output too
    stream_addr: str
    start_position: int  # stream position of output_token_ids[0]
    source_id: str
    cache_salt: str | None = None
    cached_tokens: int = 0  # prompt tokens served from cache at admission, for usage


@message("migrate_ready")
@dataclass(frozen=True, slots=True)
class MigrateReady:
    """Target -> stopping worker, the reply to Migrate: blocks reserved, KV expected for
    ``lease_s``. No reply."""

    block_ids: list[int]  # the target's blocks for every token but the last
    skip_blocks: int  # leading blocks the target already holds: not sent
    lease_s: float
    kv_advert: KVAdvert | None = None
    kv_token: bytes = b""  # the transfer's secret; empty when no block is to be sent


@message("migrate_done")
@dataclass(frozen=True, slots=True)
class MigrateDone:
    """Stopping worker -> target (DEALER -> ROUTER), once every layer is sent: adopt the
    request. Reply: Ack ("adopted": it decodes and streams from here), or Error."""

    num_chunks: int = 0


@message("stream_moved")
@dataclass(frozen=True, slots=True)
class StreamMoved:
    """Stopping decode worker -> gateway (PUSH -> PULL), under the request id: the
    stream continues on ``worker_id`` from ``position``, with its KV (nothing is
    recomputed). Aborts and liveness checks follow it there. No reply."""

    worker_id: str
    control_addr: str
    position: int
