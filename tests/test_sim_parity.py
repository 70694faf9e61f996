"""The offline simulator and live simulated workers are one model: the same small trace
through (a) bench/sim and (b) ``--executor sim`` workers behind the real gateway and
conductor, with the same cost profile, gets the same routing decision for >= 95% of
requests and a mean TTFT within 10%.

Both sides run the conductor's TTFT correction off. The simulator models it (its decode
workers report first-token times, tests/test_sim_acks.py), but here it would learn what
no profile carries: the live path's own time per request (gateway and socket hops, a
loaded host's wake-ups: 10-70 ms, up to twice a short prompt's modelled TTFT), so each
prefill worker's learned factor differs from the simulator's by a few percent at random.
With two prefill workers holding the same prefix and idle, that difference alone picks
one, and once one such tie goes the other way every later tie alternates with it
(measured: 18-32 of 41 decisions with it on, 40-41 of 41 with it off)."""

from __future__ import annotations

import dataclasses
import os
import random
import re
import statistics
import threading
import time

import pytest

from bench.sim.profiles import Profile
from bench.sim.simulator import SimRequest, Simulator
from common.client import Client
from common.cost_profile import load_profile
from common.records import CostCoefficients
from services.conductor.router import Router, RouteRequest
from services.conductor.server import ConductorSettings
from services.engine.tokenizer_export import tokenizer_dir_for
from services.engine.weights import DEFAULT_MODEL
from tests.cluster import Cluster

# On by default. On a host oversubscribed beyond OVERLOAD runnable threads per core
# (1-minute load average) the live processes lose whole seconds waiting for a core: a
# long prompt's KV lands 0.4-0.9 s late and single requests stall for seconds, which no
# model of the profile's costs can follow (measured on a 2-core host: 40-41 of 41
# decisions and mean TTFT within +3-6 % at load 9-10; mean TTFT +29 % at load 12-18).
# There the test is skipped unless PDSERVE_SIM_PARITY=1 forces it.
OVERLOAD = 4.0
_LOAD = os.getloadavg()[0] / (os.cpu_count() or 1)
pytestmark = [pytest.mark.timeout(300), pytest.mark.skipif(
    _LOAD > OVERLOAD and not os.environ.get("PDSERVE_SIM_PARITY"),
    reason=f"host load {_LOAD:.1f} per core > {OVERLOAD}: the live side cannot keep the "
           "profile's times (PDSERVE_SIM_PARITY=1 runs it anyway)")]

PROFILE = "smollm2-cpu"
SCALE = 1.25  # the live workers sleep the profile's times this much longer, and the
# trace's times stretch alike: the live path's own per-request cost (~20-80 ms on a
# loaded 2-core host) weighs less against the work
HEARTBEAT_S = 0.2
CORRECTION = False  # the conductor's learned TTFT factor, on both sides (see above)
BLOCK = 16
GATEWAY = ["--tokenizer-dir", tokenizer_dir_for(DEFAULT_MODEL), "--max-model-len", "8192"]


def trace(n: int = 40, seed: int = 11) -> list[tuple[float, list[int], int]]:
    """(arrival s, prompt token ids, max tokens). A first request decodes through the
    whole run, so the decode worker is always busy: a long prompt (a 600-token question
    after a 128-token system prefix) would stall it beyond the conductor's budget and
    goes to a prefill worker, a short one (8 tokens after the prefix) is prefilled where
    its prefix is cached and that is quickest. Long prompts dominate the mean TTFT, so
    the live path's own ~20-50 ms per request (gateway, sockets) stays a few percent.
    Arrivals are spaced so that no decision hangs on when a heartbeat happened to land
    (live, each worker beats at its own phase) or on the live path's lag (a job reaches
    its worker 10-80 ms after the decision, and on a 2-core host at load 12 a long
    prompt's KV lands up to 0.6 s late): a long prefill (1.51 s, or 1.78 s with no
    prefix cached, times SCALE) is still running at the next arrival (gaps <= 1.44 s)
    and has ended and been reported before the one after (two gaps >= 2.48 s: 0.7 s to
    spare, a heartbeat included). Queues stay short: decisions then follow from the
    prefix caches and the load, which both sides must keep alike; one flipped decision
    would also leave a prefix on another worker and flip later ones."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 49152) for _ in range(128)] for _ in range(3)]
    out, t = [(0.5 * SCALE, [rng.randrange(3, 49152) for _ in range(32)], 1250)], 1.0
    for _ in range(n):
        t += rng.uniform(1.24, 1.44)
        tail = [rng.randrange(3, 49152) for _ in range(rng.choice([8, 600, 600]))]
        out.append((t * SCALE, rng.choice(prefixes) + tail, rng.choice([4, 8])))
    return out


def chain(tokens: list[int]) -> list[int]:
    """Ids of the full blocks' prefix chains (any consistent id stands for the hash)."""
    return [hash(tuple(tokens[: (i + 1) * BLOCK])) for i in range(len(tokens) // BLOCK)]


def offline(reqs, kv_blocks: int) -> list[SimRequest]:
    cp = load_profile(PROFILE)
    settings = ConductorSettings(policy="cache_aware", ttft_correction=CORRECTION)
    router = Router(settings.router_config(), cp)
    true = Profile.from_cost_profile(cp, kv_blocks=kv_blocks)
    # What the live sim executor sleeps; its KV moves at once. Its workers share the
    # host, so the conductor applies the profile's contention factors to its
    # predictions (shared_host below), but they sleep rather than compute: the work
    # itself is not slowed by the others (no contention in the true profile), and the
    # serving path's per-token overhead is the live processes' own; it sleeps the
    # fitted decode step, not the calibration's measured points (decode_shape).
    true = dataclasses.replace(
        true, cost=CostCoefficients(*(c * SCALE for c in cp.coefficients())),
        link_bandwidth=1e15, contention=(), token_overhead_s=0.0, decode_shape=())
    sims = [SimRequest(i, t, len(p), n, chain(p)) for i, (t, p, n) in enumerate(reqs)]

    def route(views, req):
        # With its id, as the live conductor routes: counted per request until a
        # heartbeat acknowledges it, and its predicted TTFT kept for the correction.
        return router.route(views, RouteRequest("sim", req.prompt, req.hashes,
                                                max_tokens=req.output),
                            req.request_id, now=req.arrival)
    Simulator(true, route, prefill=2, decode=1, index=router.index, cost=router.cost,
              heartbeat_s=HEARTBEAT_S, shared_host=True,
              correction=router.correction).run(sims)
    return sims


def live(tmp_path, reqs) -> tuple[dict[str, str | None], list[float], int]:
    cluster = Cluster(DEFAULT_MODEL, tmp_path, ["prefill", "prefill", "decode"],
                      executor="sim", sim_profile=PROFILE, kv_cache_mib=256,
                      policy="cache_aware", gateway_args=GATEWAY,
                      conductor_args=["--ttft-correction", str(CORRECTION).lower()],
                      worker_args=["--sim-time-scale", str(SCALE),
                                   "--heartbeat-interval-s", str(HEARTBEAT_S)])
    cluster.start(timeout_s=90)
    try:
        kv_blocks = cluster.worker_stats("decode-2").info.num_blocks
        ttft: list[float | None] = [None] * len(reqs)
        reasons: list[str] = [""] * len(reqs)
        start = time.monotonic() + 0.5

        def one(i: int) -> None:
            t, prompt, n = reqs[i]
            time.sleep(max(0.0, start + t - time.monotonic()))
            with Client(cluster.zmq_addr, timeout_s=180) as client:
                sent = time.monotonic()
                for chunk in client.stream(prompt_token_ids=prompt, max_tokens=n,
                                           request_id=f"par-{i}", timing=True):
                    if ttft[i] is None and chunk.token_ids:
                        ttft[i] = time.monotonic() - sent
                    if chunk.timing is not None:
                        reasons[i] = chunk.timing.route_reason
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(200)
    finally:
        cluster.stop()
    # Each request's own decision, from the route reason its timing carries (not the
    # conductor log's order: a stalled host can deliver two arrivals out of order).
    routed = {}
    for i, reason in enumerate(reasons):
        where = re.search(r"prefill on (\S+) hit", reason)
        if where:
            routed[i] = None if where.group(1).startswith("decode") else where.group(1)
    return routed, ttft, kv_blocks


def test_offline_simulator_agrees_with_live_sim_workers(tmp_path):
    reqs = trace()
    routed, ttft_live, kv_blocks = live(tmp_path, reqs)
    sims = offline(reqs, kv_blocks)
    assert len(routed) == len(reqs) and all(t is not None for t in ttft_live)
    agree = sum(routed[r.rid] == r.routed_prefill for r in sims)
    decisions = [(routed[r.rid], r.routed_prefill) for r in sims]
    assert agree >= 0.95 * len(reqs), decisions
    # Both kinds of decision occur, or the agreement says little.
    assert {p is None for p, _ in decisions} == {True, False}
    mean_live = statistics.mean(ttft_live)
    mean_sim = statistics.mean(r.ttft for r in sims)
    assert mean_sim == pytest.approx(mean_live, rel=0.10), (mean_sim, mean_live)
