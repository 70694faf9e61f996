"""Prometheus metrics of a worker, in a registry of its own."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, Metric


class KVRefusals:
    """``pdserve:kv_messages_refused_total``: data-plane messages for a live transfer that
    did not present its token (forged, or a confused peer's). The receiver counts them on
    its event loop; a scrape reads that count (one int, read whole) instead of keeping a
    second count in step with it."""

    def __init__(self) -> None:
        self.read: Callable[[], int] = lambda: 0  # a worker without a receiver (prefill)

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "pdserve:kv_messages_refused",
            "Data-plane messages refused for lacking their transfer's token",
            value=self.read())


class WorkerMetrics:
    def __init__(self, worker_id: str, role: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"worker": worker_id, "role": role}
        r = self.registry
        self.step_seconds = Histogram(
            "pdserve:engine_step_seconds", "Duration of one engine step", registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.queue_time = Histogram(
            "pdserve:request_queue_time_seconds", "Time from arrival to first scheduling",
            registry=r, buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.running = Gauge("pdserve:num_requests_running", "Requests in the running batch",
                             registry=r)
        self.waiting = Gauge("pdserve:num_requests_waiting", "Requests queued", registry=r)
        self.kv_usage = Gauge("pdserve:kv_cache_usage_perc", "Fraction of KV blocks in use",
                              registry=r)
        self.kv_transfer_bytes = Counter("pdserve:kv_transfer_bytes",
                                         "KV bytes moved over the data plane", registry=r)
        self.kv_transfer_seconds = Counter("pdserve:kv_transfer_seconds",
                                           "Seconds spent moving KV", registry=r)
        self.kv_sent_bytes = Counter("pdserve:kv_transfer_sent_bytes",
                                     "KV bytes sent by prefill, by the backend negotiated",
                                     ["backend"], registry=r)
        self.transfer_backend = Counter("pdserve:kv_transfer_backend",
                                        "KV transfers by the backend negotiated",
                                        ["backend"], registry=r)
        self.local_fallbacks = Counter("pdserve:kv_local_fallbacks",
                                       "Remote prefills replaced by local prefill", registry=r)
        self.kv_migrated_in = Counter(
            "pdserve:kv_migrated_requests", "Running requests adopted with their KV from a "
            "stopping decode worker (nothing recomputed)", registry=r)
        self.kv_migrated_out = Counter(
            "pdserve:kv_migrations_sent", "Running requests moved with their KV to another "
            "decode worker on a planned stop", registry=r)
        self.kv_refused = KVRefusals()  # its ``read`` set by the role that owns a receiver
        r.register(self.kv_refused)
        self.info = Gauge("pdserve:worker_info", "Worker identity", list(labels), registry=r)
        self.info.labels(**labels).set(1)

    def update_load(self, load) -> None:
        self.running.set(load.running)
        self.waiting.set(load.waiting)
        if load.total_blocks:
            self.kv_usage.set(1 - load.free_blocks / load.total_blocks)

    def serve(self, port: int, host: str) -> None:
        start_http_server(port, addr=host, registry=self.registry)
