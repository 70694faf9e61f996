"""Settings of one cache-pool instance (``pdserve cache-pool --help`` lists them)."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from services.cache_pool.eviction import EvictionPolicy, LRUPolicy, ReuseAwarePolicy

POLICIES = ("lru", "reuse_aware")
TRANSFER_BACKENDS = ("auto", "tcp", "shm", "ucx")


@dataclass(frozen=True, slots=True)
class PoolSettings:
    """Settings of one cache-pool instance (``pdserve cache-pool --help``).

    events_addr: the instance binds its own PUB socket here; the conductor (or any
        subscriber) connects a SUB to it. block_bytes 0: learned from the SSD tier or the
        first put (services/cache_pool/server.py).
    ssd_dir "": no SSD tier. dram_mib / ssd_mib may be fractional.
    kv_host "": the data-plane receiver (block bytes of puts) listens on control_addr's
        host (every interface for a wildcard, 127.0.0.1 for a non-tcp address).
    transfer_backend: "auto" offers every backend available here and lets each peer
        negotiate; "tcp", "shm" or "ucx" offers and uses only that one.
    host_id "": this machine's hostname (equal host ids on both ends enable shm).
    block_tokens: tokens per block, the engine's ``block_size`` (the same for every worker
        that shares the pool): the reuse-aware policy counts time and depth in tokens.
    """

    instance_id: str = "pool-0"
    control_addr: str = "tcp://127.0.0.1:5580"
    events_addr: str = "tcp://127.0.0.1:5581"
    dram_mib: float = 1024.0
    ssd_dir: str = ""
    ssd_mib: float = 16384.0
    block_bytes: int = 0
    policy: str = "lru"
    max_request_bytes: int = 256 << 20
    flush_on_close: bool = True
    log_format: str = "json"
    curve_keys_dir: str = ""  # CURVE keys (pdserve keys); empty: plain, trusted host only
    metrics_port: int = 0
    kv_host: str = ""
    kv_port: int = 0
    transfer_backend: str = "auto"
    ucx_tls: str = ""  # UCX_TLS for the ucx backend; empty: UCX's choice
    ucx_net_devices: str = ""  # UCX_NET_DEVICES; empty: UCX's choice
    host_id: str = ""
    block_tokens: int = 16

    def __post_init__(self) -> None:
        if not self.instance_id:
            raise ValueError("instance_id must not be empty")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {self.policy!r}")
        if not self.dram_mib > 0 or (self.ssd_dir and not self.ssd_mib > 0):
            raise ValueError("dram_mib and ssd_mib must be positive")
        if not 0 <= self.block_bytes <= self.dram_bytes:
            raise ValueError(f"block_bytes must be in [0, dram bytes {self.dram_bytes}], "
                             f"got {self.block_bytes}")
        if self.transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(f"transfer_backend must be one of {TRANSFER_BACKENDS}, "
                             f"got {self.transfer_backend!r}")
        if not 0 <= self.kv_port <= 65535:
            raise ValueError(f"kv_port must be in [0, 65535], got {self.kv_port}")
        if self.block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {self.block_tokens}")
        if self.max_request_bytes <= 0:
            raise ValueError(f"max_request_bytes must be positive, got {self.max_request_bytes}")

    def make_policy(self) -> EvictionPolicy:
        """A fresh policy for one tier."""
        if self.policy == "lru":
            return LRUPolicy()
        return ReuseAwarePolicy(block_tokens=self.block_tokens)

    @property
    def dram_bytes(self) -> int:
        return int(self.dram_mib * (1 << 20))

    @property
    def ssd_bytes(self) -> int:
        return int(self.ssd_mib * (1 << 20)) if self.ssd_dir else 0

    @property
    def resolved_host_id(self) -> str:
        return self.host_id or socket.gethostname()

    @property
    def resolved_kv_host(self) -> str:
        if self.kv_host:
            return self.kv_host
        scheme, _, rest = self.control_addr.partition("://")
        host = rest.rpartition(":")[0].strip("[]")
        if scheme != "tcp" or not host:
            return "127.0.0.1"
        return "0.0.0.0" if host == "*" else host
