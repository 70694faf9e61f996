"""Request tracing: one OpenTelemetry trace per request, across every process it visits.

The trace context travels in the control-message envelope as a W3C ``traceparent``
string (``00-<trace id>-<span id>-<flags>``, see docs/protocol.md); each process opens
its spans as children of the one named there and passes its own on. A process that
does not trace passes the context it received on unchanged, so the processes that do
still form one tree.

Off by default. ``Tracer(service, enabled=True, endpoint=…, file=…)`` exports to an
OTLP/HTTP collector (``endpoint``; needs ``opentelemetry-exporter-otlp-proto-http``,
the ``otlp`` extra) and/or appends each finished span as one JSON line to ``file``
(what the tests read). The OpenTelemetry packages are imported only when tracing is on:
a process without them imports and serves as before, and says once that it cannot trace.

Nothing here is global: each service builds its own ``Tracer`` (no global provider is
installed), so two services in one test process keep their spans apart.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Mapping
from typing import Any

import structlog

log = structlog.get_logger(__name__)

_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
MAX_TRACEPARENT = 55  # the length of a version-00 traceparent


def parse_traceparent(value: Any) -> str | None:
    """``value`` if it is a valid version-00 W3C traceparent, else None.

    Anything else (wrong type, length, case, an all-zero trace or span id) is ignored,
    never an error: a hostile or careless sender only loses its trace link."""
    if not isinstance(value, str) or len(value) != MAX_TRACEPARENT:
        return None
    m = _TRACEPARENT.fullmatch(value)
    if m is None or int(m.group(1), 16) == 0 or int(m.group(2), 16) == 0:
        return None
    return value


def now_ns() -> int:
    """Wall-clock time for span bounds (spans of several processes share one axis)."""
    return time.time_ns()


def wall_ns(monotonic_s: float) -> int:
    """The wall-clock time (ns) of an earlier ``time.monotonic()`` reading: stages are
    timed on the monotonic clock, spans are placed on the wall clock."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


class Span:
    """A span in progress. ``traceparent`` is what children (here or in the next
    process) name as their parent; with tracing off it is the context received."""

    __slots__ = ("_span", "traceparent")

    def __init__(self, span: Any, traceparent: str | None) -> None:
        self._span = span
        self.traceparent = traceparent

    def set(self, key: str, value: str | int | float | bool) -> None:
        if self._span is not None:
            self._span.set_attribute(key, value)

    def end(self, end_ns: int | None = None) -> None:
        if self._span is not None:
            self._span.end(end_time=end_ns)


class Tracer:
    """One service's spans. ``span`` opens a span (ended by ``Span.end``), ``record``
    writes one whose bounds were measured already; both return a Span."""

    def __init__(self, service: str, *, enabled: bool = False, endpoint: str = "",
                 file: str = "") -> None:
        self.service = service
        self._provider = None
        self._tracer = None
        if enabled:
            self._start(endpoint, file)

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def _start(self, endpoint: str, file: str) -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        except ImportError:
            log.warning("tracing requested but opentelemetry-sdk is not installed: off")
            return
        provider = TracerProvider(resource=Resource.create({"service.name": self.service}))
        if endpoint:
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )
            except ImportError:
                log.warning("tracing_endpoint set but the OTLP exporter is not installed "
                            "(pip install 'pdserve[otlp]')", endpoint=endpoint)
            else:
                provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint)))
        if file:
            provider.add_span_processor(SimpleSpanProcessor(_json_lines_exporter(file)))
        self._provider = provider
        self._tracer = provider.get_tracer("pdserve")

    def span(self, name: str, parent: str | None = None,
             attributes: Mapping[str, Any] | None = None,
             start_ns: int | None = None) -> Span:
        """A span named ``name`` under ``parent`` (a traceparent; None: a new trace)."""
        if self._tracer is None:
            return Span(None, parent)
        span = self._tracer.start_span(name, context=_context(parent),
                                       attributes=dict(attributes or {}), start_time=start_ns)
        return Span(span, _traceparent_of(span) or parent)

    def record(self, name: str, parent: str | None, start_ns: int, end_ns: int,
               attributes: Mapping[str, Any] | None = None) -> Span:
        """A finished span over ``[start_ns, end_ns]`` (wall clock, ns)."""
        span = self.span(name, parent, attributes, start_ns)
        span.end(max(start_ns, end_ns))
        return span

    def close(self) -> None:
        """Export what is buffered and stop. Idempotent."""
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = self._tracer = None


NO_TRACER = Tracer("none")  # off: spans pass the received context on


def _context(parent: str | None):
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    if parent is None:
        return None
    _, trace_id, span_id, flags = parent.split("-")
    ctx = SpanContext(trace_id=int(trace_id, 16), span_id=int(span_id, 16), is_remote=True,
                      trace_flags=TraceFlags(int(flags, 16)))
    return trace.set_span_in_context(NonRecordingSpan(ctx))


def _traceparent_of(span: Any) -> str | None:
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def _json_lines_exporter(path: str):
    """A span exporter appending one JSON object per finished span to ``path``."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class JsonLinesExporter(SpanExporter):
        def __init__(self) -> None:
            self._lock = threading.Lock()

        def export(self, spans) -> SpanExportResult:
            lines = [json.dumps(_span_dict(s), sort_keys=True) for s in spans]
            try:
                with self._lock, open(path, "a", encoding="utf-8") as f:
                    f.write("".join(line + "\n" for line in lines))
            except OSError:
                log.exception("trace file not writable", path=path)
                return SpanExportResult.FAILURE
            return SpanExportResult.SUCCESS

    return JsonLinesExporter()


def _span_dict(span: Any) -> dict:
    ctx, parent = span.get_span_context(), span.parent
    return {
        "name": span.name,
        "service": span.resource.attributes.get("service.name", ""),
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{parent.span_id:016x}" if parent is not None else None,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": dict(span.attributes or {}),
    }
