"""Fit a cost profile to the real engine on this machine: prefill and decode step times.

    python bench/calibrate.py [--model smollm2-135m-instruct] [--threads 1]
                              [--out deploy/profiles/smollm2-cpu.json]

Runs the engine in this process (``--threads`` torch threads; pin it with ``taskset``
for a pinned worker) and times single engine steps:

* prefill: one prompt of ``n`` new tokens per step, after ``c`` tokens of cached prefix
  (a prompt that extends one run just before), for a spread of ``n`` and ``c``;
* decode: ``B`` sequences of ``L`` tokens each decoding together, for a spread of both.

Each point is the median of ``--repeats`` steps. The profile's terms
(``common/cost_profile.py``) are fitted by least squares on relative error, each row
divided by its measured time (so short steps count as much as long ones), with every
coefficient kept > 0. The JSON keeps the measurements and each point's fitted error.
KV bytes per token come from the model's shape; ``--link-bandwidth`` and
``--pool-bandwidth`` (bytes/s) are taken as given. The pool default is what
``bench/pool_bandwidth.py`` measured on this machine (a local cache-pool instance's DRAM
tier serving 720 KiB blocks: 0.74-1.0 GB/s for prefixes of 4-256 blocks), rounded down.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.cost_profile import (  # noqa: E402
    CostProfile,
    cost,
    decode_terms,
    prefill_terms,
    save_profile,
)
from common.sampling_params import SamplingParams  # noqa: E402
from services.engine.config import EngineConfig  # noqa: E402
from services.engine.engine import LLMEngine  # noqa: E402

PREFILL_POINTS = [(16, 0), (64, 0), (128, 0), (256, 0), (512, 0), (1024, 0), (1536, 0),
                  (64, 512), (256, 512), (64, 1024), (512, 1024)]
DECODE_POINTS = [(1, 64), (1, 1024), (4, 64), (4, 512), (16, 128), (16, 512), (32, 256),
                 (64, 64), (64, 256)]
FLOOR = 1e-12


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def time_prefill(engine: LLMEngine, n: int, c: int, repeats: int, rng) -> float:
    """Median seconds of the step that prefills ``n`` tokens after ``c`` cached ones."""
    vocab, times = engine.vocab_size, []
    greedy = SamplingParams(max_tokens=1, temperature=0)
    for _ in range(repeats):
        prefix = _prompt(rng, c, vocab)
        if c:  # put the prefix in the cache; its blocks stay cached when it finishes
            engine.add_request(None, prefix + [5], greedy)
            while engine.has_unfinished_requests():
                engine.step()
        engine.add_request(None, prefix + _prompt(rng, n, vocab), greedy)
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        step = engine.last_step
        if step is None or len(step.prefill) != 1 or step.decode_batch:
            raise RuntimeError(f"expected one prefill chunk, the step did {step}")
        got_n, got_c = step.prefill[0]
        if got_n < n or abs(got_c - c) > engine.block_manager.block_size:
            raise RuntimeError(f"prefill of ({n}, {c}) ran as ({got_n}, {got_c})")
        times.append(elapsed)
        while engine.has_unfinished_requests():
            engine.step()
    return statistics.median(times)


def time_decode(engine: LLMEngine, batch: int, length: int, repeats: int, rng) -> tuple[int, float]:
    """(context tokens, median seconds) of a decode step of ``batch`` sequences."""
    params = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)
    ids = [engine.add_request(None, _prompt(rng, length, engine.vocab_size), params)
           for _ in range(batch)]
    while any(not engine.requests[i].output_token_ids for i in ids):
        engine.step()  # prefill them all
    times, contexts = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        step = engine.last_step
        if step is None or step.prefill or step.decode_batch != batch:
            raise RuntimeError(f"expected a decode step of {batch}, the step did {step}")
        contexts.append(step.decode_context)
    for i in ids:
        engine.abort(i)
    return int(statistics.median(contexts)), statistics.median(times)


def fit(rows: list[tuple[float, ...]], ys: list[float]) -> list[float]:
    """Least squares on relative error, coefficients floored at FLOOR (then refitted
    without the floored terms, so the others absorb them)."""
    a = np.array(rows, dtype=float) / np.array(ys)[:, None]
    b = np.ones(len(ys))
    active = list(range(a.shape[1]))
    while True:
        coef = np.zeros(a.shape[1])
        coef[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
        negative = [j for j in active if coef[j] <= 0]
        if not negative:
            return [max(float(x), FLOOR) for x in coef]
        active = [j for j in active if j not in negative]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--link-bandwidth", type=float, default=1e9)
    ap.add_argument("--pool-bandwidth", type=float, default=1.9e9)
    ap.add_argument("--name", default="smollm2-cpu")
    ap.add_argument("--out", default=str(ROOT / "deploy" / "profiles" / "smollm2-cpu.json"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.model, num_threads=args.threads,
                                    kv_cache_bytes=1 << 30, max_num_seqs=128))
    rng = random.Random(0)
    time_prefill(engine, 64, 0, 1, rng)  # warm up
    prefill = []
    for n, c in PREFILL_POINTS:
        s = time_prefill(engine, n, c, args.repeats, rng)
        prefill.append((n, c, s))
        print(f"prefill n={n:>5} c={c:>5}: {s * 1e3:8.1f} ms", flush=True)
    decode = []
    for batch, length in DECODE_POINTS:
        k, s = time_decode(engine, batch, length, args.repeats + 2, rng)
        decode.append((batch, k, s))
        print(f"decode  B={batch:>3} K={k:>6}: {s * 1e3:8.1f} ms", flush=True)
    p = fit([prefill_terms(n, c) for n, c, _ in prefill], [s for *_, s in prefill])
    d = fit([decode_terms(b, k) for b, k, _ in decode], [s for *_, s in decode])
    kv_bytes = engine.kv_store.block_nbytes // engine.block_manager.block_size
    profile = CostProfile(
        name=args.name, prefill_fixed_s=p[0], prefill_per_token_s=p[1],
        prefill_per_pair_s=p[2], decode_fixed_s=d[0], decode_per_seq_s=d[1],
        decode_per_ctx_token_s=d[2], kv_bytes_per_token=kv_bytes,
        block_size=engine.block_manager.block_size, link_bandwidth=args.link_bandwidth,
        pool_bandwidth=args.pool_bandwidth,
        notes=(f"bench/calibrate.py: {args.model}, {args.threads} torch thread(s), "
               f"{engine.config.dtype}; medians of {args.repeats}+ steps; link and pool "
               "bandwidth as given (pool: bench/pool_bandwidth.py)"),
        fit={"prefill": [[n, c, s, profile_err(s, p, prefill_terms(n, c))]
                         for n, c, s in prefill],
             "decode": [[b, k, s, profile_err(s, d, decode_terms(b, k))]
                        for b, k, s in decode],
             "columns": "prefill [n, c, seconds, fit error]; decode [B, K, seconds, error]"})
    save_profile(profile, args.out)
    print(f"prefill(n, c) = {p[0] * 1e3:.2f} ms + {p[1] * 1e6:.1f} us*n + "
          f"{p[2] * 1e9:.2f} ns*n(n/2+c)")
    print(f"decode(B, K)  = {d[0] * 1e3:.2f} ms + {d[1] * 1e3:.3f} ms*B + "
          f"{d[2] * 1e6:.3f} us*K")
    worst = max(abs(r[3]) for r in profile.fit["prefill"] + profile.fit["decode"])
    print(f"worst fit error {worst:.1%}; wrote {args.out} in {time.perf_counter() - t0:.0f}s")


def profile_err(measured: float, coef: list[float], x: tuple[float, ...]) -> float:
    return round(cost(coef, x) / measured - 1, 4)


if __name__ == "__main__":
    main()
