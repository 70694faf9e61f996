"""bench/routing_sim.py's ``ours`` routes as the live conductor does: by request id."""

from __future__ import annotations

from bench import routing_sim as rs
from services.conductor.cost_model import CostModel
from services.conductor.prefix_index import PrefixIndex
from services.sim.profiles import Profile
from services.sim.simulator import SimRequest, Simulator


def test_ours_accounts_each_request_in_flight_by_its_id_until_acknowledged():
    profile = Profile.load("llama70b-h100x4", block_size=512)
    index, cost = PrefixIndex(), CostModel(profile.cost)
    setup = rs.Setup(slo_ttft_s=10.0, slo_tbt_s=1.0, prefill=1, decode=1, busy_at_1x=0.5,
                     loaded_speed=1.0, overload_speed=2.0)
    route = rs.ours(profile, index, cost, setup, admission=False)
    sim = Simulator(profile, route, prefill=1, decode=1, index=index, cost=cost)
    req = SimRequest(7, 0.25, 4000, 8, list(range(7)))
    decision = route(sim.views, req)
    # The chosen decode worker holds it by its id, stamped with its arrival, as the
    # conductor does until a heartbeat lists it as admitted.
    assert list(decision.decode.inflight) == ["7"]
    assert decision.decode.inflight["7"].at == 0.25
    assert decision.decode.pending_requests == 1
