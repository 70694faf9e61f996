"""Routing decisions per second on one core: the policy alone, and the conductor process.

Used by ``bench/control_plane.py`` (experiment 3). The state: 32 workers (16 prefill,
16 decode), 100,000 blocks in the prefix index in chains of 64, requests of 2,048
tokens (128 blocks, the first 64 indexed on one worker). SLOs are set but admission is
off, so that every decision runs in full (an early rejection would be cheaper).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import random
import sys
import time

import numpy as np

from common.cost_profile import load_profile
from common.protocol import Heartbeat, Route, WorkerInfo
from services.conductor.cache_policy import Rejection
from services.conductor.registry import Registry, WorkerView
from services.conductor.router import Router, RouterConfig, RouteRequest

MODEL = "smollm2-135m-instruct"
BLOCKS, WORKERS, CHAIN = 100_000, 32, 128


def pct(values: list[float]) -> dict:
    ms = np.asarray(values) * 1e3
    return {"p50_ms": round(float(np.percentile(ms, 50)), 3),
            "p90_ms": round(float(np.percentile(ms, 90)), 3),
            "p99_ms": round(float(np.percentile(ms, 99)), 3), "n": len(values)}


def build_state(seed: int = 0):
    """32 worker views, 100,000 indexed blocks in chains, and request chains."""
    rng = random.Random(seed)
    views = [WorkerView(WorkerInfo(
                        worker_id=f"{role}-{i}", role=role, model=MODEL,
                        control_addr=f"tcp://127.0.0.1:{7000 + 2 * i + (role == 'decode')}",
                        kv_addr="", host_id="h", block_size=16, num_blocks=20_000,
                        fingerprint="fp"), free_blocks=20_000)
             for role in ("prefill", "decode") for i in range(WORKERS // 2)]
    chains = [[(c << 8) | j for j in range(CHAIN)] for c in range(BLOCKS // 64)]
    placements = []
    for c, chain in enumerate(chains):  # 1,562 chains of 64 indexed blocks each
        placements.append((views[c % WORKERS].worker_id, chain[:64]))
    requests = [chains[rng.randrange(len(chains))] for _ in range(4096)]
    return views, placements, requests


def heartbeat_for(view: WorkerView, seq: int, rng: random.Random) -> Heartbeat:
    return Heartbeat(worker_id=view.worker_id, role=view.role, seq=seq,
                     waiting=rng.randrange(4), running=rng.randrange(32),
                     queued_prefill_tokens=rng.randrange(10_000),
                     free_blocks=rng.randrange(5_000, 20_000), total_blocks=20_000,
                     step_time_ms=20.0)


# Admission off: every decision runs in full (an early rejection would be cheaper).
SLO_TTFT_S, SLO_TBT_S = 60.0, 1.0


def policy_rate(n: int) -> dict:
    os.sched_setaffinity(0, {0})
    views, placements, requests = build_state()
    router = Router(RouterConfig(slo_ttft_s=SLO_TTFT_S, slo_tbt_s=SLO_TBT_S, admission=False),
                    load_profile("smollm2-cpu"))
    for loc, chain in placements:
        router.index.stored(loc, chain)
    registry = Registry(3600)
    for v in views:
        registry.register(v)
    rng = random.Random(1)
    reqs = [RouteRequest(MODEL, CHAIN * 16, r, max_tokens=256) for r in requests]
    rejected = 0
    start = time.perf_counter()
    for i in range(n):
        if i % 1000 == 0:
            for v in views:
                registry.heartbeat(heartbeat_for(v, i, rng))
        rejected += isinstance(router.route(views, reqs[i % len(reqs)]), Rejection)
    elapsed = time.perf_counter() - start
    os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    return {"decisions": n, "rejected": rejected, "seconds": round(elapsed, 3),
            "per_s": round(n / elapsed), "index_blocks": len(router.index),
            "workers": len(views)}


def _serve_conductor(addr: str, beats: str, ready) -> None:
    """Child process: a conductor on CPU 0 with the benchmark's state already in it,
    logging every decision as in production (JSON lines, to /dev/null here)."""
    os.sched_setaffinity(0, {0})
    sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (the process's whole life)
    from common.logging import configure_logging
    from common.service_main import install_uvloop
    from services.conductor.server import Conductor, ConductorSettings

    async def main():
        conductor = Conductor(ConductorSettings(
            control_addr=addr, heartbeat_addr=beats, heartbeat_interval_s=3600,
            slo_ttft_ms=SLO_TTFT_S * 1e3, slo_tbt_ms=SLO_TBT_S * 1e3, admission=False))
        views, placements, _ = build_state()
        for v in views:
            conductor.registry.register(v)
        for loc, chain in placements:
            conductor.router.index.stored(loc, chain)
        await conductor.start()
        ready.set()
        await asyncio.Event().wait()
    configure_logging("json", service="conductor")
    install_uvloop()
    asyncio.run(main())


async def _drive(addr: str, beats: str, seconds: float, window: int) -> dict:
    """Route calls, ``window`` in flight, while a round of 32 heartbeats goes out every
    0.1 s (ten times the production rate), so in-flight counters reset as they would."""
    import zmq.asyncio

    from common.zmq_io import Publisher
    from common.zmq_rpc import RemoteError, RpcClient

    views, _, requests = build_state()
    ctx = zmq.asyncio.Context()
    client = RpcClient(ctx, addr, name="bench")
    pub = Publisher(ctx, beats, bind=False)
    done = rejected = 0
    deadline = time.perf_counter() + seconds
    latencies: list[float] = []

    async def beat():
        rng, seq = random.Random(2), 0
        while True:
            for v in views:
                await pub.publish(heartbeat_for(v, seq, rng), topic=b"heartbeat")
            seq += 1
            await asyncio.sleep(0.1)

    async def lane(k: int):
        nonlocal done, rejected
        i = k
        while time.perf_counter() < deadline:
            t = time.perf_counter()
            try:
                await client.call(Route(model=MODEL, prompt_len=CHAIN * 16, max_tokens=256,
                                        block_hashes=requests[i % len(requests)]), timeout=10)
            except RemoteError as exc:
                if exc.code != "overloaded":
                    raise
                rejected += 1
            latencies.append(time.perf_counter() - t)
            done += 1
            i += window
    beating = asyncio.create_task(beat())
    await asyncio.sleep(0.5)  # the subscription settles
    start = time.perf_counter()
    deadline = start + seconds
    await asyncio.gather(*(lane(k) for k in range(window)))
    elapsed = time.perf_counter() - start
    beating.cancel()
    await client.close()
    await pub.close()
    ctx.term()
    return {"decisions": done, "rejected": rejected, "seconds": round(elapsed, 3),
            "per_s": round(done / elapsed), "in_flight": window, "latency": pct(latencies)}


def conductor_rate(seconds: float, window: int = 64) -> dict:
    from tests.cluster import free_port

    addr, beats = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    ready = mp.get_context("spawn").Event()
    child = mp.get_context("spawn").Process(target=_serve_conductor,
                                            args=(addr, beats, ready))
    child.start()
    try:
        if not ready.wait(60):
            raise SystemExit("the conductor did not start")
        os.sched_setaffinity(0, {1})
        return asyncio.run(_drive(addr, beats, seconds, window))
    finally:
        child.terminate()
        child.join(10)
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
