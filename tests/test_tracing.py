"""Trace context in the envelope, and the tracer on its own (no processes)."""

from __future__ import annotations

import json

import msgpack
import pytest

from common import protocol as p
from common.tracing import NO_TRACER, Tracer, parse_traceparent

GOOD = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize("value", [
    GOOD.upper(),  # W3C: lower case only
    GOOD[:-1],
    GOOD + "0",
    "01" + GOOD[2:],  # a version we do not know the layout of
    "00-" + "0" * 32 + "-00f067aa0ba902b7-01",  # all-zero trace id
    "00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01",  # all-zero span id
    "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
    "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
    "", None, 7, b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    ["x"], {"traceparent": GOOD}, "x" * 100_000,
])
def test_a_bad_traceparent_is_none(value):
    assert parse_traceparent(value) is None


def test_a_good_traceparent_is_kept():
    assert parse_traceparent(GOOD) == GOOD


def test_the_envelope_carries_a_valid_trace_and_omits_an_absent_one():
    msg = p.decode(p.encode(p.Abort(), request_id="r", trace=GOOD))
    assert msg.envelope.trace == GOOD and msg.envelope.request_id == "r"
    head = msgpack.unpackb(p.encode(p.Abort(), request_id="r")[0])
    assert "trace" not in head
    assert p.decode(p.encode(p.Abort())).envelope.trace is None


def test_encode_drops_an_invalid_trace_instead_of_sending_it():
    head = msgpack.unpackb(p.encode(p.Abort(), trace="00-zz")[0])
    assert "trace" not in head


@pytest.mark.parametrize("trace", ["garbage", 12, [GOOD], {"a": 1}, GOOD.upper(), None,
                                   b"\x00" * 55, 1.5, True])
def test_a_hostile_trace_in_the_envelope_is_ignored_not_an_error(trace):
    frame0 = msgpack.packb({"v": p.PROTOCOL_VERSION, "type": "route", "id": "m1",
                            "rid": "r1", "trace": trace,
                            "body": {"model": "m", "prompt_len": 3}}, use_bin_type=True)
    msg = p.decode([frame0])
    assert msg.envelope.trace is None
    assert msg.envelope.request_id == "r1" and msg.record.prompt_len == 3


def test_timing_round_trips_on_tokens_and_prefill_done():
    t = p.Timing(queue_ms=1.5, prefill_ms=20.0, kv_transfer_ms=3.25, decode_ms=40.0,
                 kv_bytes=4096, kv_backend="shm")
    got = p.decode(p.encode(p.Tokens(position=3, token_ids=[], finished=True,
                                     timing=t))).record
    assert got.timing == t
    assert p.decode(p.encode(p.PrefillDone(first_token=5, num_chunks=2,
                                           timing=t))).record.timing == t
    # Older senders send none: the field is optional.
    assert p.decode(p.encode(p.Tokens(position=0, token_ids=[1]))).record.timing is None


def test_tracing_off_passes_the_received_context_on():
    span = NO_TRACER.span("x", GOOD)
    assert span.traceparent == GOOD
    span.set("k", 1)
    span.end()
    assert NO_TRACER.span("y").traceparent is None
    assert not NO_TRACER.enabled


def test_spans_go_to_the_file_as_json_lines_with_their_parents(tmp_path):
    pytest.importorskip("opentelemetry.sdk")
    path = tmp_path / "spans.jsonl"
    tracer = Tracer("gateway", enabled=True, file=str(path))
    root = tracer.span("root", GOOD, {"request_id": "r1"})
    trace_id, root_id = root.traceparent.split("-")[1:3]
    assert trace_id == GOOD.split("-")[1] and root_id != GOOD.split("-")[2]
    child = tracer.record("child", root.traceparent, 1_000, 2_000, {"bytes": 7})
    assert child.traceparent.split("-")[1] == trace_id
    root.end()
    tracer.close()
    spans = {s["name"]: s for s in map(json.loads, path.read_text().splitlines())}
    assert set(spans) == {"root", "child"}
    assert spans["root"]["parent_id"] == GOOD.split("-")[2]
    assert spans["child"]["parent_id"] == root_id == spans["root"]["span_id"]
    assert spans["child"]["trace_id"] == spans["root"]["trace_id"] == trace_id
    assert spans["child"]["start_ns"] == 1_000 and spans["child"]["end_ns"] == 2_000
    assert spans["child"]["attributes"] == {"bytes": 7}
    assert spans["root"]["service"] == "gateway"
    assert spans["root"]["attributes"] == {"request_id": "r1"}


def test_a_new_trace_without_a_parent(tmp_path):
    pytest.importorskip("opentelemetry.sdk")
    tracer = Tracer("conductor", enabled=True, file=str(tmp_path / "s.jsonl"))
    a, b = tracer.span("a"), tracer.span("b")
    assert parse_traceparent(a.traceparent) and parse_traceparent(b.traceparent)
    assert a.traceparent.split("-")[1] != b.traceparent.split("-")[1]
    a.end()
    b.end()
    tracer.close()
    tracer.close()  # idempotent
    rows = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [r["parent_id"] for r in rows] == [None, None]
