"""Status messages: what each service reports when asked, and the conductor's worker list;
part of the catalog that :mod:`common.protocol` re-exports. Import them from there.

Each service answers GetStats with its own typed record, so a reader names the fields
it needs and a missing or renamed one fails at decode, not deep in a caller.

This module must never import torch or numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.codec import message
from common.records import (
    CostCoefficients,
    KVAdvert,
    PoolInstanceStatus,
    WorkerInfo,
    WorkerPoolCounts,
    WorkerRefusal,
    WorkerStatus,
)


@message("get_stats")
@dataclass(frozen=True, slots=True)
class GetStats:
    """Anyone -> any service (DEALER -> ROUTER). Reply: the service's stats record
    (WorkerStats, ConductorStats or PoolStats)."""


@message("worker_stats")
@dataclass(frozen=True, slots=True)
class WorkerStats:
    """Worker -> requester, the reply to GetStats. No reply."""

    info: WorkerInfo
    executor: str
    free_blocks: int
    waiting: int
    running: int
    num_requests: int
    live_transfers: int = 0
    local_fallbacks: int = 0
    kv_bytes_received: int = 0
    kv_bytes_sent: int = 0
    prefills_done: int = 0
    prefill_jobs: int = 0
    kv_chunks_resent: int = 0
    kv_chunks_retried: int = 0
    kv_messages_refused: int = 0  # for a live transfer, without its token
    # Remote prefills per data-plane backend kind; the kinds are the data plane's.
    transfer_backends: dict = field(default_factory=dict)
    kv_send_paths: dict = field(default_factory=dict)
    kv_advert: KVAdvert | None = None
    pool: WorkerPoolCounts = field(default_factory=WorkerPoolCounts)
    waiting_for_kv: int = 0
    reserved_blocks: int = 0
    kv_migrated_in: int = 0  # running requests adopted with their KV from a stopping worker
    kv_migrated_out: int = 0  # running requests this worker moved on, with their KV


@message("conductor_stats")
@dataclass(frozen=True, slots=True)
class ConductorStats:
    """Conductor -> requester, the reply to GetStats. No reply."""

    workers: list[WorkerStatus]
    policy: str
    cost_profile: str
    cost_model: CostCoefficients
    cost_observations: list[int]
    bad_samples: int
    index_blocks: int
    # Blocks per location (worker id or "pool:<instance>"), as the prefix index counts.
    index_locations: dict
    cache_pools: list[PoolInstanceStatus] = field(default_factory=list)
    # Workers refused at handshake, the latest last (the conductor keeps a few).
    refused: list[WorkerRefusal] = field(default_factory=list)
    # The profile's host factors: ``cost_model`` is of one worker alone on its host, and
    # a step with k workers busy on that host takes ``contention[k-1]`` times as long.
    contention: list[float] = field(default_factory=list)


@message("pool_stats")
@dataclass(frozen=True, slots=True)
class PoolStats:
    """Cache pool -> requester, the reply to GetStats. No reply."""

    instance_id: str
    boot_id: str
    control_addr: str
    events_addr: str
    block_bytes: int
    policy: str
    dram_capacity_bytes: int
    ssd_capacity_bytes: int
    kv_advert: KVAdvert
    dram_hits: int = 0
    ssd_hits: int = 0
    misses: int = 0
    dram_blocks: int = 0
    ssd_blocks: int = 0
    dram_bytes: int = 0
    ssd_bytes: int = 0
    dram_evictions: int = 0
    ssd_evictions: int = 0
    corrupt_dropped: int = 0
    demotion_failures: int = 0
    live_transfers: int = 0
    pending_puts: int = 0
    sending_gets: int = 0
    # Data-plane transfers by outcome ("in_done", "out_failed", ...).
    transfers: dict = field(default_factory=dict)


@message("list_workers")
@dataclass(frozen=True, slots=True)
class ListWorkers:
    """Gateway (or anyone) -> conductor (DEALER -> ROUTER). Reply: WorkerList.

    ``model`` non-empty: only the workers serving it."""

    model: str = ""


@message("worker_list")
@dataclass(frozen=True, slots=True)
class WorkerList:
    """Conductor -> requester, the reply to ListWorkers: every registered worker (dead
    ones too, with ``alive`` false) and its load. No reply."""

    workers: list[WorkerStatus]
    # Workers refused at handshake, the latest last (the conductor keeps a few).
    refused: list[WorkerRefusal] = field(default_factory=list)
