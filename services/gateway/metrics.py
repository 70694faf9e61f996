"""The gateway's Prometheus metrics, named after vLLM's.

Metrics live in the registry passed in (one fresh ``CollectorRegistry`` per app in
tests); ``None`` means prometheus-client's process-wide default registry, in which one
``GatewayMetrics`` can exist per process (a second raises ``ValueError``: duplicated
time series).
"""

from __future__ import annotations

import time

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                50.0, 60.0, 120.0, 240.0, 480.0, 960.0)


class GatewayMetrics:
    """Request latency and token counters, observed per request through ``track``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = REGISTRY if registry is None else registry
        self.registry = reg
        self.time_to_first_token = Histogram(
            "pdserve:time_to_first_token_seconds",
            "Time from request arrival to the first generated token.",
            buckets=_LATENCY_BUCKETS, registry=reg)
        self.inter_token_latency = Histogram(
            "pdserve:inter_token_latency_seconds",
            "Time between successive token arrivals of a request, per token.",
            buckets=_ITL_BUCKETS, registry=reg)
        self.e2e_request_latency = Histogram(
            "pdserve:e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            buckets=_E2E_BUCKETS, registry=reg)
        self.request_success = Counter(
            "pdserve:request_success", "Finished requests, by finish reason.",
            ["finish_reason"], registry=reg)
        self.prompt_tokens = Counter(
            "pdserve:prompt_tokens", "Prompt tokens of finished requests.", registry=reg)
        self.generation_tokens = Counter(
            "pdserve:generation_tokens", "Tokens generated for finished requests.",
            registry=reg)
        self.goodput = Counter(
            "pdserve:request_goodput", "Requests that finished (stop or length) within "
            "their own TTFT and TBT targets (slo_ttft_ms, slo_tbt_ms; none set: met).",
            registry=reg)
        self.http_errors = Counter(
            "pdserve:http_errors", "HTTP requests answered with an error, by status "
            "(429: refused by admission, 503: no backend).", ["status"], registry=reg)

    def track(self, slo_ttft_ms: float | None = None,
              slo_tbt_ms: float | None = None) -> RequestTracker:
        """Start timing a request that arrived now, with its latency targets."""
        return RequestTracker(self, slo_ttft_ms, slo_tbt_ms)


class RequestTracker:
    """Timing of one request: call ``tokens`` as tokens arrive, ``finish`` once."""

    def __init__(self, metrics: GatewayMetrics, slo_ttft_ms: float | None = None,
                 slo_tbt_ms: float | None = None) -> None:
        self._metrics = metrics
        self._slo_ttft_s = slo_ttft_ms / 1e3 if slo_ttft_ms else None
        self._slo_tbt_s = slo_tbt_ms / 1e3 if slo_tbt_ms else None
        self._start = self._last = self._first = time.monotonic()
        self._seen_first = False
        self._finished = False

    def tokens(self, count: int) -> None:
        if count <= 0:
            return
        now = time.monotonic()
        if not self._seen_first:
            self._seen_first = True
            self._metrics.time_to_first_token.observe(now - self._start)
            count -= 1
            self._last = self._first = now
        if count > 0:
            # Tokens that arrive together share the gap since the previous arrival.
            per_token = (now - self._last) / count
            for _ in range(count):
                self._metrics.inter_token_latency.observe(per_token)
        self._last = now

    def finish(self, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        if self._finished:
            return
        self._finished = True
        self._metrics.e2e_request_latency.observe(time.monotonic() - self._start)
        self._metrics.request_success.labels(finish_reason=finish_reason).inc()
        self._metrics.prompt_tokens.inc(prompt_tokens)
        self._metrics.generation_tokens.inc(completion_tokens)
        if finish_reason in ("stop", "length") and self._seen_first and self._met_slo(
                completion_tokens):
            self._metrics.goodput.inc()

    def _met_slo(self, completion_tokens: int) -> bool:
        """TTFT within its target, and the mean gap between later tokens within TBT's."""
        if self._slo_ttft_s is not None and self._first - self._start > self._slo_ttft_s:
            return False
        if self._slo_tbt_s is not None and completion_tokens > 1:
            return (self._last - self._first) / (completion_tokens - 1) <= self._slo_tbt_s
        return True
