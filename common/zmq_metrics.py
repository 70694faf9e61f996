"""What the control plane refused, as Prometheus metrics on each process's /metrics.

A CURVE context (``common.zmq_auth.CurveContext``) carries one :class:`Refusals`: every
receiving socket of the process that drops or answers ``forbidden`` a message its
sender's role may not send (``common.zmq_policy``) adds it there, by endpoint (``control``:
a ROUTER; ``sub``, ``pull``), sender role and message type. Message types are those of
the catalog (an unknown type fails to decode before any role check) and roles those of
the keys directory, so the label sets stay few whatever a peer sends.

:class:`ControlMetrics` is the collector a service registers in its registry:

    pdserve:control_forbidden_total{endpoint, role, message_type}
    pdserve:control_unknown_keys_total   connections refused before any message (ZAP)

In plain mode (no keys) nothing is checked and both stay empty or zero.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric


class Refusals:
    """Counts of refused messages by (endpoint, role, message type). ``add`` runs on the
    event loop, a scrape on the metrics server's thread: both take the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str, str]] = Counter()

    def add(self, endpoint: str, role: str, message_type: str) -> None:
        with self._lock:
            self._counts[(endpoint, role or "unknown", message_type)] += 1

    def counts(self) -> dict[tuple[str, str, str], int]:
        with self._lock:
            return dict(self._counts)


def refusals_of(ctx: object) -> Refusals | None:
    """The context's refusal counts; None for a plain context (nothing is checked)."""
    return getattr(ctx, "refusals", None)


class ControlMetrics:
    """A Prometheus collector of ``ctx``'s refusals; register it in a service's registry."""

    def __init__(self, ctx: object) -> None:
        self._ctx = ctx

    def collect(self) -> Iterator[Metric]:
        forbidden = CounterMetricFamily(
            "pdserve:control_forbidden",
            "Control messages refused because the sender's role may not send them",
            labels=["endpoint", "role", "message_type"])
        refusals = refusals_of(self._ctx)
        for labels, n in sorted((refusals.counts() if refusals else {}).items()):
            forbidden.add_metric(list(labels), n)
        yield forbidden
        yield CounterMetricFamily(
            "pdserve:control_unknown_keys",
            "Control connections refused for a CURVE key not in the keys directory",
            value=getattr(self._ctx, "refused", 0))
