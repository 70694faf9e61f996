"""The cache pool's two benchmarks (issue #5): TTFT with a pooled prefix, and the hit
ratio of its eviction policies.

    python bench/cache.py                      # both parts
    python bench/cache.py --part ttft [--trials 5] [--prompt-len 2048] [--shared 0.9]
    python bench/cache.py --part hit_ratio     # bench/cache_hit_ratio.py, as is

TTFT: a cache-pool process, a conductor (round robin), two unified workers of the
default model (one torch thread each, both ``--cache-pools`` the pool) and a gateway,
as real processes (``tests/cluster.py``). Each trial takes a fresh random prefix X (90 %
of the prompt) and sends four prompts X + a distinct random suffix, one at a time; round
robin alternates the workers, A and B:

    1. A  cold      nothing cached anywhere: A computes all of it, writes it back
    2. B  pooled    B fetches X's full blocks from the pool, adopts them, computes the rest
    3. A  local     A's own prefix cache holds X (computed there)
    4. B  local     B's own prefix cache holds X (adopted from the pool in 2)

Before each next prompt the serving worker's write-back has finished (its
``pool_written_blocks`` grew by the expected count), so nothing runs in the background
of a measurement. Every prompt's path is checked (which worker's counters moved, pool
fetches, the cached tokens the gateway reports); the run stops if one is not the
intended one. TTFT is the time to the first streamed chunk (one greedy output token).
The first trial is a warm-up and not counted; figures are medians. Writes
``bench/results/cache_ttft.json`` and ``.png``; the hit-ratio part writes
``cache_hit_ratio.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
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

from common.client import Client  # noqa: E402

OUT = ROOT / "bench" / "results"
PATHS = ("cold", "pooled", "local", "local_adopted")
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
                            f"{[s['pool_write_back_dropped'] for s in now.values()]})")
        time.sleep(0.05)


def trial(client: Client, cluster, rng: random.Random, prompt_len: int,
          shared_len: int) -> dict:
    shared = [rng.randrange(*VOCAB) for _ in range(shared_len)]
    full = prompt_len // BLOCK_SIZE
    shared_blocks = shared_len // BLOCK_SIZE
    names = sorted(n for n in cluster.procs if n.startswith("unified"))
    stats = {n: cluster.worker_stats(n) for n in names}
    out, workers = {}, {}
    for path in PATHS:
        prompt = shared + [rng.randrange(*VOCAB) for _ in range(prompt_len - shared_len)]
        seconds, cached = ttft(client, prompt)
        written = full if path == "cold" else full - shared_blocks
        worker, after = served_by(cluster, stats, written)
        delta = {f"pool_{k}": getattr(after[worker].pool, k) - getattr(stats[worker].pool, k)
                 for k in ("fetches", "fetched_blocks", "fetch_bytes", "fetch_seconds",
                           "adopt_seconds")}
        others_fetched = sum(after[n].pool.fetches - stats[n].pool.fetches
                             for n in names if n != worker)
        if path == "cold":
            workers["A"] = worker
            workers["B"] = next(n for n in names if n != worker)
        want = (0 if path == "cold" else shared_blocks * BLOCK_SIZE,
                1 if path == "pooled" else 0,
                shared_blocks if path == "pooled" else 0)
        got = (cached, delta["pool_fetches"], delta["pool_fetched_blocks"])
        if got != want or others_fetched or (
                path != "cold" and worker != workers[SERVER[path]]):
            raise PathError(f"{path}: served by {worker} (A={workers['A']}), "
                            f"(cached tokens, fetches, fetched blocks) {got}, wanted {want}")
        out[path] = {"ttft_s": seconds, "worker": worker, **delta}
        stats = after
    return out


def measure_ttft(args) -> dict:
    from services.engine.weights import DEFAULT_MODEL
    from tests.cluster import Cluster
    from tests.pool_procs import BLOCK, PoolProc

    shared_len = round(args.prompt_len * args.shared)
    rng = random.Random(args.seed)
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
            trials = []
            with Client(cluster.zmq_addr, timeout_s=300) as client:
                for i in range(args.trials + 1):
                    t = trial(client, cluster, rng, args.prompt_len, shared_len)
                    print(("warm-up " if i == 0 else f"trial {i}  ") + "  ".join(
                        f"{p} {t[p]['ttft_s']:.3f} s" for p in PATHS), flush=True)
                    if i:
                        trials.append(t)
            pool_stats = pool.stats()
        except BaseException:
            for proc in cluster.procs.values():
                print(f"--- {proc.name}\n{proc.tail(10)}", file=sys.stderr)
            print(f"--- pool-0\n{pool.tail(10)}", file=sys.stderr)
            raise
        finally:
            cluster.stop()
            pool.stop()
    med = {p: statistics.median(t[p]["ttft_s"] for t in trials) for p in PATHS}
    pooled = [t["pooled"] for t in trials]
    breakdown = {k: statistics.median(p[k] for p in pooled) for k in (
        "pool_fetch_bytes", "pool_fetch_seconds", "pool_adopt_seconds")}
    return {
        "args": {k: v for k, v in vars(args).items() if k != "part"},
        "shared_tokens": shared_len, "cached_tokens": shared_len // BLOCK_SIZE * BLOCK_SIZE,
        "median_ttft_s": med,
        "ratios": {"cold_over_pooled": med["cold"] / med["pooled"],
                   "cold_over_local": med["cold"] / med["local"],
                   "pooled_over_local": med["pooled"] / med["local"]},
        "pooled_breakdown": breakdown,
        "pool_dram_blocks": pool_stats.dram_blocks,
        "trials": trials,
    }


def report_ttft(result: dict) -> None:
    med, r, b = result["median_ttft_s"], result["ratios"], result["pooled_breakdown"]
    n = result["args"]["prompt_len"]
    print(f"\nTTFT, {n}-token prompt, {result['shared_tokens']} shared "
          f"({result['cached_tokens']} reusable), median of {result['args']['trials']}:")
    for p in PATHS:
        print(f"  {p:>14} {med[p]:7.3f} s   cold / this {med['cold'] / med[p]:5.2f}x")
    print(f"  pooled: fetched {b['pool_fetch_bytes'] / 2**20:.1f} MiB in "
          f"{b['pool_fetch_seconds'] * 1e3:.1f} ms "
          f"({b['pool_fetch_bytes'] / b['pool_fetch_seconds'] / 1e9:.2f} GB/s), adopted in "
          f"{b['pool_adopt_seconds'] * 1e3:.1f} ms; pooled - local "
          f"{(med['pooled'] - med['local']) * 1e3:.0f} ms")
    goal = "met" if r["cold_over_pooled"] >= 5 else "NOT met"
    print(f"  cold / pooled {r['cold_over_pooled']:.2f}x (goal >= 5x: {goal})")


def plot_ttft(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med = result["median_ttft_s"]
    labels = ["cold", "pooled\n(fetched)", "local hit\n(computed here)",
              "local hit\n(adopted earlier)"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    xs = range(len(PATHS))
    ax.bar(xs, [med[p] for p in PATHS], color=["#999", "#1f77b4", "#2ca02c", "#98df8a"])
    for x, p in zip(xs, PATHS, strict=True):
        ax.scatter([x] * len(result["trials"]), [t[p]["ttft_s"] for t in result["trials"]],
                   color="k", s=10, zorder=3)
        note = f"{med[p]:.2f} s" + ("" if p == "cold" else f"\n{med['cold'] / med[p]:.1f}x")
        ax.annotate(note, (x, med[p]), ha="center", va="bottom", fontsize=9,
                    xytext=(0, 3), textcoords="offset points")
    ax.axhline(med["cold"] / 5, color="r", ls="--", lw=1, label="goal: cold / 5")
    ax.legend(fontsize=8, loc="upper right")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("time to first token (s)")
    ax.set_ylim(0, max(med.values()) * 1.2)
    a = result["args"]
    ax.set_title(f"{a['prompt_len']}-token prompt, {result['shared_tokens']} shared; "
                 f"median of {a['trials']} (dots: trials)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("all", "ttft", "hit_ratio"), default="all")
    ap.add_argument("--trials", type=int, default=5, help="after one warm-up trial")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--shared", type=float, default=0.9, help="fraction of the prompt")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--pool-mib", type=int, default=2048)
    ap.add_argument("--pool-block-bytes", type=int, default=BLOCK_SIZE * 46080,
                    help="the default model's block (30 layers, K and V, 3 x 64 float32 "
                    "per token); 0: the pool learns it from the first put")
    ap.add_argument("--kv-cache-mib", type=int, default=1024, help="per worker")
    args = ap.parse_args()
    if not 0 < args.shared < 1 or args.prompt_len * args.shared < 2 * BLOCK_SIZE:
        ap.error("--shared must leave at least two shared blocks and a distinct suffix")
    if args.trials < 1:
        ap.error("--trials must be >= 1")
    OUT.mkdir(parents=True, exist_ok=True)
    if args.part in ("all", "ttft"):
        result = measure_ttft(args)
        report_ttft(result)
        (OUT / "cache_ttft.json").write_text(json.dumps(result, indent=2) + "\n")
        plot_ttft(result, OUT / "cache_ttft.png")
        print(f"wrote {OUT / 'cache_ttft.json'} and .png")
    if args.part in ("all", "hit_ratio"):
        print("\nHit ratio, Mooncake conversation trace (bench/cache_hit_ratio.py):")
        cache_hit_ratio.main(["--out", str(OUT)])


if __name__ == "__main__":
    main()
