"""The live conductor (real sockets, its own registry and cost model) decides exactly as
the policy objects do on the same inputs, and as the simulator's run did; it rejects
with a retry time, spreads a burst, and fits its cost model on heartbeat samples."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import zmq.asyncio

from bench.sim.profiles import Profile
from bench.sim.simulator import SimRequest, Simulator
from common.cost_profile import CostProfile, save_profile
from common.protocol import GetStats, Heartbeat, Hello, Route, StepSample, WorkerInfo
from common.records import CostCoefficients
from common.zmq_rpc import RemoteError, RpcClient
from services.conductor.cache_policy import CacheAwarePolicy, PolicyConfig, Rejection
from services.conductor.cost_model import CostModel
from services.conductor.prefix_index import PrefixIndex
from services.conductor.registry import Registry, WorkerView
from services.conductor.router import Router, RouterConfig, RouteRequest
from services.conductor.routing_policy import PolicyRequest
from services.conductor.server import Conductor, ConductorSettings
from tests.cluster import free_port

# prefill(n, c) = 0.05 + 1e-3 n + 1e-6 n (n/2 + c); step(B, K) = 0.01 + 1e-3 B + 1e-5 K
COST = CostCoefficients(0.05, 1e-3, 1e-6, 0.01, 1e-3, 1e-5)
PROFILE = CostProfile("test", *(getattr(COST, k) for k in COST.__slots__),
                      kv_bytes_per_token=1000, block_size=64, link_bandwidth=1e7,
                      pool_bandwidth=1e7)
SIM_PROFILE = Profile(name="test", cost=COST, kv_bytes_per_token=1000, block_size=64,
                      kv_blocks=200, link_bandwidth=1e7, pool_bandwidth=1e7)


@pytest.fixture
def profile_path(tmp_path):
    return str(save_profile(PROFILE, tmp_path / "test.json"))


class Live:
    """A Conductor in this event loop, with a client on its control socket."""

    def __init__(self, profile_path: str, **settings) -> None:
        self.conductor = Conductor(ConductorSettings(
            control_addr=f"tcp://127.0.0.1:{free_port()}",
            heartbeat_addr=f"tcp://127.0.0.1:{free_port()}", heartbeat_interval_s=60.0,
            cost_profile=profile_path, **settings))
        self.ctx = zmq.asyncio.Context()

    async def __aenter__(self) -> Live:
        await self.conductor.start()
        self.client = RpcClient(self.ctx, self.conductor.rpc.address, name="test")
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.close()
        self.ctx.term()
        await self.conductor.close()

    async def hello(self, wid: str, role: str, *, blocks: int = 200, block_size: int = 64,
                    fingerprint: str = "test") -> None:
        await self.client.call(Hello(info=WorkerInfo(
            worker_id=wid, role=role, model="sim", control_addr=f"tcp://{wid}:1",
            kv_addr=f"tcp://{wid}:2", host_id=wid, block_size=block_size, num_blocks=blocks,
            fingerprint=fingerprint)), timeout=5)

    async def route(self, n: int, hashes=(), *, output: int = 0, ttft_ms=None, tbt_ms=None,
                    exclude=(), request_id: str | None = None) -> tuple:
        """(decode id, prefill id or None, reason) or ("rejected", reason, retry after)."""
        try:
            reply = (await self.client.call(Route(
                model="sim", prompt_len=n, block_hashes=list(hashes), exclude=list(exclude),
                slo_ttft_ms=ttft_ms, slo_tbt_ms=tbt_ms, max_tokens=output),
                request_id=request_id or f"r{random.random()}", timeout=5)).record
        except RemoteError as exc:
            assert exc.code == "overloaded", exc
            return ("rejected", exc.message, exc.retry_after_s)
        return (reply.decode_id, reply.prefill_id, reply.reason)


def outcome(d) -> tuple:
    if isinstance(d, Rejection):
        return ("rejected", d.reason, d.retry_after_s)
    return (d.decode.worker_id, d.prefill.worker_id if d.prefill else None, d.reason)


def heartbeat(wid, role, seq, *, waiting=0, running=0, queued=0, free=200, **samples):
    return Heartbeat(worker_id=wid, role=role, seq=seq, waiting=waiting, running=running,
                     queued_prefill_tokens=queued, free_blocks=free, total_blocks=200,
                     step_time_ms=0.0, **samples)


WORKERS = [("decode-0", "decode"), ("decode-1", "decode"), ("prefill-0", "prefill"),
           ("prefill-1", "prefill")]


async def test_live_conductor_chooses_what_the_policy_object_chooses(profile_path):
    index = PrefixIndex()
    policy = CacheAwarePolicy(index, CostModel(COST), PolicyConfig(1000, 1e7, 1e7))
    views = {w: WorkerView(WorkerInfo(worker_id=w, role=r, model="sim", control_addr="",
                                      kv_addr="", host_id=w, block_size=64, num_blocks=200,
                                      fingerprint="test"), free_blocks=200)
             for w, r in WORKERS}
    rng = random.Random(7)
    states = [dict(waiting=rng.randrange(3), running=rng.randrange(6),
                   queued=rng.randrange(0, 3000, 100), free=rng.randrange(20, 200))
              for _ in range(40)]
    async with Live(profile_path, slo_ttft_ms=4000, slo_tbt_ms=80) as live:
        for w, r in WORKERS:
            await live.hello(w, r)
        got, want = [], []
        for i in range(120):
            if i % 10 == 0:  # a round of heartbeats between bursts of requests
                for j, (w, r) in enumerate(WORKERS):
                    hb = heartbeat(w, r, i, **states[(i // 10 * 4 + j) % len(states)])
                    assert live.conductor.apply_heartbeat(hb)
                    views[w].last_seen = float(i)
                    _apply(views[w], hb)
            if i == 30:  # prefill-1 now holds a 10-block prefix (as its KV events say)
                for idx in (index, live.conductor.router.index):
                    idx.stored("prefill-1", range(100, 110))
            n = rng.choice([40, 300, 700, 1500, 2500])
            hashes = list(range(100, 100 + n // 64)) if rng.random() < 0.5 else []
            output = rng.choice([0, 16, 200])
            slo = rng.choice([(None, None), (1500.0, None), (None, 30.0)])
            got.append(await live.route(n, hashes, output=output, ttft_ms=slo[0],
                                        tbt_ms=slo[1]))
            want.append(outcome(policy.decide(list(views.values()), PolicyRequest(
                prompt_tokens=n, block_hashes=hashes, block_size=64,
                slo_ttft_s=4.0 if slo[0] is None else slo[0] / 1e3,
                slo_tbt_s=0.08 if slo[1] is None else slo[1] / 1e3,
                output_tokens=output, model="sim"))))
    assert got == want
    kinds = {("rejected" if g[0] == "rejected" else "remote" if g[1] else "local")
             for g in got}
    assert kinds == {"rejected", "remote", "local"}  # every branch was exercised


def _apply(view: WorkerView, hb: Heartbeat) -> None:
    # The registry's own rule, in-flight counters included, on the test's mirror view.
    registry = Registry()
    registry.workers[view.worker_id] = view
    registry.heartbeat(hb, now=view.last_seen)


async def test_simulator_and_live_conductor_make_the_same_decisions(profile_path):
    """Record a simulator run (heartbeats, KV index events, routes) and replay it."""
    config = RouterConfig(slo_ttft_s=3.0, slo_tbt_s=0.05)
    router = Router(config, PROFILE)
    events: list[tuple] = []
    for name in ("stored", "removed"):
        real = getattr(router.index, name)

        def record(location, hashes, _real=real, _name=name):
            hashes = list(hashes)
            events.append((_name, location, hashes))
            _real(location, hashes)
        setattr(router.index, name, record)

    def route(views, req):
        r = RouteRequest("sim", req.prompt, req.hashes, max_tokens=req.output)
        # By id: the simulated heartbeats acknowledge what each worker took in, and the
        # replay routes under the same ids, so both conductors count alike.
        d = router.route(views, r, req.request_id, now=req.arrival)
        events.append(("route", r, outcome(d), req.request_id))
        return d

    rng = random.Random(3)
    prefixes = [list(range(k * 1000, k * 1000 + 30)) for k in range(4)]
    reqs, t = [], 0.0
    for i in range(300):
        t += rng.expovariate(4.0)
        n = rng.choice([50, 400, 900, 1600])
        shared = rng.choice(prefixes)[: min(10, n // 64)]
        hashes = shared + [10**6 + i * 40 + j for j in range(n // 64 - len(shared))]
        reqs.append(SimRequest(i, t, n, rng.choice([2, 20, 60]), hashes))
    sim = Simulator(SIM_PROFILE, route, prefill=2, decode=2, index=router.index,
                    cost=router.cost,  # fitted on the heartbeats, as the live one is
                    heartbeat_s=0.5, correction=router.correction)  # learns as live does
    real_heartbeat = sim.registry.heartbeat

    def beat(hb, now=None):
        events.append(("heartbeat", hb))
        return real_heartbeat(hb, now=now)
    sim.registry.heartbeat = beat
    sim.run(reqs)
    routes = [e for e in events if e[0] == "route"]
    assert len(routes) == 300 and sum(e[0] == "heartbeat" for e in events) > 50

    async with Live(profile_path, slo_ttft_ms=3000.0, slo_tbt_ms=50.0) as live:
        for wid, view in sim.registry.workers.items():
            await live.hello(wid, view.role, blocks=SIM_PROFILE.kv_blocks)
        index = live.conductor.router.index
        replayed = []
        for e in events:
            if e[0] == "heartbeat":
                assert live.conductor.apply_heartbeat(e[1])
            elif e[0] in ("stored", "removed"):
                getattr(index, e[0])(e[1], e[2])
            else:
                r = e[1]
                replayed.append(await live.route(r.prompt_len, r.block_hashes,
                                                 output=r.max_tokens, request_id=e[3]))
    assert replayed == [e[2] for e in routes]
    outcomes = {"rejected" if o[0] == "rejected" else "remote" if o[1] else "local"
                for o in replayed}
    assert outcomes == {"rejected", "remote", "local"}


async def test_rejection_carries_retry_after_and_is_counted(profile_path):
    async with Live(profile_path, slo_ttft_ms=100.0) as live:
        await live.hello("decode-0", "decode")
        await live.hello("prefill-0", "prefill")
        # prefill(2000) alone is 0.05 + 2 + 2 = 4.05 s: 3.95 s over the 0.1 s SLO.
        got = await live.route(2000)
        assert got[0] == "rejected" and got[1].startswith("predicted TTFT 4.050s > SLO")
        assert got[2] == pytest.approx(3.95)
        ok = await live.route(2000, ttft_ms=math.inf)  # no target: admitted
        assert ok[0] == "decode-0"
        samples = live.conductor.metrics.get_sample_value
        assert samples("pdserve:routing_decisions_total", {"outcome": "rejected"}) == 1
        assert samples("pdserve:routing_decision_seconds_count") == 2
        with pytest.raises(RemoteError) as err:
            await live.client.call(Route(model="sim", prompt_len=10, slo_ttft_ms=-1.0),
                                   timeout=5)
        assert err.value.code == "invalid"


async def test_burst_of_identical_prefix_between_heartbeats_is_spread(profile_path):
    # The queues below grow to 27 s: workers whose KV lease outlasts them.
    async with Live(profile_path, kv_lease_s=60.0) as live:
        for w, r in WORKERS:
            await live.hello(w, r)
        # prefill-0 holds the shared 1,024-token prefix; 50 requests add 512 tokens each.
        hashes = list(range(1, 25))
        live.conductor.router.index.stored("prefill-0", hashes[:16])
        picks = [await live.route(1536, hashes) for _ in range(50)]
    pre = [p[1] for p in picks]
    dec = [p[0] for p in picks]
    assert pre[:4] == ["prefill-0"] * 3 + ["prefill-1"]  # the hit wins while load is equal
    # Then each goes where it would finish first: 512 uncached tokens on prefill-0 cost
    # 0.66 s, all 1,536 on prefill-1 2.77 s, so both queues end near 27 s with 40 and 10.
    assert (pre.count("prefill-0"), pre.count("prefill-1")) == (40, 10)
    assert dec == ["decode-0", "decode-1"] * 25
    # Under the workers' default 10 s lease the same burst goes remote only while the
    # prefill queues are predicted to land the KV within it; the rest the decode
    # workers would prefill themselves after a lapsed lease, so they do it at once.
    async with Live(profile_path) as live:
        for w, r in WORKERS:
            await live.hello(w, r)
        live.conductor.router.index.stored("prefill-0", hashes[:16])
        lease = [await live.route(1536, hashes) for _ in range(50)]
    assert [p[1] for p in lease[:16]] == pre[:16]
    assert [p[1] for p in lease[16:]] == [None] * 34
    assert all("10s KV lease" in p[2] for p in lease[16:])


async def test_heartbeat_step_samples_fit_the_cost_model(profile_path):
    async with Live(profile_path) as live:
        await live.hello("decode-0", "decode")
        truth = CostCoefficients(0.1, 2e-3, 2e-6, 0.02, 2e-3, 2e-5)  # everything twice as slow
        rng = random.Random(1)
        for seq in range(40):
            pre, dec = [], []
            for _ in range(8):
                n, c = rng.randrange(16, 2000), rng.choice([0, 256, 1024])
                pre.append(StepSample(tokens=[n], cached=[c], seconds=truth.prefill_fixed_s
                                      + truth.prefill_per_token_s * n
                                      + truth.prefill_per_pair_s * n * (n / 2 + c)))
                b = rng.randrange(1, 64)
                k = b * rng.randrange(50, 2000)  # each sequence holds 50..2000 tokens
                dec.append(StepSample(batch=b, context=k, seconds=truth.decode_fixed_s
                                      + truth.decode_per_seq_s * b
                                      + truth.decode_per_ctx_token_s * k))
            # Malformed (only a sender that bypasses the codec could send these).
            pre.append(StepSample(tokens=[5], cached="x", seconds=1.0))
            dec.append(StepSample(batch=True, context=1, seconds=1.0))
            # Well-formed lies (a broken or hostile worker): a time of 0 and one a
            # million times too long. Either alone, fitted, dragged the model to 0 or 1e300.
            pre.append(StepSample(tokens=[500], cached=[0], seconds=0.0))
            dec.append(StepSample(batch=4, context=400, seconds=1e4))
            live.conductor.apply_heartbeat(heartbeat("decode-0", "decode", seq,
                                                     prefill_steps=pre, decode_steps=dec))
        stats = (await live.client.call(GetStats(), timeout=5)).record
    assert stats.cost_observations == [320, 320] and stats.bad_samples == 160
    # What the conductor now predicts:
    fitted = CostModel(CostCoefficients(**dataclasses.asdict(stats.cost_model)))
    want = CostModel(truth)
    # The fixed cost shows only in the few short prompts, so the prior still pulls there.
    for n, c, rel in ((64, 0, 0.1), (500, 0, 0.03), (1500, 0, 0.03), (300, 1024, 0.03)):
        assert fitted.predict_prefill(n, c) == pytest.approx(want.predict_prefill(n, c),
                                                             rel=rel)
    for b, k, rel in ((1, 500, 0.1), (8, 4000, 0.03), (48, 40_000, 0.03)):
        assert fitted.predict_decode(b, k) == pytest.approx(want.predict_decode(b, k), rel=rel)
    assert CostModel(COST).predict_decode(8, 4000) < 0.6 * want.predict_decode(8, 4000)


async def test_a_route_with_an_absurd_length_is_invalid_and_counts_nowhere(profile_path):
    async with Live(profile_path, slo_ttft_ms=4000, slo_tbt_ms=80) as live:
        await live.hello("decode-0", "decode")
        for field, value in (("prompt_len", 2**40), ("max_tokens", 2**63 - 1),
                             ("prompt_len", -1)):
            args = {"model": "sim", "prompt_len": 100, field: value}
            with pytest.raises(RemoteError) as refused:
                await live.client.call(Route(**args), request_id=f"r-{field}", timeout=5)
            assert refused.value.code == "invalid" and field in refused.value.message
        assert live.conductor.registry.workers["decode-0"].pending_tokens == 0
        assert (await live.route(100))[0] == "decode-0"


@pytest.mark.parametrize("lie", [dict(waiting=-10**6), dict(free=-5), dict(free=2**62),
                                 dict(queued=-1), dict(step_time_ms=math.nan)])
async def test_a_heartbeat_whose_load_cannot_be_true_is_refused_and_routing_goes_on(
        profile_path, lie):
    async with Live(profile_path, slo_ttft_ms=60_000, slo_tbt_ms=1000) as live:
        for w in ("decode-0", "decode-1"):
            await live.hello(w, "decode")
        step = lie.pop("step_time_ms", None)
        hb = heartbeat("decode-1", "decode", 1, **{"running": 3, **lie})
        if step is not None:
            hb = dataclasses.replace(hb, step_time_ms=step)
        assert live.conductor.apply_heartbeat(hb)  # known: no rediscovery
        assert live.conductor.refused_heartbeats._value.get() == 1
        view = live.conductor.registry.workers["decode-1"]
        assert (view.running, view.waiting, view.free_blocks) == (0, 0, 200)  # unchanged
        # Every route still gets an answer from the policy (one such heartbeat made
        # each of them "invalid": the cost model refuses a negative batch).
        picks = [(await live.route(300))[0] for _ in range(4)]
        assert set(picks) <= {"decode-0", "decode-1"} and len(picks) == 4
        # The worker's next true heartbeat is applied as usual.
        assert live.conductor.apply_heartbeat(heartbeat("decode-1", "decode", 2, running=5))
        assert view.running == 5
