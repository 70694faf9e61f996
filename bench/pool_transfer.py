"""Cache-pool put/get throughput, block bytes as ZeroMQ frames against the data plane:
python bench/pool_transfer.py [--blocks 115] [--block-bytes 737280] [--reps 7]

Starts one cache-pool instance (DRAM tier only, every transfer backend on offer) as its
own process on loopback and, from this process, times ``PoolClient.put`` of ``blocks``
new blocks and ``PoolClient.get`` of a held chain of ``blocks`` blocks, one call each
(``max_call_blocks`` = ``blocks``), with one client per transport: ``zmq`` (bulk frames,
the path before the data plane) and ``data_plane`` negotiated (``auto``: shm on one host)
or forced to ``tcp`` / ``ucx``. Defaults: the default model's block (16 tokens x 46,080
bytes = 720 KiB) and 115 blocks a call (a 1,840-token prefix, 82.8 MB). Repetitions
alternate the clients, after one warm-up each; figures are medians. Prints a table with
each client's ratio to ``zmq`` and writes bench/results/pool_transfer.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import structlog

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import zmq.asyncio  # noqa: E402

from common.pool.client import PoolClient  # noqa: E402
from common.pool.discovery import discover_pools  # noqa: E402
from common.transfer.negotiate import available_backends  # noqa: E402

CLIENTS = {"zmq": {"transport": "zmq"}, "auto": {}, "tcp": {"transfer_backend": "tcp"},
           "ucx": {"transfer_backend": "ucx"}}


def _addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


async def measure(names: list[str], blocks: int, block_bytes: int, reps: int) -> dict:
    control, events = _addr(), _addr()
    call_bytes = blocks * block_bytes
    dram_mib = (2 + len(names)) * call_bytes / (1 << 20)  # chains + one put's worth each
    pool = subprocess.Popen(
        [sys.executable, "-m", "services.cache_pool", "--control-addr", control,
         "--events-addr", events, "--dram-mib", repr(dram_mib),
         "--block-bytes", str(block_bytes), "--max-request-bytes", str(call_bytes),
         "--log-format", "console"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ctx = zmq.asyncio.Context()
    clients: dict[str, PoolClient] = {}
    try:
        deadline = time.monotonic() + 30
        while not await discover_pools(ctx, [control], timeout_s=0.5):
            if pool.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the cache pool did not start")
        clients = {n: PoolClient(ctx, {"pool-0": control}, timeout_s=60.0,
                                 max_call_blocks=blocks, **CLIENTS[n]) for n in names}
        rng = random.Random(0)
        payload = [rng.randbytes(block_bytes) for _ in range(blocks)]
        chain = [(rng.getrandbits(64), payload[d], d) for d in range(blocks)]
        keys = [k for k, _, _ in chain]
        if await clients[names[0]].put(chain) != blocks:
            raise RuntimeError("the chain was not stored")

        async def put_once(client: PoolClient) -> float:
            fresh = [(rng.getrandbits(64), payload[d], d) for d in range(blocks)]
            t = time.perf_counter()
            stored = await client.put(fresh)
            elapsed = time.perf_counter() - t
            if stored != blocks:
                raise RuntimeError(f"stored {stored} of {blocks} blocks")
            return elapsed

        async def get_once(client: PoolClient) -> float:
            t = time.perf_counter()
            got = await client.get(keys)
            elapsed = time.perf_counter() - t
            if got != payload:
                raise RuntimeError(f"got {len(got)} of {blocks} blocks, or wrong bytes")
            return elapsed

        times = {n: {"put": [], "get": []} for n in names}
        for rep in range(reps + 1):  # rep 0 is the warm-up
            for n in names:
                put_s, get_s = await put_once(clients[n]), await get_once(clients[n])
                if rep:
                    times[n]["put"].append(put_s)
                    times[n]["get"].append(get_s)
            print(f"rep {rep}/{reps}", file=sys.stderr, flush=True)
        out = {}
        for n in names:
            out[n] = {op: {"median_s": statistics.median(ts),
                           "gb_per_s": call_bytes / statistics.median(ts) / 1e9,
                           "min_s": min(ts), "max_s": max(ts)}
                      for op, ts in times[n].items()}
            out[n]["client_counts"] = dict(clients[n].counts)
        out["pool_transfers"] = next(iter(
            (await discover_pools(ctx, [control])).values())).transfers
        return out
    finally:
        for client in clients.values():
            await client.close()
        ctx.destroy(linger=0)
        pool.terminate()
        pool.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=115)
    ap.add_argument("--block-bytes", type=int, default=16 * 46080)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--clients", default="zmq,auto,tcp,ucx",
                    help="of zmq, auto, tcp, ucx; ucx is left out where ucxx is missing")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "pool_transfer.json"))
    args = ap.parse_args()
    names = [n for n in args.clients.split(",")
             if n != "ucx" or "ucx" in available_backends()]
    if names[0] != "zmq" and "zmq" in names:
        names.remove("zmq")
        names.insert(0, "zmq")
    logging.disable(logging.WARNING)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    result = asyncio.run(measure(names, args.blocks, args.block_bytes, args.reps))
    base = result.get("zmq")
    print(f"{args.blocks} blocks x {args.block_bytes} B = "
          f"{args.blocks * args.block_bytes / 1e6:.1f} MB a call, {args.reps} reps, "
          f"{os.cpu_count()} CPUs")
    print(f"{'client':<6} {'put GB/s':>9} {'x zmq':>6} {'get GB/s':>9} {'x zmq':>6}")
    for n in names:
        r = result[n]
        ratio = {op: r[op]["gb_per_s"] / base[op]["gb_per_s"] if base else float("nan")
                 for op in ("put", "get")}
        r["ratio_to_zmq"] = ratio
        print(f"{n:<6} {r['put']['gb_per_s']:>9.2f} {ratio['put']:>6.2f} "
              f"{r['get']['gb_per_s']:>9.2f} {ratio['get']:>6.2f}")
    Path(args.out).write_text(json.dumps({
        "blocks": args.blocks, "block_bytes": args.block_bytes, "reps": args.reps,
        "cpus": os.cpu_count(), "clients": result}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
