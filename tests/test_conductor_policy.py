"""Routing policies and the registry on hand-built states: exact choices."""

from __future__ import annotations

import pytest

from common.protocol import WorkerInfo
from services.conductor.policy import LeastLoaded, NoWorkers, RoundRobin, account, decide
from services.conductor.registry import Registry, WorkerView


def view(wid, role, *, running=0, waiting=0, queued=0, free=100, fp="fp", alive=True):
    return WorkerView(WorkerInfo(worker_id=wid, role=role, model="m", control_addr=f"tcp://{wid}",
                                 kv_addr="", host_id="h", block_size=16, num_blocks=100,
                                 fingerprint=fp),
                      running=running, waiting=waiting, queued_prefill_tokens=queued,
                      free_blocks=free, alive=alive)


def test_least_loaded_picks_fewest_requests_then_prefill_queue():
    ws = [view("d1", "decode", running=3), view("d2", "decode", running=1),
          view("p1", "prefill", queued=900), view("p2", "prefill", queued=100)]
    d = decide(ws, LeastLoaded(), model="m", prompt_tokens=1000, disagg_threshold=256)
    assert (d.decode.worker_id, d.prefill.worker_id, d.reason) == ("d2", "p2", "disaggregated")


def test_short_prompt_prefills_on_decode():
    ws = [view("d1", "decode"), view("p1", "prefill")]
    d = decide(ws, LeastLoaded(), model="m", prompt_tokens=100, disagg_threshold=256)
    assert d.prefill is None and d.reason.startswith("short prompt")


def test_unified_worker_is_colocated_and_mismatched_fingerprint_is_skipped():
    d = decide([view("u1", "unified"), view("p1", "prefill")], LeastLoaded(), model="m",
               prompt_tokens=1000)
    assert (d.decode.worker_id, d.prefill, d.reason) == ("u1", None, "colocated")
    d = decide([view("d1", "decode"), view("p1", "prefill", fp="other")], LeastLoaded(),
               model="m", prompt_tokens=1000)
    assert d.prefill is None and d.reason == "no prefill worker"


def test_dead_and_excluded_workers_are_not_chosen():
    ws = [view("d1", "decode", alive=False), view("d2", "decode", running=5),
          view("d3", "decode")]
    d = decide(ws, LeastLoaded(), model="m", prompt_tokens=10, exclude=frozenset({"d3"}))
    assert d.decode.worker_id == "d2"
    with pytest.raises(NoWorkers):
        decide(ws, LeastLoaded(), model="m", prompt_tokens=10, exclude=frozenset({"d2", "d3"}))


def test_round_robin_cycles_in_id_order():
    ws = [view("d2", "decode"), view("d1", "decode"), view("d3", "decode")]
    rr = RoundRobin()
    picks = [decide(ws, rr, model="m", prompt_tokens=1).decode.worker_id for _ in range(4)]
    assert picks == ["d1", "d2", "d3", "d1"]


def test_burst_between_heartbeats_is_spread():
    """In-flight decisions count as load, so a burst does not pile onto one worker."""
    ws = [view("d1", "decode"), view("d2", "decode"), view("p1", "prefill"),
          view("p2", "prefill")]
    counts = {"d1": 0, "d2": 0, "p1": 0, "p2": 0}
    for _ in range(50):
        d = decide(ws, LeastLoaded(), model="m", prompt_tokens=1000)
        account(d, 1000)
        counts[d.decode.worker_id] += 1
        counts[d.prefill.worker_id] += 1
    assert counts == {"d1": 25, "d2": 25, "p1": 25, "p2": 25}


def test_registry_marks_dead_after_three_missed_heartbeats():
    from common.protocol import Heartbeat

    reg = Registry(heartbeat_interval_s=1.0)
    w = view("d1", "decode")
    w.last_seen = 100.0
    reg.register(w)
    hb = Heartbeat(worker_id="d1", role="decode", seq=1, waiting=2, running=4,
                   queued_prefill_tokens=0, free_blocks=50, total_blocks=100,
                   step_time_ms=3.0)
    assert reg.heartbeat(hb, now=101.0) and w.running == 4 and w.pending_requests == 0
    assert reg.reap(now=103.9) == []
    assert reg.reap(now=104.1) == ["d1"] and not w.alive
    assert reg.heartbeat(hb, now=105.0) and w.alive
    unknown = Heartbeat(worker_id="zz", role="decode", seq=1, waiting=0, running=0,
                        queued_prefill_tokens=0, free_blocks=1, total_blocks=1, step_time_ms=0)
    assert reg.heartbeat(unknown) is False


def test_a_leaving_worker_is_not_routed_to_until_it_says_hello_again():
    from common.protocol import Heartbeat

    reg = Registry(heartbeat_interval_s=1.0)
    reg.register(view("d1", "decode"))
    reg.register(view("d2", "decode"))
    assert reg.leave("d1") and reg.leave("zz") is False
    assert [w.worker_id for w in reg.alive(("decode",))] == ["d2"]
    # Its heartbeats until it exits do not bring it back ...
    hb = Heartbeat(worker_id="d1", role="decode", seq=9, waiting=0, running=1,
                   queued_prefill_tokens=0, free_blocks=50, total_blocks=100, step_time_ms=3.0)
    assert reg.heartbeat(hb) and not reg.workers["d1"].alive
    assert decide(list(reg.workers.values()), LeastLoaded(), model="m",
                  prompt_tokens=10).decode.worker_id == "d2"
    # ... a restart's Hello does.
    reg.register(view("d1", "decode"))
    assert reg.heartbeat(hb) and reg.workers["d1"].alive


def test_round_robin_keeps_separate_turns_for_decode_and_prefill():
    ws = [view(f"d{i}", "decode") for i in range(2)] + [view(f"p{i}", "prefill")
                                                       for i in range(4)]
    rr = RoundRobin()
    picks = [decide(ws, rr, model="m", prompt_tokens=1000) for _ in range(4)]
    assert [d.prefill.worker_id for d in picks] == ["p0", "p1", "p2", "p3"]
    assert [d.decode.worker_id for d in picks] == ["d0", "d1", "d0", "d1"]


# -- one policy interface, reached the same way through the router ------------------------

def _router(name="cache_aware", policy=None, **config):
    from common.cost_profile import CostProfile
    from services.conductor.router import Router, RouterConfig

    profile = CostProfile(name="t", prefill_fixed_s=0.01, prefill_per_token_s=1e-4,
                          prefill_per_pair_s=1e-9, decode_fixed_s=0.02, decode_per_seq_s=1e-3,
                          decode_per_ctx_token_s=1e-7, kv_bytes_per_token=1000, block_size=64,
                          link_bandwidth=1e9)
    return Router(RouterConfig(policy=name, **config), profile, policy=policy)


def test_router_drives_a_policy_of_its_own_through_the_interface():
    from services.conductor.router import RouteRequest
    from services.conductor.routing_policy import Decision, PolicyRequest, RoutingPolicy

    class LastDecoder(RoutingPolicy):
        name = "last_decoder"

        def __init__(self):
            self.seen = []

        def decide(self, workers, request):
            self.seen.append(request)
            decoders = [w for w in workers if w.role == "decode"]
            return Decision(decoders[-1], None, "mine")

    mine = LastDecoder()
    router = _router(policy=mine, slo_ttft_s=2.0, slo_tbt_s=0.1, planned_output_tokens=50)
    ws = [view("d1", "decode"), view("d2", "decode"), view("p1", "prefill")]
    d = router.route(ws, RouteRequest("m", 300, [7, 8], frozenset({"p9"}), slo_tbt_s=0.5,
                                      max_tokens=80))
    assert (d.decode.worker_id, d.prefill, d.reason) == ("d2", None, "mine")
    assert router.name == "last_decoder"
    # defaults resolved by the router: the request's own TBT SLO, the configured TTFT
    # SLO, output capped at planned_output_tokens, the workers' block size.
    assert mine.seen == [PolicyRequest(prompt_tokens=300, block_hashes=[7, 8], block_size=16,
                                       model="m", exclude=frozenset({"p9"}), slo_ttft_s=2.0,
                                       slo_tbt_s=0.5, output_tokens=50, admission=True)]


@pytest.mark.parametrize("name", ["cache_aware", "round_robin", "least_loaded"])
def test_every_configured_policy_is_one_routing_policy_called_the_same_way(name):
    from services.conductor.router import RouteRequest
    from services.conductor.routing_policy import PolicyRequest, RoutingPolicy

    router = _router(name)
    assert isinstance(router.policy, RoutingPolicy) and router.name == name
    calls = []
    real = router.policy.decide

    def spy(workers, request):
        calls.append(request)
        return real(workers, request)
    router.policy.decide = spy
    ws = [view("d1", "decode"), view("p1", "prefill")]
    d = router.route(ws, RouteRequest("m", 1000))
    assert calls == [PolicyRequest(prompt_tokens=1000, block_size=16, model="m")]
    assert d.decode.worker_id == "d1"
    # the policy accounted its own decision where the prompt is prefilled
    at = d.prefill or d.decode
    assert d.decode.pending_requests == 1
    assert (at.pending_requests, at.pending_tokens) == (1, 1000)


def test_static_disaggregation_is_the_baselines_rule_plus_accounting():
    from services.conductor.policy import StaticDisaggregation
    from services.conductor.routing_policy import PolicyRequest

    pol = StaticDisaggregation(LeastLoaded(), disagg_threshold=500)
    assert pol.name == "least_loaded"
    ws = [view("d1", "decode"), view("d2", "decode", running=1), view("p1", "prefill")]
    short = pol.decide(ws, PolicyRequest(400, model="m"))
    assert (short.decode.worker_id, short.prefill, short.reason) == \
        ("d1", None, "short prompt (400 < 500)")
    assert (ws[0].pending_requests, ws[0].pending_tokens) == (1, 400)
    long = pol.decide(ws, PolicyRequest(600, model="m", exclude=frozenset({"d2"})))
    assert (long.decode.worker_id, long.prefill.worker_id) == ("d1", "p1")
    assert (ws[2].pending_requests, ws[2].pending_tokens) == (1, 600)
    with pytest.raises(NoWorkers):
        pol.decide(ws, PolicyRequest(600, model="other"))
    with pytest.raises(ValueError):
        pol.decide(ws, PolicyRequest(0, model="m"))
    with pytest.raises(ValueError):
        StaticDisaggregation(RoundRobin(), disagg_threshold=-1)
