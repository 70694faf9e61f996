"""Intra-op threads and OpenMP's wait policy, on a quiet host and on a loaded one.

    python bench/threads_load.py [--rounds 2] [--quantization int8] [--timeout 150]
                                 [--variants 1t,1t-passive,2t,2t-passive]
                                 [--conditions quiet,loaded] [--out threads_load.json]

Each run is a fresh engine process (the OpenMP runtime reads its environment once,
when torch loads it, so every variant needs its own process) timing a 256-token
prefill and the median of 6 decode steps with 4 rows. Variants: 1 or 2 threads, with
``OMP_WAIT_POLICY`` unset (libgomp spins a while before sleeping) or ``PASSIVE``
(threads sleep at once), and ``2t-spin10k`` (``GOMP_SPINCOUNT=10000``: a short
spin). Conditions: ``quiet`` and ``loaded`` (two busy-loop processes, one per core,
started by this script at its own niceness and stopped after the run).
Variants and conditions alternate within each round so that other load on the host
hits them alike. A run past ``--timeout`` is reported as such, not dropped.
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
PREFILL_LEN, DECODE_ROWS, DECODE_STEPS = 256, 4, 6
# name: (threads, OMP_WAIT_POLICY, GOMP_SPINCOUNT); None leaves the variable unset
VARIANTS = {"1t": (1, None, None), "1t-passive": (1, "PASSIVE", None),
            "2t": (2, None, None), "2t-passive": (2, "PASSIVE", None),
            "2t-spin10k": (2, None, "10000")}


def child(threads: int, quantization: str) -> dict:
    sys.path.insert(0, str(ROOT))
    from common.sampling_params import SamplingParams
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="smollm2-135m-instruct", num_threads=threads,
                                    quantization=quantization, kv_cache_bytes=128 << 20,
                                    max_num_seqs=DECODE_ROWS))
    rng = random.Random(0)

    def draw(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    def add(prompt: list[int], max_tokens: int) -> None:
        engine.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                        ignore_eos=True))
    add(draw(8), 2)  # warm-up: a small prefill and a decode step
    while engine.has_unfinished_requests():
        engine.step()
    add(draw(PREFILL_LEN), 1)
    t0 = time.perf_counter()
    engine.step()
    prefill = time.perf_counter() - t0
    for _ in range(DECODE_ROWS):
        add(draw(16), DECODE_STEPS + 3)
    engine.step()  # the 4 prompts' prefill
    steps = []
    for _ in range(DECODE_STEPS):
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    return {"prefill_s": prefill, "decode_step_ms": statistics.median(steps) * 1e3}


def run_variant(name: str, args: argparse.Namespace) -> dict:
    threads, policy, spin = VARIANTS[name]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for var, value in (("OMP_WAIT_POLICY", policy), ("GOMP_SPINCOUNT", spin)):
        env.pop(var, None)
        if value:
            env[var] = value
    cmd = [sys.executable, __file__, "--child", str(threads), "--quantization", args.quantization]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True,
                             timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"timeout_s": args.timeout}
    return json.loads(out.stdout.strip().splitlines()[-1])


def busy_loops(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quantization", default="int8")
    ap.add_argument("--timeout", type=float, default=150.0)
    ap.add_argument("--variants", default="1t,1t-passive,2t,2t-passive")
    ap.add_argument("--conditions", default="quiet,loaded")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.quantization)))
        return
    names = args.variants.split(",")
    runs: list[dict] = []
    for rnd in range(args.rounds):
        conds = args.conditions.split(",")
        for cond in (conds if rnd % 2 == 0 else conds[::-1]):
            order = names if rnd % 2 == 0 else names[::-1]
            for name in order:
                loops = busy_loops(os.cpu_count() or 1) if cond == "loaded" else []
                try:
                    time.sleep(0.5 if loops else 0)
                    res = run_variant(name, args)
                finally:
                    for p in loops:
                        p.kill()
                        p.wait()
                row = {"round": rnd, "condition": cond, "variant": name,
                       "loadavg_1m": os.getloadavg()[0], **res}
                runs.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"quantization": args.quantization,
                                              "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
