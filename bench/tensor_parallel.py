"""Decode step time of a tensor-parallel engine against TP=1, on this machine.

    nice -n 10 python bench/tensor_parallel.py [--tp 3] [--batch 32] [--rounds 3] [--steps 3]

The default model (SmolLM2-135M: 9 query heads, 3 KV heads) splits 3 ways, not 2, so
``--tp`` defaults to 3.

Each side runs in a process of its own, started afresh for every run (bench/harness.py:
TP=1, TP=N, TP=1, ... after a warm-up round): it builds its engine (TP=N: rank 0 and its
N-1 follower processes), fills it with ``--batch`` requests, takes one untimed decode
step, times ``--steps`` more, closes the engine and exits. So neither side shares the
machine with the other's processes: an earlier version built both engines once in one
process, and the TP side's idle followers, spinning in their collectives, slowed every
TP=1 step several times over. Both sides of a round decode the same prompts, drawn from
the round's seed. Torch threads: all usable CPUs for TP=1; TP=N's ranks share them
(``services/engine/engine.py`` ``set_threads``), one thread each on two cores. A third
side, TP=1 on one torch thread (``tp1_1thread``; ``--no-single-thread`` leaves it out),
tells how much of a difference comes from splitting the model and how much from running
single-threaded ranks: on a machine whose cores other processes also want, a step of
several threads waits at each operator for its slowest thread.

Reported: the median step time of each side, the per-round ratio, and the share of rank
0's TP=N step spent inside collectives (all-reduce, all-gather: transfer plus waiting
for the other ranks). Writes bench/results/tensor_parallel.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
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
    spread,
    write,
)

# Ratios are the first side over the other for times: TP=1 first, the ratio reads as
# TP=N step time / TP=1 step time (< 1: tensor parallelism is faster).
METRICS = [Metric("step_ms", "decode step", "ms", higher_is_better=False)]
VOCAB = (10, 1010)
SIDE_TIMEOUT_S = 900


class CollectiveClock:
    """Seconds rank 0 spends inside the model's collectives (patched in for the bench)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.seconds = 0.0
        for name in ("all_reduce", "all_gather"):
            setattr(dist, name, self._timed(getattr(dist, name)))

    def _timed(self, fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return call


def fill(engine, batch: int, prompt_len: int, seed: int) -> None:
    from common.sampling_params import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=100000, ignore_eos=True)
    vocab = (VOCAB[0], min(VOCAB[1], engine.model_config.vocab_size))  # tiny test models
    for _ in range(batch):
        engine.add_request(None, [rng.randrange(*vocab) for _ in range(prompt_len)], params)
    while any(s.num_computed_tokens < s.num_prompt_tokens
              for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    if len(engine.scheduler.running) != batch:
        raise RuntimeError(f"expected {batch} running requests, got "
                           f"{len(engine.scheduler.running)}")


def run_side(args) -> dict:
    """One side, in this process: build, fill, time, close. The figures as a dict."""
    import torch

    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine

    if args.side == 1:
        torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    clock = CollectiveClock() if args.side > 1 else None
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.model, dtype="float32",
                                    max_num_seqs=args.batch, kv_cache_bytes=256 << 20,
                                    tensor_parallel_size=args.side))
    try:
        load_s = time.perf_counter() - t0
        fill(engine, args.batch, args.prompt_len, args.seed)
        engine.step()  # the first decode step allocates; not timed
        comm0 = clock.seconds if clock else 0.0
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        comm = (clock.seconds - comm0) if clock else 0.0
    finally:
        engine.close()
    return {"step_ms": 1e3 * statistics.median(times),
            "steps_ms": [round(1e3 * t, 2) for t in times],
            "collective_share": comm / sum(times), "load_s": load_s,
            "threads": torch.get_num_threads()}


def side(tp: int, args, threads: int = 0):
    def run(ctx: RunContext) -> dict:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--side", str(tp),
               "--seed", str(ctx.seed), "--model", args.model, "--batch", str(args.batch),
               "--prompt-len", str(args.prompt_len), "--steps", str(args.steps),
               "--threads", str(threads)]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              timeout=SIDE_TIMEOUT_S, env={**os.environ,
                                                           "PYTHONPATH": str(ROOT)})
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"TP={tp} side exited {proc.returncode}:\n"
                               f"{proc.stderr[-3000:]}")
        return json.loads(lines[-1])
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", default=str(RESULTS / "tensor_parallel.json"))
    ap.add_argument("--no-single-thread", action="store_true",
                    help="leave out the TP=1 side on one torch thread")
    ap.add_argument("--side", type=int, help=argparse.SUPPRESS)  # one side, in this process
    ap.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)  # TP=1 side
    args = ap.parse_args(argv)
    if args.side is not None:
        print(json.dumps(run_side(args)), flush=True)
        return 0
    if args.tp < 2:
        ap.error("--tp must be at least 2")
    settings = {"model": args.model, "dtype": "float32", "batch": args.batch,
                "prompt_len": args.prompt_len, "steps": args.steps, "tp": args.tp,
                "cpus": len(os.sched_getaffinity(0)),
                "sides": "each in a fresh process per run"}
    session = Session("tensor_parallel", settings, seed=args.seed,
                      log=lambda line: print(line, flush=True))
    print(settings_line(settings), flush=True)
    names = ("tp1", f"tp{args.tp}")
    sides = {names[0]: side(1, args), names[1]: side(args.tp, args)}
    if not args.no_single_thread:
        sides["tp1_1thread"] = side(1, args, threads=1)
    runs = session.run(sides, repeats=args.rounds, warmup=args.warmup)
    share = spread([r["collective_share"] for r in runs[names[1]]])
    report = session.finish(METRICS, runs, extra={"tp_collective_share": share})
    print_summary(report)
    print(f"tp{args.tp} rank 0 time inside collectives: median {100 * share['median']:.0f}% "
          f"[{100 * share['min']:.0f}, {100 * share['max']:.0f}]")
    print(f"wrote {write(report, Path(args.out))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
