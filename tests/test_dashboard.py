"""The Grafana dashboard (deploy/grafana/pdserve.json) asks only for metrics pdserve
exports: a small real cluster (conductor, simulated prefill and decode workers, a cache
pool, the gateway) serves a few requests, every process's /metrics is scraped, and every
series name in the dashboard's PromQL must be among what they export."""

from __future__ import annotations

import json
import re
import urllib.request

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.engine.tokenizer_export import tokenizer_dir_for
from services.engine.weights import DEFAULT_MODEL
from tests.cluster import ROOT, Cluster, free_port
from tests.pool_procs import PoolProc

pytestmark = pytest.mark.timeout(180)

DASHBOARD = ROOT / "deploy" / "grafana" / "pdserve.json"
SERIES = re.compile(r"pdserve:[A-Za-z0-9_:]+")
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum",
                                                             "_created"),
            "gauge": ("",), "summary": ("", "_count", "_sum", "_created"), "unknown": ("",)}


def dashboard_exprs() -> list[str]:
    def walk(panels):
        for p in panels:
            yield from (t["expr"] for t in p.get("targets", []))
            yield from walk(p.get("panels", []))
    return list(walk(json.loads(DASHBOARD.read_text())["panels"]))


def exported(texts: list[str]) -> tuple[set[str], set[str]]:
    """(every series name the families declare, the names that have samples)."""
    declared, sampled = set(), set()
    for text in texts:
        for fam in text_string_to_metric_families(text):
            declared |= {fam.name + s for s in SUFFIXES[fam.type]}
            sampled |= {s.name for s in fam.samples}
    return declared | sampled, sampled


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def test_dashboard_panels_cover_what_the_issue_lists():
    names = {m for e in dashboard_exprs() for m in SERIES.findall(e)}
    assert {"pdserve:time_to_first_token_seconds_bucket",
            "pdserve:inter_token_latency_seconds_bucket", "pdserve:request_goodput_total",
            "pdserve:request_success_total", "pdserve:http_errors_total",
            "pdserve:kv_cache_usage_perc", "pdserve:kv_transfer_sent_bytes_total",
            "pdserve:cache_pool_hits_total", "pdserve:cache_pool_misses_total",
            "pdserve:routing_reasons_total", "pdserve:workers_alive"} <= names
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))  # Grafana keys panels by id


def test_every_metric_the_dashboard_uses_is_exported_by_a_running_cluster(tmp_path):
    pool = PoolProc("pool-0", tmp_path, dram_blocks=256, extra=[
        "--metrics-port", str(pool_metrics := free_port())]).start(learn_block_bytes=True)
    ports = {"conductor": free_port(), "prefill-0": free_port(), "decode-1": free_port()}
    cluster = Cluster(DEFAULT_MODEL, tmp_path, [], executor="sim", sim_profile="smollm2-cpu",
                      kv_cache_mib=256, disagg_threshold=16,
                      gateway_args=["--tokenizer-dir", tokenizer_dir_for(DEFAULT_MODEL),
                                    "--max-model-len", "8192"],
                      conductor_args=["--metrics-port", str(ports["conductor"]),
                                      "--cache-pools", pool.control])
    try:
        # Cluster.start starts the workers of ``roles``; each needs its own metrics port.
        cluster.start_conductor()
        for name in ("prefill-0", "decode-1"):
            cluster.worker_args = ["--sim-time-scale", "0.02", "--heartbeat-interval-s", "0.3",
                                   "--metrics-port", str(ports[name]),
                                   "--cache-pools", pool.control]
            cluster.start_worker(name, name.split("-")[0])
        cluster._spawn("gateway", [
            "services.gateway", "--model", DEFAULT_MODEL, "--http-host", "127.0.0.1",
            "--http-port", str(cluster.http_port), "--zmq-addr", cluster.zmq_addr,
            "--conductor-addr", cluster.conductor_addr,
            "--stream-bind", f"tcp://127.0.0.1:{free_port()}", *cluster.gateway_args])
        cluster.wait_ready(120)
        with httpx.Client(base_url=cluster.base_url, timeout=60) as http:
            for i in range(3):  # long enough prompts to cross to the prefill worker
                r = http.post("/v1/completions", json={
                    "model": DEFAULT_MODEL, "prompt": [5 + i] * 64, "max_tokens": 4})
                assert r.status_code == 200, r.text
            assert http.post("/v1/completions", json={"model": DEFAULT_MODEL}).status_code == 400
        texts = [scrape(cluster.base_url + "/metrics"),
                 scrape(f"http://127.0.0.1:{pool_metrics}/metrics"),
                 *(scrape(f"http://127.0.0.1:{p}/metrics") for p in ports.values())]
    finally:
        cluster.stop()
        pool.stop()
    available, sampled = exported(texts)
    used = {m for e in dashboard_exprs() for m in SERIES.findall(e)}
    assert used, "no pdserve series found in the dashboard"
    missing = sorted(used - available)
    assert not missing, f"the dashboard uses metrics no process exports: {missing}"
    # What the requests above must have moved, not only declared.
    samples = [s for t in texts for f in text_string_to_metric_families(t) for s in f.samples]

    def value(name: str, **labels) -> float:
        return sum(s.value for s in samples
                   if s.name == name and labels.items() <= s.labels.items())

    assert value("pdserve:request_success_total") == 3
    assert value("pdserve:request_goodput_total") == 3  # no targets set: all good
    assert value("pdserve:http_errors_total", status="400") == 1
    assert value("pdserve:time_to_first_token_seconds_count") == 3
    assert value("pdserve:routing_reasons_total", outcome="remote", reason="disaggregated") == 3
    assert value("pdserve:workers_alive", role="prefill") == 1
    assert value("pdserve:workers_alive", role="decode") == 1
    assert "pdserve:kv_cache_usage_perc" in sampled
    assert "pdserve:cache_pool_hits_total" in sampled


def test_goodput_counts_finished_requests_within_their_targets(monkeypatch):
    from prometheus_client import CollectorRegistry

    from services.gateway import metrics as gm

    clock = [0.0]
    monkeypatch.setattr(gm.time, "monotonic", lambda: clock[0])
    m = gm.GatewayMetrics(CollectorRegistry())

    def run(ttft_s, gap_s, n, reason="stop", **slo):
        clock[0] = 0.0
        t = m.track(**slo)
        clock[0] = ttft_s
        t.tokens(1)
        for _ in range(n - 1):
            clock[0] += gap_s
            t.tokens(1)
        t.finish(reason, 8, n)

    run(0.5, 0.05, 5, slo_ttft_ms=1000, slo_tbt_ms=100)  # good
    run(1.5, 0.05, 5, slo_ttft_ms=1000, slo_tbt_ms=100)  # TTFT missed
    run(0.5, 0.20, 5, slo_ttft_ms=1000, slo_tbt_ms=100)  # TBT missed
    run(0.5, 0.05, 5, reason="abort")                    # not finished
    run(9.0, 9.00, 3)                                    # no targets: good
    assert m.goodput._value.get() == 2
    assert m.request_success.labels(finish_reason="stop")._value.get() == 4


def test_routing_reason_classes_are_few_and_fixed():
    from services.conductor.metrics import reason_class

    cases = {"colocated": "colocated", "short prompt (3 < 32)": "short_prompt",
             "no prefill worker": "no_prefill_worker", "disaggregated": "disaggregated",
             "local prefill would stall 2 decodes 0.300s; prefill on p hit": "decode_stall",
             "local 0.100s <= remote 0.200s; prefill on d": "local_faster",
             "remote 0.100s < local 0.200s; prefill on p": "remote_faster",
             "no decode worker has room for 9 tokens of KV": "no_kv_room",
             "predicted TBT 90.0ms > SLO 50.0ms on d": "tbt_slo",
             "predicted TTFT 2.000s > SLO 1.000s": "ttft_slo", "something new": "other"}
    assert {text: reason_class(text) for text in cases} == cases
