"""Cache-pool fetch throughput, the ``pool_bandwidth`` of a cost profile:
python bench/pool_bandwidth.py [--block-bytes 737280] [--runs 1,4,16,64,256]

Starts one cache-pool instance (DRAM tier only) as its own process on loopback, puts a
chain of blocks of the default model's layout (16 tokens x 46,080 bytes = 720 KiB) and
times ``PoolClient.get`` of the chain's first ``run`` blocks, as a worker fetches a pooled
prefix. Figures are medians over repetitions after a warm-up; the suggested
``pool_bandwidth`` is the lowest median over runs of 4 blocks or more (what a prefix
worth fetching costs). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import zmq.asyncio  # noqa: E402

from common.pool.client import PoolClient  # noqa: E402
from common.pool.discovery import discover_pools  # noqa: E402


def _addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


async def measure(block_bytes: int, runs: list[int], seconds: float) -> dict:
    control, events = _addr(), _addr()
    blocks = max(runs)
    dram_mib = (blocks + 8) * block_bytes / (1 << 20)
    pool = subprocess.Popen(
        [sys.executable, "-m", "services.cache_pool", "--control-addr", control,
         "--events-addr", events, "--dram-mib", repr(dram_mib),
         "--block-bytes", str(block_bytes), "--log-format", "console"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ctx = zmq.asyncio.Context()
    try:
        deadline = time.monotonic() + 30
        while not await discover_pools(ctx, [control], timeout_s=0.5):
            if pool.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the cache pool did not start")
        client = PoolClient(ctx, {"pool-0": control}, timeout_s=30.0)
        rng = random.Random(0)
        chain = [(rng.getrandbits(64), rng.randbytes(block_bytes), d) for d in range(blocks)]
        keys = [k for k, _, _ in chain]
        await client.put(chain)
        await client.get(keys)  # warm-up
        out = {}
        for run in runs:
            times, spent = [], 0.0
            while spent < seconds or len(times) < 5:
                t = time.perf_counter()
                got = await client.get(keys[:run])
                times.append(time.perf_counter() - t)
                spent += times[-1]
                if len(got) != run:
                    raise RuntimeError(f"got {len(got)} of {run} blocks")
            s = statistics.median(times)
            out[run] = {"seconds": s, "bytes_per_s": run * block_bytes / s}
            mbs = run * block_bytes / s / 1e6
            print(f"get {run:>4} blocks: {s * 1e3:8.2f} ms  {mbs:7.0f} MB/s",
                  file=sys.stderr, flush=True)
        await client.close()
        return out
    finally:
        ctx.destroy(linger=0)
        pool.terminate()
        pool.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block-bytes", type=int, default=16 * 46080)
    ap.add_argument("--runs", default="1,4,16,64,256")
    ap.add_argument("--seconds", type=float, default=1.0, help="per run length")
    args = ap.parse_args()
    runs = sorted({int(r) for r in args.runs.split(",")})
    result = asyncio.run(measure(args.block_bytes, runs, args.seconds))
    suggested = min((v["bytes_per_s"] for r, v in result.items() if r >= 4),
                    default=min(v["bytes_per_s"] for v in result.values()))
    print(json.dumps({"block_bytes": args.block_bytes, "runs": result,
                      "suggested_pool_bandwidth": suggested}, indent=2))


if __name__ == "__main__":
    main()
