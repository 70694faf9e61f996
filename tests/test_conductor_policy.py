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


def test_round_robin_keeps_separate_turns_for_decode_and_prefill():
    ws = [view(f"d{i}", "decode") for i in range(2)] + [view(f"p{i}", "prefill")
                                                       for i in range(4)]
    rr = RoundRobin()
    picks = [decide(ws, rr, model="m", prompt_tokens=1000) for _ in range(4)]
    assert [d.prefill.worker_id for d in picks] == ["p0", "p1", "p2", "p3"]
    assert [d.decode.worker_id for d in picks] == ["d0", "d1", "d0", "d1"]
