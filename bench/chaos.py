"""Fault injection under load: nothing completed is wrong, nothing streamed is lost.

    python bench/chaos.py [--duration 90] [--rate 3] [--seed 0] [--faults a,b,c]
                          [--short] [--out chaos.json] [--model DIR] [--workdir DIR]

Real processes (``tests.cluster``): gateway, conductor, one prefill worker, two decode
workers and a cache pool, serving a tiny random model with the default tokenizer (or
``--model``). Where network namespaces can be made, the prefill worker runs on a "host"
of its own joined to the rest by a veth pair (``bench/chaos_netns``), so its link can be
cut; elsewhere all run on loopback and the link cut is skipped. The prefill worker's KV
senders spoil chunks while the corrupt_kv fault asks them to (PDSERVE_TEST_CORRUPT_KV,
``common/transfer/fault_hook.py``). A steady Poisson load of greedy and seeded requests
of varied prompt lengths (those of ``disagg_threshold`` tokens or more cross to the prefill
worker), three in four over the ZeroMQ client port (token ids and stream positions), one
in four over HTTP SSE (text), runs twice: once undisturbed (the reference), then on a
fresh cluster of the same shape while the fault schedule strikes (``bench/chaos_faults``:
a list of (name, at_s)). Every completed request is compared with its reference.

Reported: requests sent, completed exact, completed different (must be 0), failed by
reason (a clean error from the gateway, or not), tokens lost or repeated in streams
(positions contiguous, no duplicates, as many tokens as asked; must be 0), KV blocks
leaked once the load is over (every worker's free blocks back to its total, nothing
running or waiting), processes restarted, and per fault the p99 latency added to the
requests in flight during its window compared with the same requests' reference latency.
JSON to ``--out``, a table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench.` and `tests.` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.chaos_faults import FAULTS, Strike, Target, strike  # noqa: E402
from bench.chaos_load import Outcome, Req, run_load  # noqa: E402
from bench.chaos_netns import HostedPoolProc, Placement, corrupt_env, place  # noqa: E402
from tests.cluster import Cluster, make_served_tiny_model  # noqa: E402

ROLES = ["prefill", "decode", "decode"]
# at_s as a fraction of the duration. The wire and KV faults come early: the kills take
# long on a loaded machine, and a fault striking after the load has ended finds nothing.
SCHEDULE = [("prefill_sigkill", 0.08), ("corrupt_kv", 0.14), ("junk", 0.24),
            ("link_cut", 0.31), ("decode_sigkill", 0.38), ("conductor_sigterm", 0.46),
            ("overload", 0.54), ("pool_restart", 0.62), ("prefill_sigterm", 0.70)]
SHORT = ["prefill_sigkill", "corrupt_kv", "junk", "link_cut", "decode_sigkill",
         "conductor_sigterm", "overload"]
SETTLE_S = 5.0  # a fault's window runs this long past its end


def build_requests(duration: float, rate: float, seed: int) -> list[Req]:
    rng = random.Random(seed)
    reqs, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return reqs
        crosses = rng.random() < 0.5  # at least disagg_threshold (16) prompt tokens
        plen = rng.randint(16, 200) if crosses else rng.randint(2, 15)
        reqs.append(Req(index=len(reqs), at_s=t,
                        prompt=[rng.randrange(3, 49152) for _ in range(plen)],
                        max_tokens=rng.randint(8, 40),
                        seed=rng.randrange(1 << 30) if rng.random() < 0.4 else None,
                        http=rng.random() < 0.25))


def start_cluster(model: str, workdir: Path,
                  placement: Placement) -> tuple[Cluster, HostedPoolProc]:
    """The cluster and its pool on ``placement``; the prefill worker's KV senders spoil
    chunks while ``workdir/corrupt-kv`` asks them to (the corrupt_kv fault)."""
    workdir.mkdir(parents=True, exist_ok=True)
    pool = HostedPoolProc("pool-0", workdir, dram_blocks=4096, host=placement.host).start(
        learn_block_bytes=True, timeout_s=60)
    pools = ["--cache-pools", pool.control]
    cluster = Cluster(model, workdir, ROLES, conductor_args=pools, worker_args=pools,
                      host=placement.host, worker_hosts={"prefill-0": placement.prefill_host(
                          corrupt_env(workdir / "corrupt-kv"))})
    try:
        cluster.start(timeout_s=180)
    except BaseException:
        pool.stop()
        raise
    return cluster, pool


def blocks_leaked(cluster: Cluster, timeout_s: float = 30.0) -> dict[str, int]:
    """Per worker, blocks not free once idle (running/waiting counted as leaked too)."""
    deadline = time.monotonic() + timeout_s
    while True:
        leaked = {}
        for name in cluster.procs:
            if name in ("conductor", "gateway"):
                continue
            s = cluster.worker_stats(name)
            leaked[name] = (s.info.num_blocks - s.free_blocks) + s.running + s.waiting
        if not any(leaked.values()) or time.monotonic() > deadline:
            return leaked
        time.sleep(0.5)


def one_run(model: str, workdir: Path, reqs: list[Req], schedule: list[tuple[str, float]],
            rate: float, placement: Placement
            ) -> tuple[list[Outcome], list[Strike], dict[str, int], list[str]]:
    """The load on a fresh cluster while ``schedule`` strikes; run inside the cluster's
    namespace when there is one (``Placement.run``)."""
    cluster, pool = start_cluster(model, workdir, placement)
    try:
        strikes: list[Strike] = []
        target = Target(cluster, pool, overload=lambda n, s: None, rate=rate,
                        placement=placement, corrupt_file=workdir / "corrupt-kv")

        async def faults(t0: float, extra) -> None:
            target.overload = extra
            for name, at_s in schedule:
                await asyncio.sleep(max(0.0, t0 + at_s - time.monotonic()))
                strikes.append(await asyncio.to_thread(strike, target, name, t0))

        outcomes = asyncio.run(run_load(cluster, reqs, faults if schedule else None))
        return outcomes, strikes, blocks_leaked(cluster), target.restarts
    finally:
        cluster.stop()
        pool.stop()


def p99(xs: list[float]) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, math.ceil(0.99 * len(xs)) - 1)]


def compare(ref: list[Outcome], got: list[Outcome], strikes: list[Strike],
            leaked: dict[str, int], restarts: list[str]) -> dict:
    want = {o.req.index: o for o in ref}
    exact, different, failed, unreferenced = 0, [], {}, 0
    lost = sum(o.lost for o in got)
    repeated = sum(o.repeated for o in got)
    for o in got:
        r = want.get(o.req.source)
        if o.error is not None:
            key = ("clean: " if o.clean else "unclean: ") + o.error
            failed[key] = failed.get(key, 0) + 1
        elif r is None or r.error is not None:
            unreferenced += 1
        elif o.output == r.output:
            exact += 1
        else:
            different.append(o.req.index)
    per_fault = {}
    for s in strikes:
        lo, hi = s.start_s, s.end_s + SETTLE_S
        added = [(o.end_s - o.start_s) - (want[o.req.source].end_s - want[o.req.source].start_s)
                 for o in got if o.error is None and o.start_s < hi and o.end_s > lo
                 and want.get(o.req.source) and want[o.req.source].error is None]
        worst = p99(added)
        per_fault[s.name] = {**asdict(s), "in_flight": len(added),
                             "p99_added_ms": None if worst is None else round(worst * 1e3)}
    failures = [{"index": o.req.index, "start_s": round(o.start_s, 2),
                 "end_s": round(o.end_s, 2), "http": o.req.http, "error": o.error}
                for o in got if o.error is not None]
    return {"failures": failures, "sent": len(got), "completed_exact": exact,
            "completed_different": len(different),
            "different_indices": different, "completed_unreferenced": unreferenced,
            "failed": dict(sorted(failed.items())), "failed_total": sum(failed.values()),
            "tokens_lost": lost, "tokens_repeated": repeated,
            "blocks_leaked": sum(leaked.values()), "blocks_leaked_by_worker": leaked,
            "restarted": restarts, "faults": per_fault,
            "reference_failed": sum(o.error is not None for o in ref)}


def format_table(res: dict) -> str:
    rows = [("requests sent", res["sent"]), ("completed exact", res["completed_exact"]),
            ("completed different (must be 0)", res["completed_different"]),
            ("completed, reference failed", res["completed_unreferenced"]),
            ("failed", res["failed_total"])]
    rows += [(f"  {k}", v) for k, v in res["failed"].items()]
    rows += [("tokens lost in streams (must be 0)", res["tokens_lost"]),
             ("tokens repeated in streams (must be 0)", res["tokens_repeated"]),
             ("KV blocks leaked (must be 0)", res["blocks_leaked"]),
             ("processes restarted", ", ".join(res["restarted"]) or "-"),
             ("reference run failures", res["reference_failed"])]
    width = max(len(str(k)) for k, _ in rows)
    out = [f"{k:<{width}}  {v}" for k, v in rows]
    out += ["", f"{'fault':<18} {'at s':>6} {'took s':>7} {'struck':>6} {'in flight':>9} "
            f"{'p99 added ms':>12}"]
    for name, f in res["faults"].items():
        p = "-" if f["p99_added_ms"] is None else f["p99_added_ms"]
        struck = "yes" if f["struck"] else "skip" if f["skipped"] else "NO"
        out.append(f"{name:<18} {f['start_s']:>6.1f} {f['end_s'] - f['start_s']:>7.1f} "
                   f"{struck:>6} {f['in_flight']:>9} {p:>12}")
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=None,
                    help="seconds of load (default 90, --short 40)")
    ap.add_argument("--rate", type=float, default=None,
                    help="requests per second (default 3, --short 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--faults", default="", help=f"comma-separated subset of {list(FAULTS)}")
    ap.add_argument("--short", action="store_true", help="a short run with fewer faults")
    ap.add_argument("--out", default="", help="write the JSON result here")
    ap.add_argument("--model", default="", help="model dir (default: a tiny random model)")
    ap.add_argument("--workdir", default="", help="logs and keys (default: a temp dir)")
    args = ap.parse_args(argv)
    args.duration = args.duration or (40.0 if args.short else 90.0)
    args.rate = args.rate or (2.0 if args.short else 3.0)
    names = [n for n in args.faults.split(",") if n] or (SHORT if args.short else
                                                        [n for n, _ in SCHEDULE])
    unknown = sorted(set(names) - set(FAULTS))
    if unknown:
        ap.error(f"unknown faults {unknown}; known: {list(FAULTS)}")
    args.schedule = [(n, round(f * args.duration, 1)) for n, f in SCHEDULE if n in names]
    if args.short and not args.faults:  # the short schedule packs its faults closer
        step = 0.7 / max(1, len(args.schedule) - 1)
        args.schedule = [(n, round(args.duration * (0.1 + step * i), 1))
                         for i, (n, _) in enumerate(args.schedule)]
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="pdserve-chaos-"))
    model = args.model or str(make_served_tiny_model(work / "model", seed=args.seed))
    reqs = build_requests(args.duration, args.rate, args.seed)
    print(f"{len(reqs)} requests over {args.duration:.0f} s; faults {args.schedule}; "
          f"logs in {work}", flush=True)
    placement = place()
    if placement.wire is None:
        print(f"all processes on loopback, link_cut skipped: {placement.why_not}", flush=True)
    try:
        ref, _, ref_leaked, _ = placement.run(one_run, model, work / "reference", reqs, [],
                                              args.rate, placement)
        got, strikes, leaked, restarts = placement.run(
            one_run, model, work / "chaos", reqs, args.schedule, args.rate, placement)
    finally:
        placement.delete()
    res = compare(ref, got, strikes, leaked, restarts)
    res["reference_blocks_leaked"] = sum(ref_leaked.values())
    res["config"] = {"duration_s": args.duration, "rate": args.rate, "seed": args.seed,
                     "schedule": args.schedule, "roles": ROLES, "workdir": str(work),
                     "prefill_on_own_netns": placement.wire is not None,
                     "loopback_because": placement.why_not}
    print(format_table(res), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
