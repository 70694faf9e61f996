"""Decode step time of a tensor-parallel engine against TP=1, on this machine.

The default model (SmolLM2-135M: 9 query heads, 3 KV heads) splits 3 ways, not 2, so
``--tp`` defaults to 3.

Both engines are built once and filled with the same ``--batch`` requests; then rounds
alternate between them (``--steps`` decode steps each), so that load from neighbours
hits both alike. Reported: median step time of each, the TP=2 / TP=1 ratio per round
(median and spread), and the share of rank 0's TP=2 step spent inside collectives
(all-reduce, all-gather: transfer plus waiting for the other rank).

    nice -n 10 python -m bench.tensor_parallel --rounds 5 --steps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from common.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine


class CollectiveClock:
    """Seconds rank 0 spends inside the model's collectives (patched in for the bench)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._orig = {}
        for name in ("all_reduce", "all_gather"):
            self._orig[name] = fn = getattr(dist, name)
            setattr(dist, name, self._timed(fn))

    def _timed(self, fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return call


def fill(engine: LLMEngine, batch: int, prompt_len: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=100000, ignore_eos=True)
    for i in range(batch):
        engine.add_request(None, [(7 * i + j) % 1000 + 10 for j in range(prompt_len)], params)
    while any(s.num_computed_tokens < s.num_prompt_tokens
              for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()


def decode_steps(engine: LLMEngine, steps: int, threads: int) -> list[float]:
    # Torch's thread count is per process: rank 0 of TP=2 shares the CPUs with its
    # follower, TP=1 has them all.
    torch.set_num_threads(threads)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--tp", type=int, default=3)
    args = ap.parse_args()
    base = dict(model=args.model, dtype="float32", max_num_seqs=args.batch,
                kv_cache_bytes=256 << 20)
    one = LLMEngine(EngineConfig(**base))
    two = LLMEngine(EngineConfig(**base, tensor_parallel_size=args.tp))
    try:
        fill(one, args.batch, args.prompt_len)
        fill(two, args.batch, args.prompt_len)
        cpus = len(os.sched_getaffinity(0))
        clock = CollectiveClock()
        t1: list[float] = []
        t2: list[float] = []
        ratios = []
        for _ in range(args.rounds):
            a = decode_steps(one, args.steps, cpus)
            before = clock.seconds
            b = decode_steps(two, args.steps, max(1, cpus // args.tp))
            comm = clock.seconds - before
            t1 += a
            t2 += b
            ratios.append(statistics.median(b) / statistics.median(a))
            print(f"round: tp1 {1e3 * statistics.median(a):.1f} ms  "
                  f"tp{args.tp} {1e3 * statistics.median(b):.1f} ms  "
                  f"tp{args.tp} in collectives {100 * comm / sum(b):.0f}%", flush=True)
        total_comm = clock.seconds
        print(f"batch {args.batch}, {args.rounds} rounds x {args.steps} steps")
        print(f"decode step  tp1 {1e3 * statistics.median(t1):.1f} ms  "
              f"tp{args.tp} {1e3 * statistics.median(t2):.1f} ms")
        print(f"tp{args.tp}/tp1 ratio median {statistics.median(ratios):.2f} "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f})")
        print(f"tp{args.tp} rank 0 time inside collectives: {100 * total_comm / sum(t2):.0f}%")
    finally:
        two.close()


if __name__ == "__main__":
    main()
