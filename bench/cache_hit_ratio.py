"""Prefix hit ratio of the cache pool's eviction policies on the Mooncake conversation trace.

    python bench/cache_hit_ratio.py [--trace PATH] [--fractions 0.01 0.05 0.2]
                                    [--block-tokens 512 16] [--requests N]

Each trace line is a request whose ``hash_ids`` is its chain of 512-token prefix blocks
(same id = same content). The replay drives the policy objects of
``services.cache_pool.eviction`` directly, through a cache of C blocks, C a fraction of
the trace's unique blocks, at each ``--block-tokens`` size: at 16 tokens (the engine's
paging block, what the pool holds live) each trace block becomes 32 blocks of the same
content and the capacity 32 times as many blocks, so every size holds the same tokens.
Per request, in arrival order:

1. count hits: block i is a hit iff it is cached on arrival and blocks 0..i-1 of this
   request were hits (prefix semantics: a cached block after a miss is useless);
2. then use every block in chain order, depth = its index in the chain: a cached block
   is accessed; a missing one is inserted, after evicting the policy's victim when the
   cache is full (evict then insert, as ``DramTier.put`` does).

Hit ratio = hit blocks / all blocks. The infinite cache bounds every policy. Prints a
table, writes ``bench/results/cache_hit_ratio.json``, ``cache_hit_ratio.md`` (the table of
docs/benchmarks.md; ``--render JSON`` prints it again) and ``cache_hit_ratio.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.cache_pool.eviction import (  # noqa: E402
    EvictionPolicy,
    LRUPolicy,
    ReuseAwarePolicy,
    ReuseParams,
)

# Beside the checkout (/work/main -> /work/shared), else where bench/routing_sim.py reads it.
DEFAULT_TRACE = next((p for p in (ROOT.parent / "shared" / "traces",
                                  Path("/work/shared/traces"))
                      if (p / "mooncake_conversation_trace.jsonl").exists()),
                     ROOT.parent / "shared" / "traces") / "mooncake_conversation_trace.jsonl"


TRACE_BLOCK_TOKENS = 512


def load_chains(path: Path, limit: int = 0) -> list[list[int]]:
    chains = []
    with open(path) as f:
        for line in f:
            if line.strip():
                chains.append(json.loads(line)["hash_ids"])
                if limit and len(chains) >= limit:
                    break
    return chains


def split_chains(chains: list[list[int]], block_tokens: int) -> list[list[int]]:
    """The same token content in ``block_tokens``-token blocks (a divisor of 512): block
    ``h`` becomes ``h * n + j`` for j < n = 512 / block_tokens, in chain order."""
    if block_tokens <= 0 or TRACE_BLOCK_TOKENS % block_tokens:
        raise ValueError(f"block_tokens must divide {TRACE_BLOCK_TOKENS}, got {block_tokens}")
    n = TRACE_BLOCK_TOKENS // block_tokens
    if n == 1:
        return chains
    return [[h * n + j for h in chain for j in range(n)] for chain in chains]


def prefix_hits(chain: list[int], cached) -> int:
    hits = 0
    for key in chain:
        if key not in cached:
            break
        hits += 1
    return hits


def replay_infinite(chains: list[list[int]]) -> int:
    seen: set[int] = set()
    hits = 0
    for chain in chains:
        hits += prefix_hits(chain, seen)
        seen.update(chain)
    return hits


def replay(chains: list[list[int]], policy: EvictionPolicy, capacity: int) -> int:
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    hits = 0
    for chain in chains:
        hits += prefix_hits(chain, policy)
        for depth, key in enumerate(chain):
            if key in policy:
                policy.on_access(key)
                continue
            if len(policy) >= capacity:
                policy.on_remove(policy.victim())
            policy.on_insert(key, depth)
    return hits


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for size in sorted({row["block_tokens"] for row in result["rows"]}, reverse=True):
        rows = [row for row in result["rows"] if row["block_tokens"] == size]
        xs = [row["fraction"] * 100 for row in rows]
        for name in result["policies"]:
            ax.plot(xs, [100 * row[name] for row in rows], marker="o",
                    linestyle="-" if size == TRACE_BLOCK_TOKENS else ":",
                    label=f"{name}, {size}-token blocks")
    ax.axhline(100 * result["infinite"], color="gray", linestyle="--", label="infinite")
    ax.set_xscale("log")
    ax.set_xticks(xs, [f"{x:g}%" for x in xs])
    ax.set_xlabel("capacity (% of the trace's unique blocks)")
    ax.set_ylabel("prefix hit ratio (% of blocks)")
    ax.set_title("Mooncake conversation trace")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(result: dict) -> str:
    """The table of docs/benchmarks.md (written beside the JSON, pasted as it is)."""
    out = ["| block | capacity | LRU | reuse-aware | ratio |", "|---|---|---|---|---|",
           f"| any | infinite | {result['infinite']:.2%} | {result['infinite']:.2%} | — |"]
    for row in result["rows"]:
        scale = TRACE_BLOCK_TOKENS // row["block_tokens"]
        b = "**" if row["fraction"] == 0.05 else ""
        out.append(f"| {row['block_tokens']} tokens | {row['fraction']:.0%} "
                   f"({row['capacity_blocks'] * scale:,} blocks) | {row['lru']:.2%} | "
                   f"{b}{row['reuse_aware']:.2%}{b} | {b}{row['ratio']:.2f}×{b} |")
    return "\n".join(out).replace("%", " %") + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.05, 0.2])
    ap.add_argument("--half-life", type=float, default=ReuseParams().half_life)
    ap.add_argument("--depth-cost", type=float, default=ReuseParams().depth_cost)
    ap.add_argument("--history-ratio", type=float, default=ReuseParams().history_ratio)
    ap.add_argument("--block-tokens", type=int, nargs="+", default=[TRACE_BLOCK_TOKENS, 16],
                    help="replay at these block sizes (divisors of 512)")
    ap.add_argument("--requests", type=int, default=0, help="first N requests only (0: all)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--render", type=Path, default=None,
                    help="print the markdown table of this result JSON and exit")
    args = ap.parse_args(argv)
    if args.render is not None:
        result = json.loads(args.render.read_text())
        print(markdown(result), end="")
        return result

    start = time.perf_counter()
    chains = load_chains(args.trace, args.requests)
    total = sum(len(c) for c in chains)
    unique = len({k for c in chains for k in c})
    params = ReuseParams(half_life=args.half_life, depth_cost=args.depth_cost,
                         history_ratio=args.history_ratio)
    result = {
        "trace": os.path.relpath(args.trace, ROOT), "requests": len(chains), "blocks": total,
        "unique_blocks": unique, "infinite": replay_infinite(chains) / total,
        "policies": ["lru", "reuse_aware"], "reuse_params": {
            "half_life": params.half_life, "depth_cost": params.depth_cost,
            "history_ratio": params.history_ratio, "unit_tokens": params.unit_tokens},
        "rows": [],
    }
    print(f"{len(chains)} requests, {total} blocks of 512 tokens, {unique} unique; "
          f"infinite cache: {100 * result['infinite']:.2f}%")
    print(f"{'block':>5} | {'capacity (512-token blocks)':>27} | {'lru':>7} | "
          f"{'reuse_aware':>11} | ratio")
    for block_tokens in args.block_tokens:
        split = split_chains(chains, block_tokens)
        scale = TRACE_BLOCK_TOKENS // block_tokens
        factories = {"lru": LRUPolicy,
                     "reuse_aware": lambda bt=block_tokens: ReuseAwarePolicy(params, bt)}
        for fraction in args.fractions:
            capacity = max(1, int(fraction * unique))
            row = {"block_tokens": block_tokens, "fraction": fraction,
                   "capacity_blocks": capacity}
            for name, make in factories.items():
                row[name] = replay(split, make(), capacity * scale) / (total * scale)
            row["ratio"] = row["reuse_aware"] / row["lru"] if row["lru"] else float("inf")
            result["rows"].append(row)
            print(f"{block_tokens:>5} | {fraction:>18.0%} ({capacity:>6}) | "
                  f"{100 * row['lru']:6.2f}% | {100 * row['reuse_aware']:10.2f}% | "
                  f"{row['ratio']:.3f}x", flush=True)
    result["seconds"] = time.perf_counter() - start
    print(f"{result['seconds']:.1f} s")

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cache_hit_ratio.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "cache_hit_ratio.md").write_text(markdown(result))
    try:
        plot(result, args.out / "cache_hit_ratio.png")
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
