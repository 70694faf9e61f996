"""Decode step time of a tensor-parallel engine against TP=1, on this machine.

The default model (SmolLM2-135M: 9 query heads, 3 KV heads) splits 3 ways, not 2, so
``--tp`` defaults to 3.

Both engines are built once and filled with the same ``--batch`` requests; then rounds
alternate between them (``--steps`` decode steps each), so that load from neighbours
hits both alike. Reported: median step time of each, the TP=2 / TP=1 ratio per round
(median and spread), and the share of rank 0's TP=2 step spent inside collectives
(all-reduce, all-gather: transfer plus waiting for the other rank).

    nice -n 10 python -m bench.tensor_parallel --rounds 5 --steps 5

``--transfer``: a ``--prompt-len`` prefill (2,048 with ``--prompt-len 2048``) whose KV
streams layer by layer into a TP=1 engine's reserved blocks, as a prefill worker's hook
does (export, then import: the data plane between them is left out), from a TP=``--tp``
engine against from a TP=1 engine. Reported per source: bytes moved, seconds in export
plus import (the TP engine's gathers included), and the whole prefill.

    nice -n 10 python -m bench.tensor_parallel --transfer --prompt-len 2048 --rounds 3
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


def transfer_round(src: LLMEngine, dst: LLMEngine, prompt: list[int],
                   moved: dict) -> tuple[int, float, float]:
    """One prefill in ``src`` streamed into ``dst``: (bytes, export+import s, total s)."""
    slots = dst.reserve_remote_prefill("d", prompt, SamplingParams(max_tokens=1))
    moved.update(bytes=0, seconds=0.0, blocks=slots.block_ids)
    start = time.perf_counter()
    rid = src.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=1),
                          hold_blocks=True)
    while src.has_unfinished_requests():
        src.step()
    total = time.perf_counter() - start
    src.release(rid)
    dst.abort("d")
    return moved["bytes"], moved["seconds"], total


def transfer(args, base: dict) -> None:
    from services.engine.core import EngineHooks

    moved: dict = {}
    dst = LLMEngine(EngineConfig(**base))

    def hook_for(get_src):
        def on_layer(layer, seqs):
            start = time.perf_counter()
            src = get_src()
            payload = src.kv_store.export_layer_bytes(
                layer, seqs[0].block_table[:len(moved["blocks"])])
            dst.kv_store.import_layer_bytes(layer, moved["blocks"], payload)
            moved["seconds"] += time.perf_counter() - start
            moved["bytes"] += payload.nbytes
        return on_layer

    one = LLMEngine(EngineConfig(**base), hooks=EngineHooks(on_layer=hook_for(lambda: one)))
    tp = LLMEngine(EngineConfig(**base, tensor_parallel_size=args.tp),
                   hooks=EngineHooks(on_layer=hook_for(lambda: tp)))
    try:
        results: dict[str, list] = {"tp1": [], f"tp{args.tp}": []}
        for r in range(args.rounds):
            prompt = [(13 * r + 7 * j) % 1000 + 10 for j in range(args.prompt_len)]
            for name, src in (("tp1", one), (f"tp{args.tp}", tp)):
                results[name].append(transfer_round(src, dst, prompt, moved))
        for name, rows in results.items():
            print(f"{name} -> tp1: {rows[0][0]} bytes, export+import "
                  f"{1e3 * statistics.median(r[1] for r in rows):.1f} ms, prefill total "
                  f"{1e3 * statistics.median(r[2] for r in rows):.1f} ms")
        a, b = (statistics.median(r[1] for r in rows) for rows in results.values())
        print(f"tp{args.tp}->tp1 / tp1->tp1 transfer time: {b / a:.2f}x")
    finally:
        tp.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--transfer", action="store_true",
                    help="KV streamed from a TP engine into a TP=1 one, against TP=1")
    args = ap.parse_args()
    base = dict(model=args.model, dtype="float32", max_num_seqs=args.batch,
                kv_cache_bytes=256 << 20)
    if args.transfer:
        transfer(args, {**base, "max_num_batched_tokens": max(2048, args.prompt_len)})
        return
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
