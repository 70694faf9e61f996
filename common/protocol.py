"""The control plane's messages: every record two processes exchange.

``docs/protocol.md`` is the written spec; ``tests/test_protocol.py`` checks that it and
the records below agree field for field, so change both together. The wire format and
the codec that enforces each record's field types live in :mod:`common.codec`, whose
names are re-exported here so that callers need only this module.

This module must never import torch or numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.codec import (
    ERROR_CODES,
    MAX_BULK_FRAME_BYTES,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Envelope,
    Message,
    ProtocolError,
    decode,
    encode,
    message,
    registry,
)

__all__ = [
    "ERROR_CODES", "MAX_BULK_FRAME_BYTES", "MAX_FRAME_BYTES", "PROTOCOL_VERSION",
    "Envelope", "Message", "ProtocolError", "decode", "encode", "message", "registry",
]

# --- the record catalog ------------------------------------------------------------------
# Each docstring: sender -> receiver, socket pattern, and the reply to expect.


@message("error")
@dataclass(frozen=True, slots=True)
class Error:
    """Any server -> the requester, as the reply to a request that failed.

    ``code`` is a ProtocolError code, "internal" for a handler failure, or a
    service-specific code (see docs/protocol.md). ``retry_after_s`` comes with
    "overloaded": when the request may be tried again. No reply.
    """

    code: str
    message: str
    retry_after_s: float | None = None


@message("ack")
@dataclass(frozen=True, slots=True)
class Ack:
    """Any server -> the requester: the request was accepted. No reply."""

    detail: str = ""


@message("hello")
@dataclass(frozen=True, slots=True)
class Hello:
    """Worker -> conductor (DEALER -> ROUTER) to register. Reply: Welcome or Error."""

    worker_id: str
    role: str
    model: str
    control_addr: str
    kv_addr: str
    host_id: str
    block_size: int
    num_blocks: int
    fingerprint: str


@message("welcome")
@dataclass(frozen=True, slots=True)
class Welcome:
    """Conductor -> worker, the reply to Hello. No reply."""

    conductor_id: str
    heartbeat_interval_s: float


@message("heartbeat")
@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Worker -> conductor (PUB -> SUB, topic b"heartbeat"), every interval. No reply."""

    worker_id: str
    role: str
    seq: int
    waiting: int
    running: int
    queued_prefill_tokens: int
    free_blocks: int
    total_blocks: int
    step_time_ms: float
    control_addr: str = ""
    prefill_steps: list[dict] = field(default_factory=list)
    decode_steps: list[dict] = field(default_factory=list)


@message("route")
@dataclass(frozen=True, slots=True)
class Route:
    """Gateway -> conductor (DEALER -> ROUTER). Reply: RouteReply, or Error to reject
    ("overloaded" with ``retry_after_s`` when admission refuses it)."""

    model: str
    prompt_len: int
    block_hashes: list[int] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    slo_ttft_ms: float | None = None
    slo_tbt_ms: float | None = None
    max_tokens: int = 0


@message("route_reply")
@dataclass(frozen=True, slots=True)
class RouteReply:
    """Conductor -> gateway, the reply to Route. No prefill worker: prefill locally."""

    decode_id: str
    decode_addr: str
    prefill_id: str | None
    prefill_addr: str | None
    reason: str


@message("generate")
@dataclass(frozen=True, slots=True)
class Generate:
    """Gateway -> decode worker (DEALER -> ROUTER). Reply: Ack once admitted, or Error.

    Tokens then flow to ``stream_addr`` (PUSH -> PULL) under the same request id.
    """

    prompt_token_ids: list[int]
    sampling: dict
    stream_addr: str
    prefill_id: str | None = None
    prefill_addr: str | None = None
    cache_salt: str | None = None
    start_position: int = 0


@message("prefill")
@dataclass(frozen=True, slots=True)
class Prefill:
    """Decode worker -> prefill worker (DEALER -> ROUTER). Reply: PrefillDone or Error.

    The reply comes once the KV is fully sent; no reply within ``lease_s`` means the
    decode worker recomputes locally.
    """

    prompt_token_ids: list[int]
    sampling: dict
    stream_addr: str
    kv_addr: str
    block_ids: list[int]
    skip_blocks: int
    lease_s: float
    decode_id: str
    cache_salt: str | None = None
    kv_advert: dict = field(default_factory=dict)


@message("prefill_done")
@dataclass(frozen=True, slots=True)
class PrefillDone:
    """Prefill worker -> decode worker, the reply to Prefill: all KV delivered. No reply."""

    first_token: int
    num_chunks: int
    cached_tokens: int = 0


@message("abort")
@dataclass(frozen=True, slots=True)
class Abort:
    """Gateway -> decode, decode -> prefill, client -> gateway: stop the request named by
    the envelope's request id and free its resources. Reply: Ack (also if unknown)."""

    reason: str = "client"


@message("tokens")
@dataclass(frozen=True, slots=True)
class Tokens:
    """Decode or prefill worker -> gateway (PUSH -> PULL), under the request id. No reply."""

    position: int
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    source: str = "decode"
    error: str | None = None
    logprobs: list[dict] = field(default_factory=list)


@message("get_stats")
@dataclass(frozen=True, slots=True)
class GetStats:
    """Anyone -> any service (DEALER -> ROUTER). Reply: Stats."""


@message("stats")
@dataclass(frozen=True, slots=True)
class Stats:
    """Service -> requester, the reply to GetStats. No reply."""

    values: dict


@message("client_request")
@dataclass(frozen=True, slots=True)
class ClientRequest:
    """Client -> gateway (DEALER -> ROUTER), the ZeroMQ client protocol.

    Exactly one of ``prompt``, ``prompt_token_ids``, ``messages`` is set. Reply: a run of
    ClientChunk (one if ``stream`` is false), the last with ``finished``; or Error.
    """

    model: str
    sampling: dict
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict] | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = True
    cache_salt: str | None = None
    timeout_s: float | None = None


@message("client_chunk")
@dataclass(frozen=True, slots=True)
class ClientChunk:
    """Gateway -> client, a reply to ClientRequest (parent = its id). No reply."""

    text: str
    token_ids: list[int]
    position: int
    finished: bool = False
    finish_reason: str | None = None
    usage: dict = field(default_factory=dict)
    error: str | None = None


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
    expected; send to ``kv_advert`` (the pool's data-plane receiver). No reply."""

    kv_advert: dict


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
    block there within ``lease_s``."""

    keys: list[int]
    transfer_id: str = ""
    kv_advert: dict = field(default_factory=dict)
    lease_s: float = 0.0


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
    """Conductor -> any holder of KV blocks (DEALER -> ROUTER). Reply: Stats with
    ``source``, ``hashes`` (every block held) and ``tiers`` (the tier of each)."""
