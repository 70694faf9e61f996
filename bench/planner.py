"""The planner against a fixed deployment, on a bursty segment of the Mooncake trace.

    nice -n 10 python bench/planner.py [--trace PATH] [--segment-s 60] [--time-scale 0.2]
        [--sim-time-scale 0.2] [--max-workers 3] [--slo-ttft-ms 2000 --slo-tpot-ms 60]
        [--max-output-len 64] [--out DIR]

The segment: the ``--segment-s`` seconds of the trace whose busiest 10-second bin is the
most above its quietest (a burst with calm around it), replayed at ``--time-scale``
(0.2: five times faster), each hash id standing for 16 tokens. Simulated workers
(``--executor sim``, the smollm2-cpu profile times ``--sim-time-scale``) behind the real
conductor and gateway; two runs:

    fixed     one prefill and one decode worker all along (a planner with min = max = 1)
    planner   the planner (local actuator) between 1 and ``--max-workers`` of each role

Reported per run: goodput (requests/s meeting both SLOs over the run), the share that
met them, TTFT and TPOT percentiles, failures, and worker-seconds (live prefill and
decode workers, sampled from the conductor every 0.25 s, integrated from the first
request to the last answer). Writes ``planner.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.datasets import read_trace, trace_requests  # noqa: E402
from bench.serve import run_benchmark  # noqa: E402
from bench.serve_report import Slo, results_duration, summarize  # noqa: E402
from tests.cluster import Cluster, free_port  # noqa: E402

MODEL = "smollm2-135m-instruct"
TRACE = Path("/work/shared/traces/mooncake_conversation_trace.jsonl")
BIN_MS = 10_000


def bursty_segment(records: list[dict], segment_s: float) -> list[dict]:
    """The records of the ``segment_s`` window whose busiest bin most exceeds its
    quietest one."""
    bins = Counter(r["timestamp"] // BIN_MS for r in records)
    width = max(1, int(segment_s * 1000 // BIN_MS))
    last = max(bins)
    best = max(range(0, last - width + 2), key=lambda s: (
        max(bins[b] for b in range(s, s + width)) - min(bins[b] for b in range(s, s + width)),
        -s))
    lo, hi = best * BIN_MS, (best + width) * BIN_MS
    return [r for r in records if lo <= r["timestamp"] < hi]


def start(workdir: Path, args, lo: int, hi: int) -> tuple[Cluster, int]:
    gateway = ["--tokenizer-dir", tokenizer_dir(), "--max-model-len", "8192"]
    cluster = Cluster(MODEL, workdir, [], executor="sim", gateway_args=gateway,
                      policy="cache_aware")
    worker = shlex.join([
        "--model", MODEL, "--conductor-addr", cluster.conductor_addr,
        "--heartbeat-addr", cluster.heartbeat_addr, "--kv-cache-mib", "1024",
        "--num-threads", "1", "--executor", "sim", "--sim-profile", "smollm2-cpu",
        "--sim-time-scale", str(args.sim_time_scale), "--heartbeat-interval-s", "0.5"])
    metrics = free_port()
    cluster.start_conductor()
    cluster._spawn("planner", [
        "services.planner", "--conductor-addr", cluster.conductor_addr, "--actuator", "local",
        "--local-log-dir", str(workdir), "--metrics-port", str(metrics),
        "--local-command", "{python} -m services.{role} --worker-id {name} " + worker,
        "--min-prefill", str(lo), "--max-prefill", str(hi), "--min-decode", str(lo),
        "--max-decode", str(hi), "--interval-s", "0.5", "--up-ticks", "2",
        "--down-ticks", "6", "--cooldown-up-s", "2", "--cooldown-down-s", "5",
        "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tbt-ms", str(args.slo_tpot_ms)])
    cluster._spawn("gateway", [
        "services.gateway", "--model", MODEL, "--http-port", str(cluster.http_port),
        "--zmq-addr", cluster.zmq_addr, "--conductor-addr", cluster.conductor_addr,
        "--stream-bind", f"tcp://127.0.0.1:{free_port()}", "--request-timeout-s", "300",
        *gateway])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(cluster.base_url + "/health", timeout=2) as r:
                if r.status == 200 and alive(cluster) == (lo, lo):
                    return cluster, metrics
        except OSError:
            pass
        time.sleep(0.5)
    cluster.stop()
    raise TimeoutError(f"cluster in {workdir} not ready")


def tokenizer_dir() -> str:
    from services.engine.tokenizer_export import tokenizer_dir_for
    return tokenizer_dir_for(MODEL)


def alive(cluster: Cluster) -> tuple[int, int]:
    workers = cluster.conductor_stats(5).workers
    return tuple(sum(w.alive and w.info.role == r for w in workers)
                 for r in ("prefill", "decode"))


def one_run(name: str, workdir: Path, specs, args, lo: int, hi: int) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    cluster, metrics = start(workdir, args, lo, hi)
    samples: list[tuple[float, int, int]] = []
    done = threading.Event()

    def sample():
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                samples.append((time.perf_counter(), *alive(cluster)))
            time.sleep(0.25)

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        sampler.start()
        t0 = time.perf_counter()
        results = asyncio.run(run_benchmark(cluster.base_url, specs, model=MODEL,
                                            progress=False, timeout_s=600))
        t_end = t0 + results_duration(results)
        done.set()
        sampler.join()
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5) as r:
            decisions = [line for line in r.read().decode().splitlines()
                         if line.startswith("pdserve:planner_decisions_total")]
    finally:
        done.set()
        cluster.stop()
    worker_s, peak = 0.0, [0, 0]
    for (ta, pa, da), (tb, _, _) in zip(samples, samples[1:], strict=False):
        span = max(0.0, min(tb, t_end) - max(ta, t0))
        worker_s += span * (pa + da)
        peak = [max(peak[0], pa), max(peak[1], da)]
    summary = summarize(results, results_duration(results),
                        Slo(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms))
    keep = ("completed", "failed", "output_len_mismatch", "duration_s", "goodput",
            "goodput_fraction", "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms")
    return {"run": name, **{k: summary.get(k) for k in keep}, "worker_seconds": worker_s,
            "peak_workers": {"prefill": peak[0], "decode": peak[1]}, "decisions": decisions}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--segment-s", type=float, default=60.0)
    ap.add_argument("--time-scale", type=float, default=0.2)
    ap.add_argument("--sim-time-scale", type=float, default=0.2)
    ap.add_argument("--max-workers", type=int, default=3)
    ap.add_argument("--max-output-len", type=int, default=64)
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=60.0)
    ap.add_argument("--out", default="bench-results")
    args = ap.parse_args(argv)
    segment = bursty_segment(read_trace(args.trace), args.segment_s)
    with tempfile.TemporaryDirectory(prefix="pdserve-planner-") as tmp:
        path = Path(tmp) / "segment.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in segment))
        specs = trace_requests(path, block_size=16, time_scale=args.time_scale,
                               max_output_len=args.max_output_len)
        runs = [one_run("fixed 1P+1D", Path(tmp) / "fixed", specs, args, 1, 1),
                one_run(f"planner up to {args.max_workers}P+{args.max_workers}D",
                        Path(tmp) / "planner", specs, args, 1, args.max_workers)]
    t0 = segment[0]["timestamp"] if segment else 0
    report = {"segment_start_s": t0 / 1000, "segment_s": args.segment_s,
              "requests": len(specs), "settings": vars(args), "runs": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "planner.json").write_text(json.dumps(report, indent=2))
    print(f"{len(specs)} requests from trace second {t0 / 1000:.0f}, replayed "
          f"{args.time_scale}x; SLO TTFT {args.slo_ttft_ms:g} ms, TPOT {args.slo_tpot_ms:g} ms")
    print(f"{'run':<24}{'done':>6}{'fail':>6}{'goodput r/s':>13}{'met SLO':>9}"
          f"{'TTFT p99':>10}{'TPOT p99':>10}{'worker-s':>10}{'peak P+D':>10}")
    for r in runs:
        print(f"{r['run']:<24}{r['completed']:>6}{r['failed']:>6}{r['goodput']:>13.2f}"
              f"{100 * r['goodput_fraction']:>8.0f}%{r['p99_ttft_ms'] or 0:>10.0f}"
              f"{r['p99_tpot_ms'] or 0:>10.1f}{r['worker_seconds']:>10.1f}"
              f"{r['peak_workers']['prefill']:>6}+{r['peak_workers']['decode']}")
    return report


if __name__ == "__main__":
    main()
