"""One request's trace and timing as the gateway sees them.

The gateway opens the request's root span (``gateway.request``, a child of the client's
``traceparent`` if it sent a valid one), a ``gateway.route`` span per conductor call and
a ``gateway.first_token`` span from arrival to the first token; the context it sends on
(``traceparent``) makes the conductor's and the workers' spans children of the root.

The timing breakdown (``Timing``, returned only when the request asked for it) merges
what the workers measured, carried on the stream's last ``Tokens``, with the gateway's
own clock: the route round trips, time to first token, the whole request, and the
conductor's decision.
"""

from __future__ import annotations

import dataclasses
import time

from common.protocol import RouteReply, Timing, Tokens
from common.tracing import Tracer, now_ns


class RequestTrace:
    """Spans and stage clocks of one request in the gateway."""

    def __init__(self, tracer: Tracer, request_id: str, parent: str | None,
                 want_timing: bool) -> None:
        self._tracer = tracer
        self._want = want_timing
        self._start = time.monotonic()
        self._start_ns = now_ns()
        self._root = tracer.span("gateway.request", parent, {"request_id": request_id})
        self._route_s = 0.0
        self._route: RouteReply | None = None
        self._first_s: float | None = None
        self._ended = False

    @property
    def traceparent(self) -> str | None:
        """The context to send on: downstream spans are children of the root."""
        return self._root.traceparent

    def route_started(self) -> tuple[float, int]:
        return time.monotonic(), now_ns()

    def routed(self, started: tuple[float, int], route: RouteReply | None) -> None:
        """A conductor call that began at ``started`` ended (None: it was refused)."""
        self._route_s += time.monotonic() - started[0]
        attrs = {}
        if route is not None:
            self._route = route
            attrs = {"decode_id": route.decode_id, "prefill_id": route.prefill_id or "",
                     "reason": route.reason}
        self._tracer.record("gateway.route", self.traceparent, started[1], now_ns(), attrs)

    def on_event(self, event: Tokens) -> Tokens:
        """``event`` as the client gets it: the last one with the breakdown if asked."""
        if self._first_s is None and event.token_ids:
            self._first_s = time.monotonic() - self._start
            self._tracer.record("gateway.first_token", self.traceparent, self._start_ns,
                                now_ns())
        if not event.finished:
            return event
        self.end(event.finish_reason or "")
        # The workers always measure; the client sees it only when it asked.
        return dataclasses.replace(
            event, timing=self.timing(event.timing) if self._want else None)

    def timing(self, measured: Timing | None) -> Timing:
        route = self._route
        base = measured or Timing()
        return dataclasses.replace(
            base, route_ms=self._route_s * 1e3,
            first_token_ms=(self._first_s or 0.0) * 1e3,
            total_ms=(time.monotonic() - self._start) * 1e3,
            decode_id=route.decode_id if route else base.decode_id,
            prefill_id=(route.prefill_id or "") if route else base.prefill_id,
            route_reason=route.reason if route else base.route_reason)

    def end(self, finish_reason: str) -> None:
        """End the root span (idempotent: a failover or an abort may end it too)."""
        if not self._ended:
            self._ended = True
            self._root.set("finish_reason", finish_reason)
            self._root.end()
