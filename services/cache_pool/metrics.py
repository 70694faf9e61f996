"""Prometheus metrics of one cache-pool instance, in its own ``CollectorRegistry``.

Store figures are read from ``BlockStore.stats()`` at scrape time (a custom collector),
so the store keeps no metric objects and a scrape always agrees with ``GetStats``:

    pdserve:cache_pool_hits_total{tier}        blocks served, by the tier that served them
    pdserve:cache_pool_misses_total            asked blocks not served (absent or corrupt)
    pdserve:cache_pool_evictions_total{tier}   blocks a full tier evicted
    pdserve:cache_pool_corrupt_blocks_total    SSD blocks dropped on a failed checksum
    pdserve:cache_pool_bytes{tier}             payload bytes held
    pdserve:cache_pool_blocks{tier}            blocks held
    pdserve:cache_pool_capacity_bytes{tier}    configured capacity
    pdserve:cache_pool_requests_total{type,outcome}   requests served ("ok", or the
                                                      Error code answered)
    pdserve:cache_pool_block_bytes_total{direction,carrier}   block bytes in (puts) and
                                                      out (gets), by "data_plane" or "zmq"
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.cache_pool.store import StoreStats

_P = "pdserve:cache_pool_"


class _StoreCollector:
    def __init__(self, read: Callable[[], tuple[StoreStats | None, dict[str, int]]]) -> None:
        self._read = read

    def collect(self):
        stats, capacity = self._read()
        s = stats._asdict() if stats is not None else dict.fromkeys(StoreStats._fields, 0)
        hits = CounterMetricFamily(_P + "hits", "Blocks served, by tier", labels=["tier"])
        evictions = CounterMetricFamily(_P + "evictions", "Blocks evicted, by tier",
                                        labels=["tier"])
        held = GaugeMetricFamily(_P + "bytes", "Payload bytes held", labels=["tier"])
        blocks = GaugeMetricFamily(_P + "blocks", "Blocks held", labels=["tier"])
        cap = GaugeMetricFamily(_P + "capacity_bytes", "Tier capacity", labels=["tier"])
        for tier in ("dram", "ssd"):
            hits.add_metric([tier], s[f"{tier}_hits"])
            evictions.add_metric([tier], s[f"{tier}_evictions"])
            held.add_metric([tier], s[f"{tier}_bytes"])
            blocks.add_metric([tier], s[f"{tier}_blocks"])
            cap.add_metric([tier], capacity.get(tier, 0))
        yield hits
        yield evictions
        yield held
        yield blocks
        yield cap
        yield CounterMetricFamily(_P + "misses", "Asked blocks not served",
                                  value=s["misses"])
        yield CounterMetricFamily(_P + "corrupt_blocks", "SSD blocks dropped as corrupt",
                                  value=s["corrupt_dropped"])


class PoolMetrics:
    """The registry and the metrics the server updates itself (requests, bytes)."""

    def __init__(self, read: Callable[[], tuple[StoreStats | None, dict[str, int]]]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StoreCollector(read))
        self.requests = Counter(_P + "requests", "Requests served", ["type", "outcome"],
                                registry=self.registry)
        self.block_bytes = Counter(_P + "block_bytes", "Block bytes moved, by direction and "
                                   "carrier", ["direction", "carrier"], registry=self.registry)
