"""One request through a real disaggregated cluster (simulated workers): one trace whose
spans come from every process with the right parents, and a timing breakdown that adds
up to the latency the gateway measured.

Each process writes its spans as JSON lines to a file of its own (``tracing_file``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from common.client import Client
from tests.cluster import Host
from tests.test_sim_cluster import sim_cluster
from tests.tiny_models import random_prompts

pytest.importorskip("opentelemetry.sdk")
pytestmark = pytest.mark.timeout(180)

CLIENT_TRACE, CLIENT_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
# Stages are timed in four processes; what they leave out is the hops between them
# (Generate to decode, the last Tokens back) and the gateway's own bookkeeping: a few
# ms, tens on a loaded 2-core machine.
TOLERANCE_MS = 60.0


def _tracing(path: Path) -> list[str]:
    return ["--tracing", "true", "--tracing-file", str(path)]


def _spans(workdir: Path, trace_id: str, want: int, timeout_s: float = 10.0) -> list[dict]:
    """The spans of ``trace_id`` in every process's file, once ``want`` are there."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = [s for f in sorted(workdir.glob("*.spans.jsonl"))
                 for s in map(json.loads, f.read_text().splitlines())
                 if s["trace_id"] == trace_id]
        if len(spans) >= want or time.monotonic() > deadline:
            return spans
        time.sleep(0.1)


def test_one_request_one_trace_across_every_process_and_a_breakdown_that_adds_up(tmp_path):
    workers = {name: Host(env={"PDSERVE_TRACING": "1", "PDSERVE_TRACING_FILE":
                               str(tmp_path / f"{name}.spans.jsonl")})
               for name in ("prefill-0", "decode-1")}
    cluster = sim_cluster(
        tmp_path, ["prefill", "decode"], disagg_threshold=16, worker_hosts=workers,
        conductor_args=_tracing(tmp_path / "conductor.spans.jsonl"),
        worker_args=["--sim-time-scale", "0.2", "--heartbeat-interval-s", "0.3"])
    cluster.gateway_args = [*cluster.gateway_args,
                            *_tracing(tmp_path / "gateway.spans.jsonl")]
    cluster.start(timeout_s=90)
    try:
        warm, prompt = random_prompts([300, 400], vocab=49152, seed=3)
        # The first request also opens (and CURVE-authenticates) the gateway's and the
        # decode worker's connections: time no stage owns. Measure a later one.
        assert httpx.post(cluster.base_url + "/v1/completions", timeout=60, json={
            "model": cluster.model, "prompt": warm, "max_tokens": 2}).status_code == 200
        sent = time.monotonic()
        resp = httpx.post(cluster.base_url + "/v1/completions", timeout=60,
                          headers={"traceparent": TRACEPARENT},
                          json={"model": cluster.model, "prompt": prompt, "max_tokens": 12,
                                "ignore_eos": True, "pdserve": {"timing": True}})
        latency_ms = (time.monotonic() - sent) * 1e3
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["usage"]["completion_tokens"] == 12
        t = body["timing"]
        print("timing", json.dumps(t))

        # The breakdown: the conductor's decision, the KV moved, stages that add up.
        assert t["routing"]["decode"] == "decode-1"
        assert t["routing"]["prefill"] == "prefill-0"
        assert t["routing"]["reason"]
        assert t["kv_bytes"] > 0 and t["kv_backend"] in ("shm", "tcp", "ucx")
        assert t["prefill"] > 0 and t["decode"] > 0 and t["kv_transfer"] >= 0
        stages = t["route"] + t["queue"] + t["prefill"] + t["kv_transfer"] + t["decode"]
        assert -1.0 <= t["total"] - stages <= TOLERANCE_MS, t
        assert t["first_token"] <= t["total"] <= latency_ms
        # The prompt's computation is the largest stage of a 400-token prefill here.
        assert t["route"] + t["queue"] < t["prefill"] + t["decode"]

        spans = _spans(tmp_path, CLIENT_TRACE, want=13)
        by_name = {s["name"]: s for s in spans}
        assert len(by_name) == len(spans), sorted(s["name"] for s in spans)
        assert {n: s["service"] for n, s in by_name.items()} == {
            "gateway.request": "gateway", "gateway.route": "gateway",
            "gateway.first_token": "gateway", "conductor.route": "conductor",
            "decode.request": "decode", "decode.queue": "decode", "decode.kv_wait": "decode",
            "decode.decode": "decode", "prefill.request": "prefill",
            "prefill.queue": "prefill", "prefill.compute": "prefill",
            "prefill.kv_transfer": "prefill"}
        root = by_name["gateway.request"]
        assert root["parent_id"] == CLIENT_SPAN  # the client's span is the trace's parent
        parent = {n: s["parent_id"] for n, s in by_name.items()}
        span_id = {n: s["span_id"] for n, s in by_name.items()}
        for child in ("gateway.route", "gateway.first_token", "conductor.route",
                      "decode.request"):
            assert parent[child] == span_id["gateway.request"], child
        assert parent["prefill.request"] == span_id["decode.request"]
        for child in ("decode.queue", "decode.kv_wait", "decode.decode"):
            assert parent[child] == span_id["decode.request"], child
        for child in ("prefill.queue", "prefill.compute", "prefill.kv_transfer"):
            assert parent[child] == span_id["prefill.request"], child
        kv = by_name["prefill.kv_transfer"]["attributes"]
        assert kv["bytes"] == t["kv_bytes"] and kv["backend"] == t["kv_backend"]
        assert by_name["decode.kv_wait"]["attributes"]["bytes"] == t["kv_bytes"]
        assert by_name["conductor.route"]["attributes"]["decode_id"] == "decode-1"
        assert by_name["conductor.route"]["attributes"]["prefill_id"] == "prefill-0"

        # A hostile traceparent is ignored: the request is served, in a trace of its own.
        resp = httpx.post(cluster.base_url + "/v1/completions", timeout=60,
                          headers={"traceparent": "00-zzzz-not-a-trace"},
                          json={"model": cluster.model, "prompt": prompt[:50],
                                "max_tokens": 2})
        assert resp.status_code == 200 and "timing" not in resp.json()

        # The SDK: the same breakdown on the Completion, for a local prefill this time.
        with Client(cluster.zmq_addr, timeout_s=60) as client:
            done = client.generate(prompt_token_ids=prompt[:8], max_tokens=4,
                                   ignore_eos=True, timing=True)
        assert len(done.token_ids) == 4
        st = done.timing
        assert st.decode_id == "decode-1" and st.prefill_id == "" and st.kv_bytes == 0
        assert st.kv_transfer_ms == 0.0 and st.total_ms > 0
        local = st.route_ms + st.queue_ms + st.prefill_ms + st.decode_ms
        assert -1.0 <= st.total_ms - local <= TOLERANCE_MS, st
    finally:
        cluster.stop()
