"""A decode worker's account of where one request's time went, and its spans.

Remote prefill (``stream.kv_done`` set)::

    arrived ── asked ──────────────────────────── kv_done ────────── end
    │ queue │ prefill worker: queue │ prefill │ rest: KV transfer │ decode │

The prefill worker reports its own queue and prefill times (``PrefillDone.timing``);
what remains of the wait for the KV, hops included, is the transfer. Durations only
cross processes, never timestamps, so the hosts' clocks need not agree.

Local prefill: ``queue`` is the engine's queue, ``prefill`` the rest until the first
token, ``decode`` from there to the end.
"""

from __future__ import annotations

from common.protocol import Timing
from common.tracing import Tracer, wall_ns


def stage_timing(stream, tracer: Tracer, end: float) -> Timing:
    """``stream``'s stages (a ``decode_role.Stream``: its clocks and span) until ``end``
    (monotonic), each also recorded as a span under the stream's ``decode.request``."""
    parent = stream.span.traceparent if stream.span is not None else None
    arrived = stream.arrived
    if stream.kv_done is not None and stream.asked is not None:
        p = stream.measured or Timing()
        waited = stream.kv_done - stream.asked
        kv_s = max(0.0, waited - (p.queue_ms + p.prefill_ms) / 1e3)
        tracer.record("decode.queue", parent, wall_ns(arrived), wall_ns(stream.asked))
        tracer.record("decode.kv_wait", parent, wall_ns(stream.asked),
                      wall_ns(stream.kv_done),
                      {"bytes": p.kv_bytes, "backend": p.kv_backend})
        tracer.record("decode.decode", parent, wall_ns(stream.kv_done), wall_ns(end))
        return Timing(queue_ms=(stream.asked - arrived) * 1e3 + p.queue_ms,
                      prefill_ms=p.prefill_ms, kv_transfer_ms=kv_s * 1e3,
                      decode_ms=(end - stream.kv_done) * 1e3, kv_bytes=p.kv_bytes,
                      kv_backend=p.kv_backend)
    first = stream.first if stream.first is not None else end
    started = min(arrived + stream.queued, first)
    tracer.record("decode.queue", parent, wall_ns(arrived), wall_ns(started))
    tracer.record("decode.prefill", parent, wall_ns(started), wall_ns(first))
    tracer.record("decode.decode", parent, wall_ns(first), wall_ns(end))
    return Timing(queue_ms=(started - arrived) * 1e3, prefill_ms=(first - started) * 1e3,
                  decode_ms=(end - first) * 1e3)
