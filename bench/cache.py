"""The cache pool's two benchmarks (issue #5): TTFT with a pooled prefix, and the hit
ratio of its eviction policies.

    python bench/cache.py                      # both parts
    python bench/cache.py --part ttft [--trials 5] [--prompt-len 2048] [--shared 0.9]
    python bench/cache.py --part ttft --quick  # as `make bench` runs it
    python bench/cache.py --part hit_ratio     # bench/cache_hit_ratio.py, as is

TTFT: a cache-pool process, a conductor (round robin), two unified workers of the
default model (one torch thread each, both ``--cache-pools`` the pool) and a gateway,
as real processes (``tests/cluster.py``), in a fresh temporary directory (the pool's
tiers start empty). On bench/harness.py, the four paths below are the sides of a round,
run in this order, interleaved round after round after one warm-up round. Each round
takes a fresh random prefix X (90 % of the prompt) from its own seed (drawn per run
unless ``--seed``), so nothing an earlier round or run cached can serve it, and sends
four prompts X + a distinct random suffix, one at a time; round robin alternates the
workers, A and B:

    1. A  cold      nothing cached anywhere: A computes all of it, writes it back
    2. B  pooled    B fetches X's full blocks from the pool, adopts them, computes the rest
    3. A  local     A's own prefix cache holds X (computed there)
    4. B  local     B's own prefix cache holds X (adopted from the pool in 2)

Before each next prompt the serving worker's write-back has finished (its
``pool_written_blocks`` grew by the expected count), so nothing runs in the background
of a measurement. Every prompt's path is checked (which worker's counters moved, pool
fetches, the cached tokens the gateway reports); the run stops if one is not the
intended one. TTFT is the time to the first streamed chunk (one greedy output token).
Figures are medians [min, max] over rounds; the ratios are per round, of ``pooled``
against each other path (cold ÷ pooled is the headline). Writes the harness report
``<out>/cache_ttft.json`` (bench/report.py renders it into docs/benchmarks.md) and
``.png``; the hit-ratio part writes ``cache_hit_ratio.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import cache_hit_ratio  # noqa: E402

from bench.harness import (  # noqa: E402
    RESULTS,
    Metric,
    RunContext,
    Session,
    print_summary,
    settings_line,
    write,
)
from common.client import Client  # noqa: E402

PATHS = ("cold", "pooled", "local", "local_adopted")  # the order they must run in
# The harness divides the other side's time by the first side's: with pooled first,
# "pooled vs cold" is cold ÷ pooled TTFT, the pool's gain.
RATIO_ORDER = ("pooled", "cold", "local", "local_adopted")
METRICS = [Metric("ttft_s", "TTFT", "s", higher_is_better=False)]
QUICK = {"trials": 3}
SERVER = {"cold": "A", "pooled": "B", "local": "A", "local_adopted": "B"}  # round robin
BLOCK_SIZE = 16  # the workers' default (services/worker/settings.py)
VOCAB = (100, 49152)


class PathError(RuntimeError):
    """A prompt did not take the path the trial intended."""


def ttft(client: Client, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the first streamed token, cached prompt tokens the gateway reports)."""
    first, cached = None, -1
    t0 = time.perf_counter()
    for chunk in client.stream(prompt_token_ids=prompt, max_tokens=1, temperature=0,
                               ignore_eos=True):
        if first is None and chunk.token_ids:
            first = time.perf_counter() - t0
        if chunk.finished:
            cached = chunk.usage.cached_tokens if chunk.usage else -1
    if first is None:
        raise PathError("no token came back")
    return first, cached


def served_by(cluster, before: dict, written: int, timeout_s: float = 60.0) -> tuple[str, dict]:
    """The worker that computed the last prompt, once its write-back of ``written``
    blocks is done; and every worker's stats then."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = {n: cluster.worker_stats(n) for n in before}
        grew = {n: now[n].pool.written_blocks - before[n].pool.written_blocks
                for n in now}
        done = [n for n, g in grew.items() if g == written and not now[n].pool.write_back_queued]
        if len(done) == 1 and sum(grew.values()) == written:
            return done[0], now
        if any(g > written for g in grew.values()) or time.monotonic() > deadline:
            raise PathError(f"write-back: expected one worker to write {written} blocks, "
                            f"got {grew} (dropped: "
                            f"{[s.pool.write_back_dropped for s in now.values()]})")
        time.sleep(0.05)


class Round:
    """What the four sides of one round share: the shared prefix X (from the round's
    seed), which worker is A and which B, and every worker's stats after the last side."""

    def __init__(self, cluster, prompt_len: int, shared_len: int) -> None:
        self.cluster, self.prompt_len, self.shared_len = cluster, prompt_len, shared_len
        self.names = sorted(n for n in cluster.procs if n.startswith("unified"))
        self.round = -1
        self.shared: list[int] = []
        self.workers: dict[str, str] = {}
        self.stats: dict = {}
        self.client: Client | None = None  # set once the cluster is up

    def side(self, path: str):
        def run(ctx: RunContext) -> dict:
            if path == "cold":  # the first side of every round: a new prefix X
                self.round, self.workers = ctx.round, {}
                rng = random.Random(ctx.seed)
                self.shared = [rng.randrange(*VOCAB) for _ in range(self.shared_len)]
                self.stats = {n: self.cluster.worker_stats(n) for n in self.names}
            elif ctx.round != self.round:
                raise PathError(f"{path} ran before this round's cold prompt")
            return self.measure(path, random.Random(f"{ctx.seed}-{path}"))
        return run

    def measure(self, path: str, rng: random.Random) -> dict:
        full, shared_blocks = self.prompt_len // BLOCK_SIZE, self.shared_len // BLOCK_SIZE
        prompt = self.shared + [rng.randrange(*VOCAB)
                                for _ in range(self.prompt_len - self.shared_len)]
        seconds, cached = ttft(self.client, prompt)
        written = full if path == "cold" else full - shared_blocks
        worker, after = served_by(self.cluster, self.stats, written)
        stats = self.stats
        delta = {f"pool_{k}": getattr(after[worker].pool, k) - getattr(stats[worker].pool, k)
                 for k in ("fetches", "fetched_blocks", "fetch_bytes", "fetch_seconds",
                           "adopt_seconds")}
        others_fetched = sum(after[n].pool.fetches - stats[n].pool.fetches
                             for n in self.names if n != worker)
        if path == "cold":
            self.workers = {"A": worker, "B": next(n for n in self.names if n != worker)}
        want = (0 if path == "cold" else shared_blocks * BLOCK_SIZE,
                1 if path == "pooled" else 0,
                shared_blocks if path == "pooled" else 0)
        got = (cached, delta["pool_fetches"], delta["pool_fetched_blocks"])
        if got != want or others_fetched or worker != self.workers[SERVER[path]]:
            raise PathError(f"{path}: served by {worker} (A={self.workers['A']}), "
                            f"(cached tokens, fetches, fetched blocks) {got}, wanted {want}")
        self.stats = after
        return {"ttft_s": seconds, "worker": worker, **delta}


def measure_ttft(args, session: Session) -> dict:
    """The four sides over ``args.trials`` rounds after one warm-up round; the runs
    (``Session.run``'s), reordered so that ``pooled`` is the side the ratios start from."""
    from services.engine.weights import DEFAULT_MODEL
    from tests.cluster import Cluster
    from tests.pool_procs import BLOCK, PoolProc

    shared_len = round(args.prompt_len * args.shared)
    with tempfile.TemporaryDirectory(prefix="bench-cache-") as tmp:
        pool = PoolProc("pool-0", Path(tmp), dram_blocks=args.pool_mib * (1 << 20) // BLOCK,
                        block_bytes=args.pool_block_bytes)
        pool.start(learn_block_bytes=not args.pool_block_bytes)
        cluster = Cluster(DEFAULT_MODEL, Path(tmp), ["unified", "unified"],
                          policy="round_robin", kv_cache_mib=args.kv_cache_mib,
                          worker_args=["--cache-pools", pool.control])
        try:
            cluster.start(timeout_s=300)
            deadline = time.monotonic() + 30
            while not all(cluster.worker_stats(n).pool.instances == ["pool-0"]
                          for n in ("unified-0", "unified-1")):
                if time.monotonic() > deadline:
                    raise RuntimeError("the workers did not find the pool")
                time.sleep(0.2)
            rounds = Round(cluster, args.prompt_len, shared_len)
            with Client(cluster.zmq_addr, timeout_s=300) as client:
                rounds.client = client
                runs = session.run({p: rounds.side(p) for p in PATHS}, repeats=args.trials,
                                   warmup=1)
            pool_stats = pool.stats()
        except BaseException:
            for proc in cluster.procs.values():
                print(f"--- {proc.name}\n{proc.tail(10)}", file=sys.stderr)
            print(f"--- pool-0\n{pool.tail(10)}", file=sys.stderr)
            raise
        finally:
            cluster.stop()
            pool.stop()
    pooled = runs["pooled"]
    breakdown = {k: statistics.median(p[k] for p in pooled) for k in (
        "pool_fetch_bytes", "pool_fetch_seconds", "pool_adopt_seconds")}
    extra = {"shared_tokens": shared_len,
             "cached_tokens": shared_len // BLOCK_SIZE * BLOCK_SIZE,
             "pooled_breakdown": breakdown, "pool_dram_blocks": pool_stats.dram_blocks}
    return {p: runs[p] for p in RATIO_ORDER}, extra


def report_ttft(report: dict) -> None:
    print_summary(report)
    med = {p: report["sides"][p]["ttft_s"]["median"] for p in PATHS}
    b = report["pooled_breakdown"]
    print(f"\nTTFT, {report['settings']['prompt_len']}-token prompt, "
          f"{report['shared_tokens']} shared ({report['cached_tokens']} reusable), "
          f"median of {report['repeats']} rounds:")
    for p in PATHS:
        print(f"  {p:>14} {med[p]:7.3f} s   cold / this {med['cold'] / med[p]:5.2f}x")
    print(f"  pooled: fetched {b['pool_fetch_bytes'] / 2**20:.1f} MiB in "
          f"{b['pool_fetch_seconds'] * 1e3:.1f} ms "
          f"({b['pool_fetch_bytes'] / b['pool_fetch_seconds'] / 1e9:.2f} GB/s), adopted in "
          f"{b['pool_adopt_seconds'] * 1e3:.1f} ms; pooled - local "
          f"{(med['pooled'] - med['local']) * 1e3:.0f} ms")
    ratio = report["ratios"]["pooled/cold"]["ttft_s"]["median"]
    goal = "met" if ratio >= 5 else "NOT met"
    print(f"  cold / pooled per round, median {ratio:.2f}x (goal >= 5x: {goal})")


def plot_ttft(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med = {p: report["sides"][p]["ttft_s"]["median"] for p in PATHS}
    labels = ["cold", "pooled\n(fetched)", "local hit\n(computed here)",
              "local hit\n(adopted earlier)"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    xs = range(len(PATHS))
    ax.bar(xs, [med[p] for p in PATHS], color=["#999", "#1f77b4", "#2ca02c", "#98df8a"])
    for x, p in zip(xs, PATHS, strict=True):
        runs = report["runs"][p]
        ax.scatter([x] * len(runs), [r["ttft_s"] for r in runs], color="k", s=10, zorder=3)
        note = f"{med[p]:.2f} s" + ("" if p == "cold" else f"\n{med['cold'] / med[p]:.1f}x")
        ax.annotate(note, (x, med[p]), ha="center", va="bottom", fontsize=9,
                    xytext=(0, 3), textcoords="offset points")
    ax.axhline(med["cold"] / 5, color="r", ls="--", lw=1, label="goal: cold / 5")
    ax.legend(fontsize=8, loc="upper right")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("time to first token (s)")
    ax.set_ylim(0, max(med.values()) * 1.2)
    ax.set_title(f"{report['settings']['prompt_len']}-token prompt, "
                 f"{report['shared_tokens']} shared; median of {report['repeats']} rounds "
                 "(dots: rounds)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("all", "ttft", "hit_ratio"), default="all")
    ap.add_argument("--trials", type=int, default=5, help="measured rounds, after a warm-up")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--shared", type=float, default=0.9, help="fraction of the prompt")
    ap.add_argument("--seed", type=int, default=None, help="default: drawn at random")
    ap.add_argument("--pool-mib", type=int, default=2048)
    ap.add_argument("--pool-block-bytes", type=int, default=BLOCK_SIZE * 46080,
                    help="the default model's block (30 layers, K and V, 3 x 64 float32 "
                    "per token); 0: the pool learns it from the first put")
    ap.add_argument("--kv-cache-mib", type=int, default=1024, help="per worker")
    ap.add_argument("--quick", action="store_true",
                    help="small profile: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    ap.add_argument("--out", default=str(RESULTS), help="directory of the results")
    args = ap.parse_args()
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    if not 0 < args.shared < 1 or args.prompt_len * args.shared < 2 * BLOCK_SIZE:
        ap.error("--shared must leave at least two shared blocks and a distinct suffix")
    if args.trials < 1:
        ap.error("--trials must be >= 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.part in ("all", "ttft"):
        settings = {"prompt_len": args.prompt_len, "shared": args.shared,
                    "workers": "2 unified, round robin, 1 torch thread each",
                    "pool_mib": args.pool_mib, "kv_cache_mib": args.kv_cache_mib,
                    "output": "1 greedy token"}
        print(settings_line(settings), flush=True)
        session = Session("cache_ttft", settings, seed=args.seed)
        runs, extra = measure_ttft(args, session)
        report = session.finish(METRICS, runs, extra=extra)
        report_ttft(report)
        path = write(report, out / "cache_ttft.json")
        plot_ttft(report, out / "cache_ttft.png")
        print(f"wrote {path} and .png")
    if args.part in ("all", "hit_ratio"):
        print("\nHit ratio, Mooncake conversation trace (bench/cache_hit_ratio.py):")
        cache_hit_ratio.main(["--out", str(out)])


if __name__ == "__main__":
    main()
