"""Settings of one cache-pool instance (``pdserve cache-pool --help`` lists them)."""

from __future__ import annotations

from dataclasses import dataclass

from services.cache_pool.eviction import EvictionPolicy, LRUPolicy, ReuseAwarePolicy

POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "reuse_aware": ReuseAwarePolicy}


@dataclass(frozen=True, slots=True)
class PoolSettings:
    """Settings of one cache-pool instance (``pdserve cache-pool --help``).

    events_addr: the instance binds its own PUB socket here; the conductor (or any
        subscriber) connects a SUB to it. block_bytes 0: learned from the SSD tier or the
        first put (services/cache_pool/server.py).
    ssd_dir "": no SSD tier. dram_mib / ssd_mib may be fractional.
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
    metrics_port: int = 0

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
        if self.max_request_bytes <= 0:
            raise ValueError(f"max_request_bytes must be positive, got {self.max_request_bytes}")

    @property
    def dram_bytes(self) -> int:
        return int(self.dram_mib * (1 << 20))

    @property
    def ssd_bytes(self) -> int:
        return int(self.ssd_mib * (1 << 20)) if self.ssd_dir else 0
