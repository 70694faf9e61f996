"""Routing policies on the Mooncake conversation trace, 8 prefill + 8 decode simulated
Llama-70B workers (4 x H100 each; ``deploy/profiles/llama70b-h100x4.json``, the file a
conductor loads with ``cost_profile``; derivation in ``bench/sim/profiles.py``).

    python bench/routing_sim.py [--trace PATH] [--speeds 1,1.5] [--overload-speed 4]
                                [--limit N] [--profile NAME|PATH] [--noise SIGMA]
                                [--kv-lease S] [--out bench/results/routing_sim]

Writes ``<out>.json``, ``<out>.md`` (the tables of docs/benchmarks.md) and ``<out>.png``.

Each simulated worker caches prefixes only in its own KV blocks (950 blocks of 512
tokens from the profile's ``kv_capacity_tokens``), decode reserves a request's blocks
before its remote prefill (no room: prefills it locally) and waits for its KV for at
most the KV lease (10 s, the workers' default) before prefilling it locally, and the
policy's cost model learns step times from heartbeats (bench/sim/simulator.py).

Policies: random, round-robin and least-loaded (``services/conductor/policy.py``, cached
tokens unknown to them), cache-aware (longest cached prefix in the index, ties broken at
random, decode least-loaded: no load term) and ours (``CacheAwarePolicy``: predicted
TTFT/TBT from the online cost model, in-flight accounting per request id as the live
conductor keeps it, conditional disaggregation).
``output_tokens`` given to ours is the trace's output length, standing for max_tokens.

Chosen from the workload's own statistics (``derive``; the profile's idle costs, no
prefix caching), not fixed for one trace:

* SLOs: TTFT <= 2 x the idle prefill of the p99 prompt (every request but the longest
  1 % can meet it with room for one queue of its own size); mean TBT <= 2 x the decode
  step of 32 sequences of the mean context (mean prompt + half the mean output).
* Workers: P prefill = the fewest that the trace at its own rate keeps <= 55 % busy
  (offered prefill seconds per second / 0.55, rounded up), D decode = P.
* Speeds (``--speeds auto``): 1x, and the speed at which the P prefill workers would be
  85 % busy (the loaded regime of Mooncake's figures: TTFT 3.07 s cache-aware, 5.27 s
  load balancing, 19.65 s random); overload (``--overload-speed auto``): 2x their
  capacity. ``--quick`` runs least-loaded and ours only, without the overload sweep.

The overload run (``--overload-speed``) compares ours (reject at arrival
on predicted SLO miss) with per-stage rejection (ours without admission; reject at
prefill when its queue holds more than W seconds of work, at decode when it has no
blocks to reserve),
swept over W and compared at the sweep point of closest goodput.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.sim.profiles import Profile  # noqa: E402
from bench.sim.simulator import Simulator, load_trace, percentile  # noqa: E402
from services.conductor.cache_policy import CacheAwarePolicy, PolicyConfig  # noqa: E402
from services.conductor.cost_model import CostModel  # noqa: E402
from services.conductor.policy import Decision, LeastLoaded, Picker, RoundRobin, account, decide  # noqa: E402
from services.conductor.prefix_index import PrefixIndex  # noqa: E402
from services.conductor.routing_policy import PolicyRequest  # noqa: E402

TRACE = "/work/shared/traces/mooncake_conversation_trace.jsonl"
TARGET_BUSY, LOADED_BUSY, OVERLOAD_BUSY = 0.55, 0.85, 2.0
PROFILE_FILE = "llama70b-h100x4"
TRACE_BLOCK = 512  # tokens per hash id of the Mooncake traces


class RandomPick(Picker):
    name = "random"

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def pick(self, candidates, prompt_tokens):
        return self.rng.choice(sorted(candidates, key=lambda w: w.worker_id))


class PerRole(Picker):
    """One policy instance per role. ``decide`` asks one policy for the decode and then the
    prefill worker; a single ``RoundRobin`` counter stepped twice per request with 8 + 8
    workers would send every prompt to the odd-numbered half of the prefill pool."""

    def __init__(self, make) -> None:
        self.name = make().name
        self._by_role = {}
        self._make = make

    def pick(self, candidates, prompt_tokens):
        role = candidates[0].role
        if role not in self._by_role:
            self._by_role[role] = self._make()
        return self._by_role[role].pick(candidates, prompt_tokens)


def baseline(policy: Picker):
    def route(views, req):
        d = decide(views, policy, model="sim", prompt_tokens=req.prompt)
        account(d, req.prompt)
        return d
    return route


def max_hit(index: PrefixIndex, seed: int):
    rng, least = random.Random(seed), LeastLoaded()

    def route(views, req):
        hits = index.match(req.hashes)
        decode = least.pick([v for v in views if v.role == "decode"], req.prompt)
        pre = [v for v in views if v.role == "prefill"]
        top = max(hits.get(v.worker_id, 0) for v in pre)
        best = [v for v in pre if hits.get(v.worker_id, 0) == top]
        d = Decision(decode, rng.choice(best), f"max hit {top} blocks")
        account(d, req.prompt)
        return d
    return route


def ours(profile: Profile, index: PrefixIndex, cost: CostModel, setup: Setup, *,
         admission: bool, kv_lease_s: float = 10.0):
    policy = CacheAwarePolicy(index, cost, PolicyConfig(
        profile.kv_bytes_per_token, profile.link_bandwidth, profile.pool_bandwidth,
        kv_lease_s=kv_lease_s))

    def route(views, req):
        return policy.decide(views, PolicyRequest(
            prompt_tokens=req.prompt, block_hashes=req.hashes, block_size=profile.block_size,
            slo_ttft_s=setup.slo_ttft_s, slo_tbt_s=setup.slo_tbt_s, output_tokens=req.output,
            admission=admission, request_id=req.request_id, routed_at=req.arrival))
    return route


@dataclass(frozen=True, slots=True)
class Setup:
    """SLOs, worker counts and speeds derived from a trace (see the module docstring)."""

    slo_ttft_s: float
    slo_tbt_s: float
    prefill: int
    decode: int
    busy_at_1x: float  # prefill workers' share of time busy at the trace's rate, no cache
    loaded_speed: float
    overload_speed: float

    def line(self) -> str:
        return (f"SLO TTFT <= {self.slo_ttft_s:.1f}s, TBT <= {self.slo_tbt_s * 1e3:.0f}ms; "
                f"{self.prefill} prefill + {self.decode} decode ({self.busy_at_1x:.0%} busy "
                f"at 1x); loaded {self.loaded_speed:.2f}x, overload {self.overload_speed:.2f}x")


def derive(reqs, profile: Profile) -> Setup:
    prompts = sorted(r.prompt for r in reqs)
    p99 = prompts[min(len(prompts) - 1, math.ceil(0.99 * len(prompts)) - 1)]
    context = sum(prompts) / len(prompts) + sum(r.output for r in reqs) / len(reqs) / 2
    span = max(r.arrival for r in reqs) - min(r.arrival for r in reqs)
    work = sum(profile.prefill_s(r.prompt, 0) for r in reqs) / span  # busy workers
    prefill = max(1, math.ceil(work / TARGET_BUSY))
    busy = work / prefill
    return Setup(slo_ttft_s=2 * profile.prefill_s(p99, 0),
                 slo_tbt_s=2 * profile.decode_step_s(32, int(32 * context)),
                 prefill=prefill, decode=prefill, busy_at_1x=busy,
                 loaded_speed=LOADED_BUSY / busy, overload_speed=OVERLOAD_BUSY / busy)


POLICIES = ("random", "round_robin", "least_loaded", "cache_aware", "ours")


def simulate(name: str, trace: str, speed: float, limit: int | None, setup: Setup, *,
             seed: int = 0,
             admission: bool = False, stage_wait_s: float | None = None,
             profile: Profile | None = None, noise: float = 0.0,
             kv_lease_s: float = 10.0) -> dict:
    profile = profile or Profile.load(PROFILE_FILE, block_size=TRACE_BLOCK)
    reqs = load_trace(trace, speed=speed, limit=limit)
    index, cost = PrefixIndex(), CostModel(profile.cost)
    route = {"random": lambda: baseline(RandomPick(seed)),
             "round_robin": lambda: baseline(PerRole(RoundRobin)),
             "least_loaded": lambda: baseline(LeastLoaded()),
             "cache_aware": lambda: max_hit(index, seed),
             "ours": lambda: ours(profile, index, cost, setup, admission=admission,
                                  kv_lease_s=kv_lease_s)}[name]()
    t0 = time.perf_counter()
    sim = Simulator(profile, route, prefill=setup.prefill, decode=setup.decode, index=index,
                    cost=cost,
                    stage_reject_wait_s=stage_wait_s, kv_lease_s=kv_lease_s, noise=noise,
                    seed=seed)
    sim.run(reqs)
    return summarize(name, reqs, speed, time.perf_counter() - t0, setup)


def summarize(name: str, reqs, speed: float, wall_s: float, setup: Setup) -> dict:
    done = [r for r in reqs if r.done is not None]
    ttft, tbt = [r.ttft for r in done], [r.tbt for r in done]
    good = sum(1 for r in done if r.ttft <= setup.slo_ttft_s and r.tbt <= setup.slo_tbt_s)
    span = max(r.arrival for r in reqs) or 1.0
    rejected = {s: sum(1 for r in reqs if r.rejected == s) for s in ("arrival", "prefill",
                                                                      "decode")}
    return {"policy": name, "speed": speed, "requests": len(reqs), "completed": len(done),
            "avg_ttft_s": sum(ttft) / max(1, len(ttft)), "p99_ttft_s": percentile(ttft, 99),
            "avg_tbt_s": sum(tbt) / max(1, len(tbt)), "p99_tbt_s": percentile(tbt, 99),
            "goodput": good, "goodput_rps": good / span, "rejected": sum(rejected.values()),
            "rejected_by_stage": rejected,
            "local_prefills": sum(1 for r in done if r.prefill_id is None),
            "fell_back": sum(1 for r in done if r.fell_back),
            "cached_token_frac": sum(r.cached for r in done) / max(1, sum(r.prompt
                                                                         for r in done)),
            "sim_wall_s": round(wall_s, 2)}


def print_table(rows: list[dict]) -> None:
    ref = {r["speed"]: r for r in rows if r["policy"] == "least_loaded"}
    print(f"{'speed':>5} {'policy':<13} {'avg TTFT':>9} {'p99 TTFT':>9} {'vs LL':>6} "
          f"{'p99 TBT':>8} {'goodput':>8} {'vs LL':>6} {'cached':>6} {'local':>6} {'fell back':>9}")
    for r in rows:
        base = ref.get(r["speed"])
        ratio = r["avg_ttft_s"] / base["avg_ttft_s"] if base else float("nan")
        g = r["goodput"] / base["goodput"] if base and base["goodput"] else float("nan")
        print(f"{r['speed']:>5} {r['policy']:<13} {r['avg_ttft_s']:>8.2f}s "
              f"{r['p99_ttft_s']:>8.2f}s {ratio:>6.2f} {r['p99_tbt_s'] * 1e3:>6.1f}ms "
              f"{r['goodput']:>8} {g:>6.3f} {r['cached_token_frac']:>6.1%} "
              f"{r['local_prefills']:>6} {r['fell_back']:>9}")


def markdown(result: dict) -> str:
    """The tables of docs/benchmarks.md (written beside the JSON, pasted as they are)."""
    rows = result["policies"]
    ref = {r["speed"]: r for r in rows if r["policy"] == "least_loaded"}
    out = ["| speed | policy | avg TTFT | p99 TTFT | vs least-loaded | p99 TBT | goodput "
           "| cached tokens | local (fell back) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = ref.get(r["speed"])
        ratio = f"{r['avg_ttft_s'] / base['avg_ttft_s']:.2f}×" if base else "—"
        b = "**" if r["policy"] == "ours" else ""
        out.append(f"| {r['speed']:g}× | {b}{r['policy'].replace('_', '-')}{b} | "
                   f"{b}{r['avg_ttft_s']:.2f} s{b} | {r['p99_ttft_s']:.2f} s | {b}{ratio}{b} | "
                   f"{r['p99_tbt_s'] * 1e3:.1f} ms | {r['goodput']:,} | "
                   f"{r['cached_token_frac']:.1%} | {r['local_prefills']:,} "
                   f"({r['fell_back']:,}) |".replace("%", " %"))
    ov = result.get("overload")
    if ov:
        out += ["", f"Overload (trace at {ov['speed']:g}×), ours:", "",
                "| rejection | goodput | rejected (arrival / prefill / decode) | avg TTFT |",
                "|---|---|---|---|"]
        for label, r in (("none", ov["no_rejection"]), ("early (at arrival)", ov["early"]),
                         *((f"per stage, W = {r['stage_wait_s']:g} s", r)
                           for r in ov["per_stage"])):
            st = r["rejected_by_stage"]
            out.append(f"| {label} | {r['goodput']:,} | {r['rejected']:,} ({st['arrival']:,} / "
                       f"{st['prefill']:,} / {st['decode']:,}) | {r['avg_ttft_s']:.2f} s |")
    return "\n".join(out) + "\n"


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    speeds = sorted({r["speed"] for r in result["policies"]})
    width = 0.8 / len(speeds)
    for i, s in enumerate(speeds):
        rows = [r for r in result["policies"] if r["speed"] == s]
        xs = [j + i * width for j in range(len(rows))]
        ax1.bar(xs, [r["avg_ttft_s"] for r in rows], width, label=f"avg, {s}x")
        ax1.scatter(xs, [r["p99_ttft_s"] for r in rows], marker="_", s=200, color="k")
    ax1.set_xticks([j + width * (len(speeds) - 1) / 2 for j in range(len(POLICIES))],
                   POLICIES, rotation=20)
    ax1.set_yscale("log")
    ax1.set_ylabel("TTFT (s); bars avg, dashes p99")
    ax1.legend()
    ov = result["overload"]
    stage = ov["per_stage"]
    ax2.plot([r["goodput"] for r in stage], [r["rejected"] for r in stage], "o-",
             label="per-stage rejection (sweep of W)")
    for r in stage:
        ax2.annotate(f"W={r['stage_wait_s']:g}s", (r["goodput"], r["rejected"]), fontsize=7)
    e = ov["early"]
    ax2.plot([e["goodput"]], [e["rejected"]], "r*", ms=14, label="early rejection (ours)")
    ax2.set_xlabel("goodput (requests within SLO)")
    ax2.set_ylabel("rejected requests")
    ax2.set_title(f"overload, trace at {ov['speed']}x")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--speeds", default="auto", help="comma-separated, or auto: 1 and the "
                    "speed at which the prefill workers are 85%% busy")
    ap.add_argument("--overload-speed", default="auto")
    ap.add_argument("--quick", action="store_true",
                    help="least-loaded and ours only, no overload sweep")
    ap.add_argument("--stage-waits", default="5,10,15,20,25,30")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--profile", default=PROFILE_FILE, help="cost profile name or path")
    ap.add_argument("--noise", type=float, default=0.0,
                    help="lognormal sigma on every simulated duration")
    ap.add_argument("--kv-lease", type=float, default=10.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "routing_sim"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    profile = Profile.load(args.profile, block_size=TRACE_BLOCK)
    setup = derive(load_trace(args.trace, limit=args.limit), profile)
    kw = {"profile": profile, "noise": args.noise, "kv_lease_s": args.kv_lease}
    speeds = [1.0, round(setup.loaded_speed, 2)] if args.speeds == "auto" else \
        [float(s) for s in args.speeds.split(",")]
    policies = ("least_loaded", "ours") if args.quick else POLICIES
    rows = [simulate(p, args.trace, s, args.limit, setup, **kw)
            for s in speeds for p in policies]
    print(f"{setup.line()}\n{profile.name} ({profile.kv_blocks} KV blocks of {TRACE_BLOCK} "
          f"tokens), noise {args.noise}, KV lease {args.kv_lease}s")
    print_table(rows)
    result = {"setup": dataclasses.asdict(setup), "profile": profile.name,
              "noise": args.noise, "kv_lease_s": args.kv_lease, "policies": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.quick:
        out.with_suffix(".json").write_text(json.dumps(result, indent=1))
        out.with_suffix(".md").write_text(markdown(result))
        print(f"\nwrote {out.with_suffix('.json')} in {time.perf_counter() - t0:.0f}s")
        return
    ov = round(setup.overload_speed, 2) if args.overload_speed == "auto" else \
        float(args.overload_speed)
    kw["setup"] = setup
    unguarded = simulate("ours", args.trace, ov, args.limit, **kw)
    early = simulate("ours", args.trace, ov, args.limit, admission=True, **kw)
    stage = [dict(simulate("ours", args.trace, ov, args.limit, stage_wait_s=float(w), **kw),
                  stage_wait_s=float(w)) for w in args.stage_waits.split(",")]
    match = min(stage, key=lambda r: abs(r["goodput"] - early["goodput"]))
    print(f"\noverload at {ov}x: no rejection: goodput {unguarded['goodput']}, avg TTFT "
          f"{unguarded['avg_ttft_s']:.1f}s")
    print(f"  early rejection: goodput {early['goodput']}, rejected {early['rejected']}, "
          f"avg TTFT {early['avg_ttft_s']:.2f}s")
    for r in stage:
        print(f"  per-stage W={r['stage_wait_s']:>4g}s: goodput {r['goodput']:>6}, rejected "
              f"{r['rejected']:>5} {r['rejected_by_stage']}")
    print(f"  closest goodput: per-stage W={match['stage_wait_s']:g}s rejects "
          f"{match['rejected']} vs early {early['rejected']} "
          f"(goodput {match['goodput']} vs {early['goodput']})")
    result |= {"overload": {"speed": ov, "no_rejection": unguarded, "early": early,
                            "per_stage": stage, "closest": match["stage_wait_s"]},
               "wall_s": round(time.perf_counter() - t0, 1)}
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(markdown(result))
    plot(result, out.with_suffix(".png"))
    print(f"\nwrote {out.with_suffix('.json')} and .png in {result['wall_s']}s")


if __name__ == "__main__":
    main()
