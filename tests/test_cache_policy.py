"""The prefix index and the cache- and load-aware policy on hand-built states: exact
matches, exact choices, rejection exactly at the SLO, a burst spread by in-flight
accounting."""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest

from common.protocol import Heartbeat, WorkerInfo
from common.records import CostCoefficients
from services.conductor.cache_policy import CacheAwarePolicy, PolicyConfig, Rejection
from services.conductor.cost_model import CostModel
from services.conductor.policy import Decision, NoWorkers
from services.conductor.prefix_index import PrefixIndex
from services.conductor.registry import Registry, WorkerView
from services.conductor.routing_policy import PolicyRequest

CAL = CostCoefficients(prefill_fixed_s=0.01, prefill_per_token_s=1e-4, prefill_per_pair_s=1e-9,
                  decode_fixed_s=0.02, decode_per_seq_s=1e-3, decode_per_ctx_token_s=1e-7)
CFG = PolicyConfig(kv_bytes_per_token=1000, link_bandwidth=1e9, pool_bandwidth=1e8)
BS = 512  # index block size
PROMPT = 16 * BS
CHAIN = list(range(16))


def prefill_s(n: int, c: int) -> float:
    return 0.01 + 1e-4 * n + 1e-9 * n * (n / 2 + c)


# The decode step in progress on a decode worker running 4 (no KV in use): a remote
# prefill's Prefill leaves it only after that step.
STEP4 = 0.02 + 1e-3 * 4


def view(wid, role, *, running=0, waiting=0, queued=0, free=100_000, blocks=100_000):
    return WorkerView(WorkerInfo(worker_id=wid, role=role, model="m", control_addr="",
                                 kv_addr="", host_id="h", block_size=16, num_blocks=blocks,
                                 fingerprint="fp"),
                      running=running, waiting=waiting, queued_prefill_tokens=queued,
                      free_blocks=free, last_seen=0.0)


def policy(index=None):
    return CacheAwarePolicy(index or PrefixIndex(), CostModel(CAL), CFG)


def route(pol, ws, hashes=CHAIN, prompt=PROMPT, **kw):
    return pol.decide(ws, PolicyRequest(prompt_tokens=prompt, block_hashes=hashes,
                                        block_size=BS, **kw))


# -- the prefix index ---------------------------------------------------------------------

def test_index_match_has_prefix_semantics_per_location():
    idx = PrefixIndex()
    idx.stored("a", [1, 2, 3])
    idx.stored("b", [1, 3])  # lost block 2: only its first block counts
    idx.stored("c", [2, 3])  # holds no first block: absent
    idx.stored("pool:dram", [1, 2, 3, 4])
    assert idx.match([1, 2, 3, 4]) == {"a": 3, "b": 1, "pool:dram": 4}
    assert idx.match([9, 1]) == {} and idx.match([]) == {}
    assert len(idx) == 4
    idx.stored("a", [1, 2])  # idempotent
    idx.removed("a", [2, 99])  # absent hashes are ignored
    idx.removed("nobody", [1])
    assert idx.match([1, 2, 3]) == {"a": 1, "b": 1, "pool:dram": 3}


def test_drop_location_forgets_it_and_its_bit_is_reused_clean():
    idx = PrefixIndex()
    idx.stored("w1", [1, 2])
    idx.stored("w2", [1])
    assert idx.drop_location("w1") == 2
    assert idx.match([1, 2]) == {"w2": 1} and len(idx) == 1
    idx.stored("w3", [7])  # takes w1's freed bit
    assert idx.match([1, 2]) == {"w2": 1} and idx.match([7]) == {"w3": 1}
    assert idx.drop_location("w1") == 0
    assert idx.locations() == ["w2", "w3"]


def test_held_counts_follow_stores_removals_and_drops():
    idx = PrefixIndex()
    idx.stored("a", [1, 2, 3])
    idx.stored("a", [2, 3, 4])  # 2 and 3 again: not counted twice
    idx.stored("pool:x", [1, 9])
    idx.removed("a", [1, 1, 77])  # a repeat and an absent hash count once / not at all
    assert idx.counts() == {"a": 3, "pool:x": 2}
    assert (idx.held("a"), idx.held("nobody")) == (3, 0)
    assert idx.drop_location("a") == 3
    idx.stored("b", [5])  # takes a's freed bit with a fresh count
    assert idx.counts() == {"b": 1, "pool:x": 2} and len(idx) == 3


def test_match_group_counts_a_chain_spread_over_pool_instances():
    idx = PrefixIndex()
    idx.stored("pool:x", [1, 3, 5])  # placement put alternate blocks on two instances
    idx.stored("pool:y", [2, 4])
    idx.stored("w", [1, 2, 3, 4, 5, 6])
    assert idx.match([1, 2, 3, 4, 5, 6]) == {"pool:x": 1, "w": 6}
    assert idx.match_group([1, 2, 3, 4, 5, 6], "pool:") == 5  # block 6: no instance
    assert idx.match_group([2, 1], "pool:") == 2
    assert idx.match_group([7, 1], "pool:") == 0 and idx.match_group([], "pool:") == 0
    assert idx.match_group([1, 2], "none:") == 0
    idx.drop_location("pool:y")
    assert idx.match_group([1, 2, 3], "pool:") == 1


def test_match_of_a_64_block_chain_with_100k_blocks_and_32_workers_is_fast():
    rng = random.Random(0)
    idx, chains = PrefixIndex(), []
    for c in range(100_000 // 64):
        chain = [c * 64 + i for i in range(64)]
        chains.append(chain)
        for w in rng.sample(range(32), 4):
            idx.stored(f"worker-{w}", chain[:rng.randint(1, 64)])
        idx.stored(f"worker-{rng.randrange(32)}", chain)
    assert len(idx) == 100_000 - 100_000 % 64
    picks = [rng.choice(chains) for _ in range(5000)]
    t0 = time.perf_counter()
    for chain in picks:
        idx.match(chain)
    per_match = (time.perf_counter() - t0) / len(picks)
    assert max(idx.match(picks[0]).values()) == 64
    assert per_match < 50e-6, f"{per_match * 1e6:.1f} us per match"


# -- the policy ---------------------------------------------------------------------------

def test_cache_hit_wins_when_load_is_equal():
    idx = PrefixIndex()
    idx.stored("p1", CHAIN[:14])
    ws = [view("d1", "decode", running=4), view("p1", "prefill"), view("p2", "prefill")]
    d = route(policy(idx), ws)
    assert isinstance(d, Decision)
    assert (d.decode.worker_id, d.prefill.worker_id) == ("d1", "p1")
    assert "hit 14/16" in d.reason
    assert (ws[1].pending_requests, ws[1].pending_tokens) == (1, PROMPT - 14 * BS)
    assert ws[0].pending_requests == 1 and ws[2].pending_requests == 0


def test_load_wins_when_the_hit_is_small():
    idx = PrefixIndex()
    idx.stored("p1", CHAIN[:1])
    # p1: queue 0.53 s + 7,680 uncached tokens 0.81 s; p2: 8,192 tokens 0.86 s
    ws = [view("d1", "decode", running=4), view("p1", "prefill", waiting=2, queued=5000),
          view("p2", "prefill")]
    assert route(policy(idx), ws).prefill.worker_id == "p2"
    idx.stored("p1", CHAIN[:15])  # a long hit outweighs the same queue: 0.53 + 0.07 s
    ws = [view("d1", "decode", running=4), view("p1", "prefill", waiting=2, queued=5000),
          view("p2", "prefill")]
    assert route(policy(idx), ws).prefill.worker_id == "p1"


def test_rejection_exactly_when_predicted_ttft_misses_the_slo():
    ws = lambda: [view("d1", "decode", running=4), view("p1", "prefill", queued=4096)]  # noqa: E731
    # queue 4096 tokens + full 8192-token prefill + 8.192 MB over 1 GB/s + d1's step
    ttft = prefill_s(4096, 0) + prefill_s(PROMPT, 0) + PROMPT * 1000 / 1e9 + STEP4
    ok = route(policy(), ws(), slo_ttft_s=ttft + 1e-9)
    assert isinstance(ok, Decision) and f"ttft {ttft:.3f}s" in ok.reason
    views = ws()
    no = route(policy(), views, slo_ttft_s=ttft - 1e-9)
    assert isinstance(no, Rejection) and "predicted TTFT" in no.reason
    assert no.retry_after_s == 1.0
    assert all(w.pending_requests == 0 for w in views)  # nothing accounted
    assert isinstance(route(policy(), ws(), slo_ttft_s=ttft - 5), Rejection)
    assert route(policy(), ws(), slo_ttft_s=ttft - 5).retry_after_s == pytest.approx(5.0)


def test_rejection_exactly_when_predicted_tbt_misses_the_slo():
    ws = lambda: [view("d1", "decode", running=9, blocks=100_000, free=90_000),  # noqa: E731
                  view("p1", "prefill")]
    # 10 sequences; 10,000 blocks x 16 tokens in use + the prompt + half of 100 outputs
    tbt = 0.02 + 1e-3 * 10 + 1e-7 * (160_000 + PROMPT + 50)
    kw = dict(output_tokens=100)
    assert isinstance(route(policy(), ws(), slo_tbt_s=tbt + 1e-9, **kw), Decision)
    no = route(policy(), ws(), slo_tbt_s=tbt - 1e-9, **kw)
    assert isinstance(no, Rejection) and "TBT" in no.reason


def test_decode_needs_free_kv_blocks_and_admission_rejects_when_none_has_room():
    need = -(-(PROMPT + 100) // 16)
    ws = [view("d1", "decode", free=need - 1), view("d2", "decode", running=50, free=need),
          view("p1", "prefill")]
    pol = policy()
    d = route(pol, ws, output_tokens=100, slo_ttft_s=60)
    assert d.decode.worker_id == "d2"  # d1 is idle but has no room
    # d2's ledger now holds those blocks until its next heartbeat: nobody has room
    no = route(pol, ws, output_tokens=100, slo_ttft_s=60)
    assert isinstance(no, Rejection) and "room" in no.reason
    # without admission the roomiest decode worker takes it (and queues it)
    assert route(pol, ws, output_tokens=100).decode.worker_id == "d1"


def test_burst_of_identical_prefixes_is_spread_by_in_flight_accounting():
    idx = PrefixIndex()
    idx.stored("p1", list(range(15)))
    ws = [view("d1", "decode", running=4), view("d2", "decode", running=4),
          view("p1", "prefill"), view("p2", "prefill"), view("p3", "prefill")]
    pol = policy(idx)
    picks = Counter(route(pol, ws, hashes=list(range(15)) + [100 + i]).prefill.worker_id
                    for i in range(50))
    assert picks["p1"] > 25 and picks["p2"] > 0 and picks["p3"] > 0
    assert sum(picks.values()) == 50
    assert ws[2].pending_requests == picks["p1"]
    assert ws[2].pending_tokens == picks["p1"] * BS  # only its uncached block each
    # Without the in-flight counters (stale heartbeat state every time): all on p1.
    stale = Counter()
    for i in range(50):
        d = route(pol, ws, hashes=list(range(15)) + [200 + i])
        stale[d.prefill.worker_id] += 1
        for w in ws:
            w.pending_requests = w.pending_tokens = 0
    assert stale == {"p1": 50}


def test_heartbeat_voids_the_ledger_and_the_counters():
    reg = Registry()
    ws = [view("d1", "decode", free=600, blocks=600), view("p1", "prefill")]
    for w in ws:
        reg.workers[w.worker_id] = w
    pol = policy()
    assert isinstance(route(pol, ws, slo_ttft_s=60), Decision)
    assert isinstance(route(pol, ws, slo_ttft_s=60), Rejection)  # ledger: d1 is full
    hb = Heartbeat(worker_id="d1", role="decode", seq=1, waiting=0, running=0,
                   queued_prefill_tokens=0, free_blocks=600, total_blocks=600, step_time_ms=0)
    assert reg.heartbeat(hb, now=1.0)  # the first request finished meanwhile
    assert isinstance(route(pol, ws, slo_ttft_s=60), Decision)


def test_conditional_disaggregation_follows_predicted_costs():
    idx = PrefixIndex()
    idx.stored("d1", CHAIN[:15])
    # The decode worker holds the prefix: a 512-token local prefill beats any transfer.
    ws = [view("d1", "decode", running=4), view("p1", "prefill")]
    d = route(policy(idx), ws)
    assert d.prefill is None and d.reason.startswith("local")
    assert ws[0].pending_tokens == BS and ws[0].pending_requests == 1
    # A full prefill there would stall its 4 running decodes for 0.86 s: remote.
    ws = [view("d1", "decode", running=4), view("p1", "prefill")]
    d = route(policy(), ws)
    assert d.prefill.worker_id == "p1" and "stall" in d.reason
    # An idle decode worker prefills itself when the prefill pool is backed up.
    ws = [view("d1", "decode"), view("p1", "prefill", waiting=3, queued=30_000)]
    d = route(policy(), ws)
    assert d.prefill is None and "local" in d.reason
    # With one sequence running there, the same 0.86 s prefill is over the stall budget.
    ws = [view("d1", "decode", running=1), view("p1", "prefill", waiting=3, queued=30_000)]
    assert route(policy(), ws).prefill.worker_id == "p1"


def test_a_follow_up_prefills_on_the_decode_worker_holding_its_history():
    idx = PrefixIndex()
    idx.stored("d2", CHAIN[:15])  # d2 served the previous turn and still holds it
    # d1 has the lower predicted TBT (1 running against 2), so it is the decode pick;
    # a full local prefill there would stall its batch 0.86 s (> the 0.5 s budget), so
    # the rule before went remote: p1, 8,192 tokens 0.863 s + transfer 0.008 s, taken
    # by d1 after its decode step in progress (1 sequence, 0.021 s).
    remote = prefill_s(PROMPT, 0) + PROMPT * 1000 / 1e9 + 0.02 + 1e-3
    # d2 computes only the 512 new tokens after its 15 blocks, behind its decode step of
    # 2 sequences (0.022 s), with that batch's decode riding along in the prefill step
    # (0.022 s), and stalls its batch within the budget.
    step = 0.02 + 2 * 1e-3
    local = 2 * step + prefill_s(BS, 15 * BS)
    assert remote == pytest.approx(0.8919, abs=1e-4) and local == pytest.approx(0.1093, abs=1e-4)
    ws = [view("d1", "decode", running=1), view("d2", "decode", running=2),
          view("p1", "prefill")]
    d = route(policy(idx), ws)
    assert (d.decode.worker_id, d.prefill) == ("d2", None)
    assert d.reason.startswith(f"local on the prefix's holder {local:.3f}s < {remote:.3f}s")
    assert "hit 15/16" in d.reason
    assert (ws[1].pending_requests, ws[1].pending_tokens) == (1, BS)
    assert ws[0].pending_requests == 0 and ws[2].pending_requests == 0
    # Over the stall budget there (3 prompts, 6,000 tokens, queued ahead: 0.64 s),
    # the holder is passed over: remote as before.
    ws = [view("d1", "decode", running=1),
          view("d2", "decode", running=2, waiting=3, queued=6000), view("p1", "prefill")]
    d = route(policy(idx), ws)
    assert (d.decode.worker_id, d.prefill.worker_id) == ("d1", "p1")
    assert "stall" in d.reason


def test_the_stall_budget_spreads_over_the_workloads_mean_output():
    # A 1,024-token prompt; d1 runs 4 sequences (step 0.024 s), p1 has 3 s of work queued.
    prompt, hashes = 2 * BS, CHAIN[:2]
    step = 0.02 + 4 * 1e-3
    stall = prefill_s(prompt, 0)  # 0.113 s, local TTFT 0.137 s
    # p1's queue and the prompt, its transfer, then d1's decode step in progress.
    remote = 3 * prefill_s(10_000, 0) + prefill_s(prompt, 0) + prompt * 1000 / 1e9 + step
    assert stall == pytest.approx(0.1129, abs=1e-4) and remote == pytest.approx(3.318, abs=1e-3)
    kw = dict(prompt=prompt, hashes=hashes, slo_tbt_s=0.064, output_tokens=100)

    def ws():
        return [view("d1", "decode", running=4), view("p1", "prefill", waiting=3,
                                                      queued=30_000)]
    pol = policy()
    # No output seen yet: a running request may have two tokens, so the budget is one
    # TBT's headroom, 0.064 - 0.024 = 0.040 s < 0.113 s: remote, 3.29 s.
    d = route(pol, ws(), **kw)
    assert d.prefill.worker_id == "p1" and "stall" in d.reason
    assert f"ttft {remote:.3f}s" in d.reason
    # Requests of 100 tokens seen: the headroom spreads over 99 of them, capped at
    # max_decode_stall_s (0.5 s): local, 0.161 s (its step, the prefill, and the batch's
    # decode riding along in that prefill step).
    d = route(pol, ws(), **kw)
    assert d.prefill is None and d.reason.startswith(f"local {2 * step + stall:.3f}s <= remote")
    # Without a TBT SLO the cap alone bounds the stall, as before.
    assert route(policy(), ws(), prompt=prompt, hashes=hashes).prefill is None


def test_a_remote_prefill_that_would_outlast_the_kv_lease_is_prefilled_locally():
    # The 8,192-token prefill takes 0.86 s; under a 0.5 s lease the decode worker would
    # give up on its KV and prefill it itself: do that at once, stall or not.
    short = CacheAwarePolicy(PrefixIndex(), CostModel(CAL), PolicyConfig(
        kv_bytes_per_token=1000, link_bandwidth=1e9, kv_lease_s=0.5))
    ws = [view("d1", "decode", running=4), view("p1", "prefill")]
    d = route(short, ws)
    assert d.prefill is None and "0.5s KV lease" in d.reason
    assert ws[0].pending_tokens == PROMPT and ws[1].pending_requests == 0
    # The default 10 s lease: the same request goes remote to spare the batch.
    ws = [view("d1", "decode", running=4), view("p1", "prefill")]
    assert route(policy(), ws).prefill.worker_id == "p1"
    # Among decode workers, the one where its wait plus the stall of the requests there
    # is least: d1 (3 running) 4 x 0.89 s against d2 (one 4,096-token prompt queued)
    # 2 x 1.29 s, though d1 has the lower predicted TBT.
    ws = [view("d1", "decode", running=3),
          view("d2", "decode", waiting=1, queued=4096), view("p1", "prefill")]
    d = route(short, ws)
    assert (d.decode.worker_id, d.prefill) == ("d2", None)
    assert ws[1].pending_tokens == PROMPT and ws[0].pending_tokens == 0
    with pytest.raises(ValueError, match="kv_lease_s"):
        PolicyConfig(kv_bytes_per_token=1, link_bandwidth=1, kv_lease_s=0)


def test_pool_blocks_beyond_a_workers_own_are_fetched_and_counted():
    idx = PrefixIndex()
    idx.stored("pool:dram", CHAIN[:12])
    idx.stored("p2", CHAIN[:4])
    ws = [view("d1", "decode", running=4), view("p1", "prefill"), view("p2", "prefill")]
    # p1 fetches 12 blocks, p2 its own 4 and 8 from the pool: p2 is cheaper.
    fetch = lambda blocks: blocks * BS * 1000 / 1e8  # noqa: E731
    t_p2 = prefill_s(4 * BS, 12 * BS) + fetch(8) + PROMPT * 1000 / 1e9 + STEP4
    d = route(policy(idx), ws, slo_ttft_s=t_p2 + 1e-9)
    assert d.prefill.worker_id == "p2" and "hit 12/16" in d.reason
    assert isinstance(route(policy(idx), ws, slo_ttft_s=t_p2 - 1e-9), Rejection)


def test_pool_prefix_spread_over_two_instances_counts_whole():
    idx = PrefixIndex()
    idx.stored("pool:x", CHAIN[0:12:2])
    idx.stored("pool:y", CHAIN[1:12:2])
    ws = [view("d1", "decode", running=4), view("p1", "prefill")]
    fetch = 12 * BS * 1000 / 1e8
    t_p1 = prefill_s(4 * BS, 12 * BS) + fetch + PROMPT * 1000 / 1e9 + STEP4
    # d1 would take ~0.29 s to prefill it: more than its decodes may stall here, so remote
    stalls = CacheAwarePolicy(idx, CostModel(CAL), PolicyConfig(
        kv_bytes_per_token=1000, link_bandwidth=1e9, pool_bandwidth=1e8,
        max_decode_stall_s=0.1))
    d = route(stalls, ws, slo_ttft_s=t_p1 + 1e-9)
    assert d.prefill.worker_id == "p1" and "hit 12/16" in d.reason
    no_pool = CacheAwarePolicy(idx, CostModel(CAL), PolicyConfig(
        kv_bytes_per_token=1000, link_bandwidth=1e9, pool_bandwidth=0.0))
    ws = [view("d1", "decode", running=4), view("p1", "prefill")]
    assert "hit 0/16" in route(no_pool, ws).reason  # bandwidth 0: the pool is ignored


def test_no_decode_worker_and_bad_sizes_are_explicit_errors():
    with pytest.raises(NoWorkers):
        route(policy(), [view("p1", "prefill")])
    with pytest.raises(NoWorkers):
        route(policy(), [view("d1", "decode")], exclude=frozenset({"d1"}))
    with pytest.raises(ValueError, match="bad request sizes"):
        route(policy(), [view("d1", "decode")], prompt=0)
    with pytest.raises(ValueError, match="link_bandwidth"):
        PolicyConfig(kv_bytes_per_token=1, link_bandwidth=0)
