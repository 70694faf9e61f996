"""The simulator's engine steps against a live run's, for one of ``bench/advise_check.py``'s
workloads and deployments: decode steps by batch, and prefill time per prompt token on
the prefill worker and on the decode (or unified) workers.

    python bench/advise_check.py --only prefill-heavy --deployment 1P+1D \\
        --step-trace --logs DIR                        # live, every step in the logs
    python bench/sim_steps.py --only prefill-heavy --deployment 1P+1D --logs DIR

Live: the workers' ``step`` lines (worker ``log_level = "debug"``, which
``--step-trace`` sets): each step's milliseconds, decode batch and prompt tokens.
Simulated: the step samples the simulated workers report (``Simulator(steps=...)``; a
run of decode steps with the batch unchanged is one sample of their mean). A step that
prefills and decodes at once counts as a prefill on both sides (the simulator's sample
holds its prefill part only). Without ``--logs``, the simulator's side alone.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import advise_check as ac  # noqa: E402
from services.advisor.search import evaluate  # noqa: E402

BATCHES = ((1, 1), (2, 3), (4, 7), (8, 15), (16, 10_000))
STEP = re.compile(r"\bstep\b.*?\bchunks=(\d+) decode=(\d+) ms=([\d.]+) prefill=(\d+)")


def bucket(batch: int) -> str:
    lo, hi = next((lo, hi) for lo, hi in BATCHES if batch <= hi)
    return f"B={lo}" if lo == hi else f"B={lo}-{min(hi, 99)}" if hi < 10_000 else f"B>={lo}"


def table(rows: list[tuple[str, str, float]]) -> dict[tuple[str, str], list[float]]:
    """(where, kind, value) rows -> {(where, kind): values}."""
    out: dict[tuple[str, str], list[float]] = {}
    for where, kind, value in rows:
        out.setdefault((where, kind), []).append(value)
    return out


def simulated(name: str, deployment: str, requests: int, seed: int) -> dict:
    specs, plan = ac.specs_for(name, requests, seed), ac.plan_for(name)
    steps: list = []
    evaluate(ac.DEPLOYMENTS[deployment], ac.sim_requests(specs, plan.profile.block_size),
             plan, steps=steps)
    rows = []
    for wid, kind, s in steps:
        where = "prefill worker" if wid.startswith("prefill") else "decode worker"
        if kind == "decode":
            rows.append((where, f"decode {bucket(s.batch)} ms", s.seconds * 1e3))
        elif sum(s.tokens):
            rows.append((where, "prefill ms/token", s.seconds * 1e3 / sum(s.tokens)))
    return table(rows)


def live(logs: Path, deployment: str, workload: str = "") -> dict:
    """The step lines of ``deployment``'s workers in ``logs`` (``workload``'s, as
    advise_check names them; without it, or where it has none, unprefixed names)."""
    rows = []
    pattern = ac.log_name("", deployment, "*.log")
    found = sorted(logs.glob(f"{workload}-{pattern}")) if workload else []
    for log in found or sorted(logs.glob(pattern)):
        role = log.name[:-len(".log")].split("-")[-2]  # <role>-<index>.log: a worker's
        if role not in ("prefill", "decode", "unified"):
            continue
        where = "prefill worker" if role == "prefill" else "decode worker"
        for m in map(STEP.search, log.read_text(errors="replace").splitlines()):
            if m is None:
                continue
            chunks, batch, ms, tokens = int(m[1]), int(m[2]), float(m[3]), int(m[4])
            if chunks and tokens:
                rows.append((where, "prefill ms/token", ms / tokens))
            elif batch:
                rows.append((where, f"decode {bucket(batch)} ms", ms))
    return table(rows)


def median(values: list[float] | None) -> str:
    return f"{statistics.median(values):.2f} ({len(values)})" if values else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=sorted(ac.WORKLOADS), default="prefill-heavy")
    ap.add_argument("--deployment", choices=sorted(ac.DEPLOYMENTS), default="1P+1D")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--logs", type=Path, help="a live run's logs (advise_check --logs)")
    args = ap.parse_args()
    sim = simulated(args.only, args.deployment, args.requests, args.seed)
    real = live(args.logs, args.deployment, args.only) if args.logs else {}
    if args.logs and not real:
        sys.exit(f"no step lines in {args.logs}: run advise_check with --step-trace")
    print(f"{args.only}, {args.deployment}: median (steps)")
    print(f"{'where':16} {'step':22} {'simulated':>16} {'live':>16}")
    for key in sorted(set(sim) | set(real)):
        print(f"{key[0]:16} {key[1]:22} {median(sim.get(key)):>16} {median(real.get(key)):>16}")


if __name__ == "__main__":
    main()
