"""``pdserve advise``: the best deployment of N workers for a workload under SLOs.

    pdserve advise --workers N --slo-ttft-ms MS --slo-tpot-ms MS
        (--trace PATH [--trace-block 512] [--speed X] [--limit N]
         | --rate R --input-len L --output-len L [--requests 200] [--range-ratio 0.5]
           [--shared-prefix T] [--seed S])
        [--profile smollm2-cpu] [--kv-cache-mib MIB] [--pool-mib 1024] [--no-pool]
        [--admission] [--noise SIGMA [--runs N]] [--kv-lease S] [--one-host] [--out advise]
        [--no-progress]

Simulates every deployment (``services/advisor/search.py``), prints them ranked, and
writes into ``--out``: ``recommended.toml`` (the best one as a deploy/configs file),
``goodput.png`` (goodput against the split) and ``advise.json`` (every outcome).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

DEFAULT_KV_CACHE_MIB = 1024  # a worker's default kv_cache_mib (services/worker/settings.py)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, required=True, help="worker processes in all")
    p.add_argument("--slo-ttft-ms", type=float, required=True)
    p.add_argument("--slo-tpot-ms", type=float, required=True)
    p.add_argument("--profile", default="smollm2-cpu",
                   help="cost profile: a name in deploy/profiles or a JSON path "
                        "(bench/calibrate.py writes one); the conductor's cost_profile")
    w = p.add_argument_group("workload: a Mooncake-format trace, or lengths and a rate")
    w.add_argument("--trace", help="JSONL: timestamp (ms), input_length, output_length, "
                                   "hash_ids")
    w.add_argument("--trace-block", type=int, default=512, help="tokens per hash id")
    w.add_argument("--speed", type=float, default=1.0, help="compress the trace's time")
    w.add_argument("--limit", type=int, default=None, help="first N trace requests")
    w.add_argument("--rate", type=float, help="requests/s (Poisson)")
    w.add_argument("--input-len", type=int)
    w.add_argument("--output-len", type=int)
    w.add_argument("--requests", type=int, default=200)
    w.add_argument("--range-ratio", type=float, default=0.5)
    w.add_argument("--shared-prefix", type=int, default=0,
                   help="tokens at the start of every prompt common to all")
    w.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-mib", type=int, default=None,
                   help="each worker's KV cache; default: the profile's kv_capacity_tokens, "
                        f"else {DEFAULT_KV_CACHE_MIB}")
    p.add_argument("--pool-mib", type=int, default=1024, help="the cache pool's DRAM tier")
    p.add_argument("--no-pool", action="store_true", help="no deployments with a cache pool")
    p.add_argument("--admission", action="store_true",
                   help="the conductor rejects requests predicted to miss the SLOs")
    p.add_argument("--noise", type=float, default=0.0,
                   help="lognormal sigma on every simulated duration")
    p.add_argument("--runs", type=int, default=1,
                   help="simulated runs a deployment (with --noise: each a draw; the "
                        "ranking takes each one's run of median goodput)")
    p.add_argument("--kv-lease", type=float, default=10.0)
    p.add_argument("--out", default="advise", help="folder for the config, plot and JSON")
    p.add_argument("--one-host", action="store_true",
                   help="all workers share one host's cores: apply the profile's contention "
                        "and per-token serving overhead (bench/calibrate_host.py)")
    p.add_argument("--no-progress", action="store_true")


def _workload(args):
    from services.advisor import workload

    if args.trace:
        if args.rate is not None or args.input_len is not None:
            raise ValueError("give --trace or --rate/--input-len/--output-len, not both")
        return workload.from_trace(args.trace, block_tokens=args.trace_block,
                                   speed=args.speed, limit=args.limit)
    if args.rate is None or args.input_len is None or args.output_len is None:
        raise ValueError("give --trace, or --rate, --input-len and --output-len")
    from common.cost_profile import load_profile
    return workload.synthetic(
        requests=args.requests, rate=args.rate, input_len=args.input_len,
        output_len=args.output_len, range_ratio=args.range_ratio,
        shared_prefix=args.shared_prefix, seed=args.seed,
        block_tokens=load_profile(args.profile).block_size)


def advise(args: argparse.Namespace) -> int:
    from common.cost_profile import load_profile
    from services.advisor import config, report, search
    from services.sim.profiles import Profile

    load = _workload(args)
    cp = load_profile(args.profile)
    mib = args.kv_cache_mib
    if mib is None:
        mib = (-(-cp.kv_capacity_tokens * cp.kv_bytes_per_token >> 20)
               if cp.kv_capacity_tokens else DEFAULT_KV_CACHE_MIB)
    if mib <= 0 or args.pool_mib <= 0:
        raise ValueError("--kv-cache-mib and --pool-mib must be > 0")
    blocks = (mib << 20) // (cp.kv_bytes_per_token * load.block_tokens)
    plan = search.Plan(args.profile, Profile.from_cost_profile(
        cp, block_size=load.block_tokens, kv_blocks=max(1, blocks)),
        search.Slo(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3), mib, args.pool_mib,
        args.admission, args.kv_lease, args.noise, args.seed, shared_host=args.one_host)
    candidates = search.deployments(args.workers,
                                    pool=not args.no_pool and cp.pool_bandwidth > 0)
    print(f"workload: {load.name}\n  {load.stats().line()}")
    print(f"profile {cp.name}: {mib} MiB of KV per worker ({blocks} blocks of "
          f"{load.block_tokens} tokens); {len(candidates)} deployments of "
          f"{args.workers} workers")
    progress = None if args.no_progress else report.Progress(len(candidates))
    try:
        outcomes = search.search(candidates, load.requests, plan, progress, args.runs)
    finally:
        if progress is not None:
            progress.close()
    print(report.table(outcomes, plan.slo))
    best = outcomes[0]
    out = Path(args.out)
    path = config.write(out / "recommended.toml",
                        config.render(best.deployment, plan, best, workload=load.name))
    picture = report.plot(outcomes, out / "goodput.png",
                          f"{load.name}; {args.workers} workers, {cp.name}")
    (out / "advise.json").write_text(json.dumps({
        "workload": load.name, "stats": dataclasses.asdict(load.stats()),
        "profile": args.profile, "workers": args.workers,
        "slo": dataclasses.asdict(plan.slo), "kv_cache_mib": mib,
        "outcomes": [{"name": o.deployment.name, **dataclasses.asdict(o)}
                     for o in outcomes]}, indent=1, default=str))
    print(f"\nrecommended: {best.deployment.name} -> {path}")
    print(f"wrote {out / 'advise.json'}" + (f" and {picture}" if picture else ""))
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        return advise(args)
    except ValueError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
