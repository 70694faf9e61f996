"""Nested records: the typed payloads that messages carry inside their fields.

Each is registered with :func:`common.codec.record`, travels as a map of its fields and
is checked on decode exactly like a message body; ``docs/protocol.md`` documents each
under *Nested records*. Import them from :mod:`common.protocol`.

This module must never import torch or numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.codec import record
from common.sampling_params import SamplingParams

record(SamplingParams)  # one class: the engine validates what the wire carries


@record
@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a worker is: sent in Hello, kept by the conductor's registry, listed in
    WorkerList and in the worker's own stats.

    The fields after ``fingerprint`` are what KV exchange depends on; the conductor
    refuses a worker whose values differ from its model's other workers (see
    ``services/conductor/compat.py``). Their defaults keep older senders decodable:
    a value not sent counts as the default, and must match like any other.
    ``num_kv_heads`` is the model's, not one tensor-parallel rank's share."""

    worker_id: str
    role: str
    model: str
    control_addr: str
    kv_addr: str
    host_id: str
    block_size: int
    num_blocks: int
    fingerprint: str
    kv_dtype: str = ""
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    tp_size: int = 1
    block_hash: str = ""
    block_hash_seed: int = 0
    protocol_version: int = 0


@record
@dataclass(frozen=True, slots=True)
class WorkerRefusal:
    """A worker the conductor refused at handshake: ``setting`` is the first field that
    differs from its model's reference worker, ``reason`` names both values, ``at`` is
    when (seconds since the epoch)."""

    worker_id: str
    role: str
    model: str
    setting: str
    reason: str
    at: float


@record
@dataclass(frozen=True, slots=True)
class RankAdvert:
    """One rank of a tensor-parallel decode worker that takes its own KV heads' slices:
    its receiver's endpoints (kind -> address, as in ``KVAdvert``) and the KV heads
    ``[head_start, head_start + head_count)`` its blocks hold."""

    endpoints: dict
    head_start: int
    head_count: int


@record
@dataclass(frozen=True, slots=True)
class KVAdvert:
    """Where a data-plane receiver listens: its host id and one address per backend kind
    (``endpoints``: kind -> address; a map because the kinds are the data plane's to
    extend). ``common.transfer`` makes, checks and negotiates with this record.
    ``slices``: the receiver takes KV head slices (wire version 6), so each rank of a
    tensor-parallel prefill worker may send its own. ``ranks``: one entry per rank of a
    tensor-parallel decode worker whose every rank receives its own heads' slices
    (rank 0 first); empty where one receiver takes every head."""

    host_id: str
    endpoints: dict
    slices: bool = False
    ranks: list[RankAdvert] = field(default_factory=list)


@record
@dataclass(frozen=True, slots=True)
class StepSample:
    """One engine step's timing, for the conductor's cost model. A prefill-only step sets
    ``tokens``/``cached`` (per prompt chunk: tokens computed, tokens already in KV); a
    decode-only step sets ``batch``/``context`` (sequences, their KV tokens in all)."""

    seconds: float
    tokens: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    batch: int = 0
    context: int = 0


@record
@dataclass(frozen=True, slots=True)
class TtftSample:
    """How long one request a decode worker received took to its first token there: from
    its arrival to the KV landing (``remote``: prefilled elsewhere) or to the first token
    this worker computed. The conductor sets it beside the TTFT it predicted."""

    request_id: str
    seconds: float
    remote: bool

@record
@dataclass(frozen=True, slots=True)
class TopLogprob:
    """One of the most likely tokens at a position."""

    token_id: int
    logprob: float


@record
@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The log probability of one generated token, its rank, and the top alternatives."""

    token_id: int
    logprob: float
    rank: int = 0
    top: list[TopLogprob] = field(default_factory=list)


@record
@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of a finished request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0


@record
@dataclass(frozen=True, slots=True)
class Timing:
    """Where a request's time went, in milliseconds; each process fills in what it
    measured (``docs/protocol.md``, *Timing*).

    Stages follow each other: ``route`` (gateway <-> conductor), ``queue`` (waiting on
    the decode and prefill workers before the prompt ran), ``prefill`` (the prompt's
    computation, pool fetches included), ``kv_transfer`` (from prefill's end until the
    decode worker held all KV; 0 for a local prefill), ``decode`` (from then until the
    last token). ``first_token`` is the time to the first token and ``total`` the whole
    request, both as the gateway saw them. ``route_reason`` is the conductor's."""

    route_ms: float = 0.0
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    kv_transfer_ms: float = 0.0
    first_token_ms: float = 0.0
    decode_ms: float = 0.0
    total_ms: float = 0.0
    kv_bytes: int = 0
    kv_backend: str = ""
    decode_id: str = ""
    prefill_id: str = ""
    route_reason: str = ""


@record
@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """A worker as the conductor sees it: what it is, whether it is alive, its load as
    of its last heartbeat."""

    info: WorkerInfo
    alive: bool
    waiting: int = 0
    running: int = 0
    queued_prefill_tokens: int = 0
    free_blocks: int = 0
    step_time_ms: float = 0.0


@record
@dataclass(frozen=True, slots=True)
class WorkerPoolCounts:
    """A worker's traffic with the cache pool since it started."""

    fetches: int = 0
    fetched_blocks: int = 0
    fetch_skipped: int = 0
    written_blocks: int = 0
    write_back_dropped: int = 0
    fetch_bytes: int = 0
    fetch_seconds: float = 0.0
    adopt_seconds: float = 0.0
    instances: list[str] = field(default_factory=list)
    write_back_queued: int = 0


@record
@dataclass(frozen=True, slots=True)
class CostCoefficients:
    """A cost model's coefficients in seconds (per token, per token pair, per sequence,
    per context token), all > 0: a calibration, or what the conductor fitted online. The
    terms they multiply are in ``common/cost_profile.py``."""

    prefill_fixed_s: float
    prefill_per_token_s: float
    prefill_per_pair_s: float
    decode_fixed_s: float
    decode_per_seq_s: float
    decode_per_ctx_token_s: float

    def __post_init__(self) -> None:
        for name in self.__slots__:
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"cost coefficient {name} must be > 0, got {value!r}")


@record
@dataclass(frozen=True, slots=True)
class PoolInstanceStatus:
    """A cache-pool instance the conductor follows."""

    instance_id: str
    control_addr: str
    events_addr: str
    synced: bool
    blocks: int
    silent_s: float
