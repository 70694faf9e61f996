"""Time to first token of a lone long prompt: disaggregated against colocated.

    python bench/lone_prompt.py [--prompt-len 2048] [--trials 3] [--threads 2] [--quick]

Two deployments run side by side as real processes (tests/cluster.py), each in a fresh
temporary directory with free ports, so nothing a previous run left (an SSD tier, a
prefix cache) can serve this one:

* **colocated**: one unified worker;
* **disaggregated**: one prefill and one decode worker under the ``least_loaded`` policy
  with ``disagg_threshold`` 0, a routing rule that never prefills on the decode worker,
  and a cache-pool process (fresh SSD directory) as in deploy/configs/local.toml.

Every worker gets ``--threads`` torch threads (nothing else runs, so they do not
compete). Through bench/harness.py the two take turns on the same prompt (colocated,
disaggregated, colocated, ...; one warm-up round, then ``--trials``), a new random
prompt per round from a seed drawn per run. Every disaggregated request is checked:
the prefill worker produced token 0 (its ``prefills_done`` grew by one), the decode
worker did not fall back to a local prefill, and no prompt token was served from a
cache. Token 0 comes from the prefill worker while each layer's KV streams to the decode
worker; token 1 is decode's first step after the last layer lands. Reports TTFT and
time to token 1 of each, and the per-round ratios disaggregated / colocated.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

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

VOCAB = (100, 49152)
# Ratios are first side over the other for times, so colocated goes first: the ratio
# then reads as disaggregated / colocated (> 1: disaggregation is slower).
METRICS = [Metric("ttft_s", "TTFT", "s", higher_is_better=False),
           Metric("token1_s", "token 1", "s", higher_is_better=False)]
MODEL_BLOCK_BYTES = 16 * 46080  # the default model's 16-token block (bench/cache.py)
QUICK = {"prompt_len": 1024, "trials": 3}


class ModeError(RuntimeError):
    """A request did not take the path its deployment names."""


def stream_times(client: Client, prompt: list[int]) -> tuple[float, float, int]:
    """(seconds to token 0, to token 1, cached prompt tokens) of one 2-token request."""
    stamps, cached = [], -1
    t0 = time.perf_counter()
    for chunk in client.stream(prompt_token_ids=prompt, max_tokens=2, temperature=0,
                               ignore_eos=True):
        stamps += [time.perf_counter() - t0] * len(chunk.token_ids)
        if chunk.finished and chunk.usage is not None:
            cached = chunk.usage.cached_tokens
    if len(stamps) != 2:
        raise ModeError(f"expected 2 tokens, got {len(stamps)}")
    return stamps[0], stamps[1], cached


def side(cluster, client: Client, prompt_len: int, disaggregated: bool):
    def run(ctx: RunContext) -> dict:
        rng = random.Random(ctx.seed)
        prompt = [rng.randrange(*VOCAB) for _ in range(prompt_len)]
        if disaggregated:
            before = cluster.worker_stats("prefill-0"), cluster.worker_stats("decode-1")
        ttft, token1, cached = stream_times(client, prompt)
        if cached:
            raise ModeError(f"{cached} prompt tokens came from a cache; the prompt was meant "
                            "to be new")
        if disaggregated:
            after = cluster.worker_stats("prefill-0"), cluster.worker_stats("decode-1")
            prefilled = after[0].prefills_done - before[0].prefills_done
            fell_back = after[1].local_fallbacks - before[1].local_fallbacks
            if prefilled != 1 or fell_back:
                raise ModeError(f"not disaggregated: prefill worker ran {prefilled} prefills, "
                                f"decode fell back {fell_back} times")
        return {"ttft_s": ttft, "token1_s": token1, "handoff_s": token1 - ttft}
    return run


def start_clusters(tmp: Path, args) -> tuple[dict, object]:
    from services.engine.weights import DEFAULT_MODEL
    from tests.cluster import Cluster
    from tests.pool_procs import BLOCK, HDR, PoolProc

    threads = ["--num-threads", str(args.threads)]
    for name in ("colocated", "disaggregated"):
        (tmp / name).mkdir()
    # The pool shares the disaggregated cluster's directory, and so its CURVE keys; its
    # SSD tier lives there too and goes with it.
    pool = PoolProc("pool-0", tmp / "disaggregated", dram_blocks=(512 << 20) // BLOCK,
                    ssd_blocks=(1024 << 20) // (BLOCK + HDR), block_bytes=MODEL_BLOCK_BYTES)
    pool.start(learn_block_bytes=False)
    clusters = {
        "colocated": Cluster(DEFAULT_MODEL, tmp / "colocated", ["unified"],
                             kv_cache_mib=args.kv_cache_mib, worker_args=threads),
        "disaggregated": Cluster(DEFAULT_MODEL, tmp / "disaggregated", ["prefill", "decode"],
                                 policy="least_loaded", disagg_threshold=0,
                                 kv_cache_mib=args.kv_cache_mib,
                                 worker_args=[*threads, "--cache-pools", pool.control]),
    }
    return clusters, pool


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--trials", type=int, default=3, help="measured rounds")
    ap.add_argument("--warmup", type=int, default=1, help="rounds run first and dropped")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per worker")
    ap.add_argument("--kv-cache-mib", type=int, default=512, help="per worker")
    ap.add_argument("--seed", type=int, default=None, help="default: drawn at random")
    ap.add_argument("--quick", action="store_true",
                    help="small profile: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    ap.add_argument("--out", default=str(RESULTS / "lone_prompt.json"))
    args = ap.parse_args()
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    settings = {"prompt_len": args.prompt_len, "threads_per_worker": args.threads,
                "disaggregated": "least_loaded, disagg_threshold=0, cache pool",
                "colocated": "one unified worker", "output": "2 greedy tokens"}
    print(settings_line(settings), flush=True)
    session = Session("lone_prompt", settings, seed=args.seed)
    with tempfile.TemporaryDirectory(prefix="bench-lone-") as tmp:
        clusters, pool = start_clusters(Path(tmp), args)
        clients = {}
        try:
            for c in clusters.values():
                c.start(timeout_s=300)
            clients = {n: Client(c.zmq_addr, timeout_s=300) for n, c in clusters.items()}
            runs = session.run({n: side(clusters[n], clients[n], args.prompt_len,
                                        n == "disaggregated") for n in clusters},
                               repeats=args.trials, warmup=args.warmup)
        except BaseException:
            for c in clusters.values():
                for proc in c.procs.values():
                    print(f"--- {proc.name}\n{proc.tail(10)}", file=sys.stderr)
            raise
        finally:
            for client in clients.values():
                client.close()
            for c in clusters.values():
                c.stop()
            pool.stop()
    report = session.finish(METRICS, runs)
    print_summary(report)
    gap = [r["handoff_s"] for r in runs["disaggregated"]]
    print(f"disaggregated token 1 - token 0: median {sorted(gap)[len(gap) // 2] * 1e3:.0f} ms")
    print(f"wrote {write(report, Path(args.out))}")


if __name__ == "__main__":
    main()
