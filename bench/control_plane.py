"""Experiment 3: what the control plane costs.

    python bench/control_plane.py [--requests 400] [--decisions 50000] [--seconds 5]
                                  [--out bench/results/control_plane]

Latency: a conductor, a gateway and two simulated decode workers whose steps cost
nothing (profile ``zero``, ``--executor sim``) run as real processes on localhost
(``tests/cluster.py``'s harness). One request at a time (64-token prompt, 1 output
token), after a warm-up, each path timed from send to first token:

* ``worker``: straight to a decode worker (Generate, tokens on our own PULL socket):
  the floor, a worker's own handling and one ZeroMQ hop each way;
* ``route``: one Route call to the conductor (what the gateway waits for);
* ``gateway_zmq``: through the gateway's ZeroMQ client protocol (SDK);
* ``gateway_http``: through the gateway's OpenAI HTTP API, streaming.

The added latency of gateway + conductor is a gateway path's TTFT minus the worker's
(the simulated prefill is ~0 s: ``zero`` costs nanoseconds).

Decisions per second, on one core (CPU 0), with 32 workers (16 prefill, 16 decode)
and 100,000 blocks in the prefix index; requests of 2,048 tokens (128 blocks, the first
64 of them indexed on one worker), SLOs set but admission off so that every decision
runs in full, a heartbeat per worker every 1,000 decisions:

* ``policy``: ``Router.route`` in a loop, in this process;
* ``conductor``: a conductor process pinned to CPU 0, Route calls from this process
  (on CPU 1) with 64 in flight, for ``--seconds``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.routing_rate import MODEL, conductor_rate, pct, policy_rate  # noqa: E402
from common.protocol import Generate, Route, SamplingParams, Tokens  # noqa: E402

PROMPT = list(range(1000, 1064))


# --------------------------------------------------------------------------- latency

async def latency(cluster, n: int) -> dict:
    import aiohttp

    from common.client import AsyncClient
    from common.zmq_auth import make_context
    from common.zmq_io import PullSocket
    from common.zmq_rpc import RpcClient

    ctx = make_context(cluster.keys_dir, "gateway")  # it stands in for the gateway
    conductor = RpcClient(ctx, cluster.conductor_addr, name="bench", server="conductor")
    worker = RpcClient(ctx, cluster.procs["decode-0"].control, name="bench", server="worker")
    pull = PullSocket(ctx, "tcp://127.0.0.1:0", bind=True)
    sampling = {"max_tokens": 1, "temperature": 0.0}
    times: dict[str, list[float]] = {k: [] for k in ("worker", "route", "gateway_zmq",
                                                     "gateway_http")}

    async def direct(i):
        t = time.perf_counter()
        await worker.call(Generate(prompt_token_ids=PROMPT, sampling=SamplingParams(**sampling),
                                   stream_addr=pull.address), request_id=f"d{i}", timeout=5)
        while True:
            msg = await pull.recv()
            if isinstance(msg.record, Tokens) and msg.envelope.request_id == f"d{i}":
                return time.perf_counter() - t

    async def route(i):
        t = time.perf_counter()
        await conductor.call(Route(model=MODEL, prompt_len=len(PROMPT), max_tokens=1,
                                   block_hashes=[1, 2, 3, 4]), request_id=f"r{i}", timeout=5)
        return time.perf_counter() - t

    async with AsyncClient(cluster.zmq_addr, timeout_s=30) as client, \
            aiohttp.ClientSession() as http:
        async def via_zmq(i):
            t = time.perf_counter()
            async for _chunk in client.stream(prompt_token_ids=PROMPT, **sampling):
                return time.perf_counter() - t

        async def via_http(i):
            t = time.perf_counter()
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "stream": True}
            async with http.post(cluster.base_url + "/v1/completions", json=body) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        return time.perf_counter() - t

        paths = {"worker": direct, "route": route, "gateway_zmq": via_zmq,
                 "gateway_http": via_http}
        for i in range(n + 50):  # interleaved, so drift hits every path alike
            for name, fn in paths.items():
                elapsed = await fn(i)
                if i >= 50:
                    times[name].append(elapsed)
    await conductor.close()
    await worker.close()
    await pull.close()
    ctx.term()
    out = {k: pct(v) for k, v in times.items()}
    for k in ("gateway_zmq", "gateway_http"):
        out[f"added_{k}_p50_ms"] = round(out[k]["p50_ms"] - out["worker"]["p50_ms"], 3)
    return out


def run_latency(n: int) -> dict:
    from services.engine.tokenizer_export import tokenizer_dir_for
    from tests.cluster import Cluster

    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(MODEL, Path(tmp), ["decode", "decode"], executor="sim",
                          sim_profile="zero", policy="cache_aware",
                          kv_cache_mib=256, gateway_args=[
                              "--tokenizer-dir", tokenizer_dir_for(MODEL),
                              "--max-model-len", "8192", "--log-format", "json"])
        cluster.start(timeout_s=60)
        try:
            return asyncio.run(latency(cluster, n))
        finally:
            cluster.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--decisions", type=int, default=50_000)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "control_plane"))
    args = ap.parse_args()
    import logging

    import structlog
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    result = {"latency": run_latency(args.requests)}
    print(json.dumps(result["latency"], indent=1), flush=True)
    result["policy"] = policy_rate(args.decisions)
    print("policy alone:", result["policy"], flush=True)
    result["conductor"] = conductor_rate(args.seconds)
    print("conductor:", result["conductor"], flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and .png")


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lat = result["latency"]
    names = ["worker", "route", "gateway_zmq", "gateway_http"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
    xs = range(len(names))
    for q, marker in (("p50_ms", "o"), ("p99_ms", "_")):
        ax1.scatter(xs, [lat[n][q] for n in names], marker=marker, s=120, label=q[:3])
    ax1.set_xticks(list(xs), names)
    ax1.set_ylabel("ms to first token (route: reply)")
    ax1.legend()
    ax1.set_title("one request at a time, zero-cost sim workers", fontsize=9)
    rates = [result["policy"]["per_s"], result["conductor"]["per_s"]]
    ax2.bar(["policy alone", "conductor process"], rates)
    ax2.axhline(20_000, color="r", ls="--", label="goal 20,000/s")
    ax2.set_ylabel("routing decisions / s, one core")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
