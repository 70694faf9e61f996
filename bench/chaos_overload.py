"""Admission under a 10x overload burst, measured at the client.

    python bench/chaos_overload.py [--count 100] [--rate 10] [--tokens 530]
                                   [--slo-ms 5000] [--max-tokens 16] [--model NAME|DIR]
                                   [--sim-scale S] [--out overload.json]

Real processes on loopback (``tests.cluster``): gateway, conductor (cache-aware policy,
SLO admission, the ``smollm2-cpu`` cost profile), one prefill and one decode worker on
the default model (SmolLM2-135M, float32). ``--sim-scale S`` runs simulated workers
instead (``--executor sim``, that profile's timings times S), which costs no CPU.
``count`` streamed HTTP requests of ``tokens`` random prompt tokens arrive at ``rate``
per second, each with ``slo_ttft_ms``. Reported: admitted and how many of them had
their first token within the SLO (the goal: 90 % or more), TTFT p50/p90/max of the
admitted, refused with 429 (all with Retry-After? how soon?), any other status (a 503
after a wait is the failure this guards against), and whether the workers were idle
again afterwards (nothing refused or answered ran on).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as a script: make `bench.` and `tests.` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.engine.tokenizer_export import tokenizer_dir_for  # noqa: E402
from tests.cluster import Cluster  # noqa: E402
from tests.tiny_models import random_prompts  # noqa: E402

DEFAULT_MODEL = "smollm2-135m-instruct"


async def _one(client: httpx.AsyncClient, model: str, prompt: list[int], slo_ms: float,
               max_tokens: int, sent: float) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "slo_ttft_ms": slo_ms, "ignore_eos": True}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return {"status": resp.status_code, "s": time.monotonic() - sent,
                        "retry_after": resp.headers.get("retry-after")}
            first = None
            async for line in resp.aiter_lines():
                if first is None and line.startswith("data: {"):
                    first = time.monotonic() - sent
                if '"error"' in line:
                    return {"status": "stream error", "s": time.monotonic() - sent}
    except httpx.HTTPError as exc:
        return {"status": type(exc).__name__, "s": time.monotonic() - sent}
    if first is None:
        return {"status": "no token", "s": time.monotonic() - sent}
    return {"status": 200, "s": first, "done_s": time.monotonic() - sent}


async def burst(base_url: str, model: str, prompts: list[list[int]], rate: float,
                slo_ms: float, max_tokens: int) -> list[dict]:
    """Send ``prompts`` at ``rate`` per second; every request's outcome, in order."""
    async with httpx.AsyncClient(base_url=base_url, timeout=300,
                                 limits=httpx.Limits(max_connections=1000)) as client:
        tasks, start = [], time.monotonic()
        for i, prompt in enumerate(prompts):
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            tasks.append(asyncio.create_task(
                _one(client, model, prompt, slo_ms, max_tokens, time.monotonic())))
        return await asyncio.gather(*tasks)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, math.ceil(q * len(xs)) - 1)], 2)


def summarize(results: list[dict], slo_ms: float) -> dict:
    admitted = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] == 429]
    other: dict[str, int] = {}
    for r in results:
        if r["status"] not in (200, 429):
            other[str(r["status"])] = other.get(str(r["status"]), 0) + 1
    ttft = [r["s"] for r in admitted]
    on_time = sum(t <= slo_ms / 1e3 for t in ttft)
    return {"sent": len(results), "admitted": len(admitted), "admitted_on_time": on_time,
            "on_time_share": round(on_time / len(admitted), 3) if admitted else None,
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p90_s": pct(ttft, 0.9),
            "ttft_max_s": pct(ttft, 1.0), "refused_429": len(refused),
            "refused_with_retry_after": sum(r["retry_after"] is not None for r in refused),
            "refused_max_s": pct([r["s"] for r in refused], 1.0), "other": other}


def idle_after(cluster: Cluster, timeout_s: float = 60.0) -> dict[str, int]:
    """Per worker, requests still held once the burst is answered (0: all freed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = {n: cluster.worker_stats(n).num_requests for n in cluster.procs
                if n not in ("conductor", "gateway")}
        if not any(held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.5)


def run(args: argparse.Namespace) -> dict:
    work = Path(args.workdir or tempfile.mkdtemp(prefix="pdserve-overload-"))
    sim = args.sim_scale > 0
    worker_args = ["--heartbeat-interval-s", "1.0"]
    if sim:
        worker_args += ["--sim-time-scale", str(args.sim_scale)]
    cluster = Cluster(args.model, work, ["prefill", "decode"], policy="cache_aware",
                      executor="sim" if sim else "model", sim_profile="smollm2-cpu",
                      kv_cache_mib=1024 if sim else 256, worker_args=worker_args,
                      gateway_args=["--tokenizer-dir", tokenizer_dir_for(args.model),
                                    "--max-model-len", "8192"] if sim else [])
    cluster.start(timeout_s=300)
    try:
        prompts = random_prompts([args.tokens] * args.count, vocab=49152, seed=args.seed)
        t0 = time.monotonic()
        results = asyncio.run(burst(cluster.base_url, cluster.model, prompts, args.rate,
                                    args.slo_ms, args.max_tokens))
        res = summarize(results, args.slo_ms)
        res["took_s"] = round(time.monotonic() - t0, 1)
        res["admitted_ttft_s"] = [(i, round(i / args.rate, 2), round(r["s"], 2))
                                  for i, r in enumerate(results) if r["status"] == 200]
        res["held_after"] = idle_after(cluster)
    finally:
        cluster.stop()
    res["config"] = {k: getattr(args, k) for k in ("count", "rate", "tokens", "slo_ms",
                                                     "max_tokens", "model", "sim_scale",
                                                     "seed")}
    return res


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--rate", type=float, default=10.0)
    ap.add_argument("--tokens", type=int, default=530)
    ap.add_argument("--slo-ms", type=float, default=5000.0)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--sim-scale", type=float, default=0.0,
                    help="simulated workers at this time scale (0: the real model)")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--workdir", default="")
    ap.add_argument("--out", default="")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    res = run(args)
    print(json.dumps(res, indent=2), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
