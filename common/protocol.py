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
    record,
    records,
    registry,
)
from common.protocol_migrate import Migrate, MigrateDone, MigrateReady, StreamMoved
from common.protocol_pool import (
    HeldBlocks,
    KVEvent,
    PoolBlocks,
    PoolCommit,
    PoolExists,
    PoolFound,
    PoolGet,
    PoolPut,
    PoolReady,
    PoolRemove,
    Resync,
)
from common.protocol_stats import (
    ConductorStats,
    GetStats,
    ListWorkers,
    PoolStats,
    WorkerList,
    WorkerStats,
)
from common.records import (
    CostCoefficients,
    KVAdvert,
    PoolInstanceStatus,
    RankAdvert,
    SamplingParams,
    StepSample,
    Timing,
    TokenLogprob,
    TopLogprob,
    TtftSample,
    Usage,
    WorkerInfo,
    WorkerPoolCounts,
    WorkerRefusal,
    WorkerStatus,
)

__all__ = [
    "ERROR_CODES", "MAX_BULK_FRAME_BYTES", "MAX_FRAME_BYTES", "PROTOCOL_VERSION",
    "WORKER_LEAVING",
    "Envelope", "Message", "ProtocolError", "decode", "encode", "message", "record",
    "records", "registry",
    # nested records
    "CostCoefficients", "KVAdvert", "PoolInstanceStatus", "RankAdvert", "SamplingParams",
    "StepSample",
    "Timing", "TokenLogprob", "TopLogprob", "TtftSample", "Usage", "WorkerInfo",
    "WorkerPoolCounts", "WorkerRefusal", "WorkerStatus",
    # messages declared beside this module
    "ConductorStats", "GetStats", "HeldBlocks", "KVEvent", "ListWorkers", "Migrate",
    "MigrateDone", "MigrateReady", "PoolBlocks",
    "PoolCommit", "PoolExists", "PoolFound", "PoolGet", "PoolPut", "PoolReady", "PoolRemove",
    "PoolStats", "Resync", "StreamMoved", "WorkerList", "WorkerStats",
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

    info: WorkerInfo


@message("welcome")
@dataclass(frozen=True, slots=True)
class Welcome:
    """Conductor -> worker, the reply to Hello. No reply."""

    conductor_id: str
    heartbeat_interval_s: float


@message("leaving")
@dataclass(frozen=True, slots=True)
class Leaving:
    """Worker -> conductor (DEALER -> ROUTER) on a planned stop: route nothing more to
    ``worker_id``; its heartbeats until it exits do not bring it back, a new Hello does.
    Reply: Ack (``detail`` "unknown" if the conductor does not know the worker)."""

    worker_id: str


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
    prefill_steps: list[StepSample] = field(default_factory=list)
    decode_steps: list[StepSample] = field(default_factory=list)
    waiting_for_kv: int = 0
    reserved_blocks: int = 0
    ttft_samples: list[TtftSample] = field(default_factory=list)
    admitted: list[str] | None = None


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
    sampling: SamplingParams
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
    sampling: SamplingParams
    stream_addr: str
    kv_addr: str
    block_ids: list[int]
    skip_blocks: int
    lease_s: float
    decode_id: str
    cache_salt: str | None = None
    kv_advert: KVAdvert | None = None
    # The transfer's secret: the decode worker's receiver takes only KV that presents it.
    kv_token: bytes = b""


@message("prefill_done")
@dataclass(frozen=True, slots=True)
class PrefillDone:
    """Prefill worker -> decode worker, the reply to Prefill: all KV delivered. No reply."""

    first_token: int
    num_chunks: int
    cached_tokens: int = 0
    timing: Timing | None = None  # queue, prefill, kv_transfer as the prefill worker saw them


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
    logprobs: list[TokenLogprob] = field(default_factory=list)
    timing: Timing | None = None  # on the last Tokens of a stream: the workers' stages


# ``Tokens.error`` of a stream its decode worker hands back unfinished (a planned stop):
# the gateway continues it on another worker, as if the worker had died.
WORKER_LEAVING = "worker leaving: continue elsewhere"


@message("client_request")
@dataclass(frozen=True, slots=True)
class ClientRequest:
    """Client -> gateway (DEALER -> ROUTER), the ZeroMQ client protocol.

    Exactly one of ``prompt``, ``prompt_token_ids``, ``messages`` is set. Reply: a run of
    ClientChunk (one if ``stream`` is false), the last with ``finished``; or Error.
    """

    model: str
    # Kept as the client wrote it: keys it leaves out take the gateway's defaults
    # (max_tokens: the room left in the context), which SamplingParams' own would hide.
    sampling: dict
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    # Chat turns are free-form (content parts, tool calls): the chat template reads them.
    messages: list[dict] | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = True
    cache_salt: str | None = None
    timeout_s: float | None = None
    api_key: str | None = None  # required when the gateway has API keys configured
    timing: bool = False  # the last ClientChunk carries the request's Timing


@message("client_chunk")
@dataclass(frozen=True, slots=True)
class ClientChunk:
    """Gateway -> client, a reply to ClientRequest (parent = its id). No reply."""

    text: str
    token_ids: list[int]
    position: int
    finished: bool = False
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None
    timing: Timing | None = None  # on the last chunk, if the request asked for it
