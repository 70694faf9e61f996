"""Overload through real processes: a burst ten times what the cluster can prefill, with a
TTFT SLO. What is admitted meets its SLO (measured at the client); the rest is refused at
once with 429 and Retry-After, never with a 503 after a wait.

Simulated workers (``--executor sim``) keep the load cheap and deterministic: a prompt
of 530 tokens takes the smollm2-cpu profile's ~1.3 s scaled by ``SCALE``."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.test_sim_cluster import sim_cluster
from tests.tiny_models import random_prompts

pytestmark = pytest.mark.timeout(240)

SCALE = 0.5  # a 530-token prefill: ~0.65 s simulated, ~1.5 prompts/s on one prefill worker
SLO_MS = 4000
RATE = 15.0  # requests per second: ten times what one prefill worker keeps up with
COUNT = 75


async def _one(client: httpx.AsyncClient, model: str, prompt: list[int],
               sent: float) -> tuple:
    """(status, seconds to the first streamed token or to the refusal, Retry-After)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "stream": True,
            "slo_ttft_ms": SLO_MS}
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return resp.status_code, time.monotonic() - sent, resp.headers.get("retry-after")
        first = None
        async for line in resp.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.monotonic() - sent
    return (200, first, None) if first is not None else (0, time.monotonic() - sent, None)


async def _burst(base_url: str, model: str, prompts: list[list[int]]) -> list[tuple]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120,
                                 limits=httpx.Limits(max_connections=200)) as client:
        tasks, start = [], time.monotonic()
        for i, prompt in enumerate(prompts):
            await asyncio.sleep(max(0.0, start + i / RATE - time.monotonic()))
            tasks.append(asyncio.create_task(_one(client, model, prompt, time.monotonic())))
        return await asyncio.gather(*tasks)


def test_overload_burst_admits_what_meets_the_slo_and_refuses_the_rest_early(tmp_path):
    cluster = sim_cluster(tmp_path, ["prefill", "decode"], policy="cache_aware",
                          worker_args=["--sim-time-scale", str(SCALE),
                                       "--heartbeat-interval-s", "1.0"])
    cluster.start(timeout_s=90)
    try:
        prompts = random_prompts([530] * COUNT, vocab=49152, seed=11)
        results = asyncio.run(_burst(cluster.base_url, cluster.model, prompts))
        admitted = [r for r in results if r[0] == 200]
        refused = [r for r in results if r[0] == 429]
        assert len(admitted) + len(refused) == COUNT, sorted({r[0] for r in results})
        assert admitted and refused
        on_time = [r for r in admitted if r[1] <= SLO_MS / 1e3]
        assert len(on_time) >= 0.9 * len(admitted), (
            f"{len(on_time)}/{len(admitted)} admitted within {SLO_MS} ms; TTFTs "
            f"{sorted(round(r[1], 2) for r in admitted)}")
        for _, waited, retry_after in refused:
            assert retry_after is not None and int(retry_after) >= 1
            assert waited < 2.0, f"refused only after {waited:.1f} s"
    finally:
        cluster.stop()


def test_a_full_worker_queue_is_refused_at_once_with_429_not_a_late_503(tmp_path):
    # Admission off at the conductor: the decode worker's bounded queue is what refuses.
    cluster = sim_cluster(tmp_path, ["decode"], policy="cache_aware",
                          conductor_args=["--admission", "false"],
                          worker_args=["--sim-time-scale", str(SCALE), "--max-waiting", "3"])
    cluster.start(timeout_s=90)
    try:
        prompts = random_prompts([530] * 20, vocab=49152, seed=12)
        results = asyncio.run(_burst(cluster.base_url, cluster.model, prompts))
        statuses = sorted({r[0] for r in results})
        assert statuses == [200, 429], statuses
        refused = [r for r in results if r[0] == 429]
        assert all(r[2] is not None and int(r[2]) >= 1 for r in refused)
        assert max(r[1] for r in refused) < 2.0
        stats = cluster.worker_stats("decode-0")
        assert stats.num_requests == 0 and stats.waiting == 0  # the admitted all finished
    finally:
        cluster.stop()
