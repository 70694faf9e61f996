"""What serving costs on this host beyond the engine's own steps, written into a cost
profile: the contention factor of several busy workers, and the serving path's overhead
per streamed token. ``bench/calibrate.py`` times one engine alone; a deployment runs
two or more worker processes on the same cores, plus the gateway, the conductor and the
clients.

    python bench/calibrate_host.py [--workers 3] [--profile deploy/profiles/smollm2-cpu.json]

* contention: this process times decode steps (batches 1, 4 and 16) and prefills (128
  and 512 tokens) alone, and right after each again while ``k - 1`` other processes,
  each its own engine with the same torch threads, run decode steps of 4 sequences
  without pause; ``contention[k-1]`` is ``contention[0]`` times the median ratio busy
  to alone (k = 2 .. ``--workers``), and ``contention[0]`` the median ratio of the
  engine alone to the profile's fitted steps (the host now against the one the steps
  were fitted on; at least 1). The simulator counts a deployment's busy workers and its
  serving processes (gateway, conductor, clients) as the share of a core their token
  streaming takes (tokens a second x ``token_overhead_s``), linear between the factors:
  a pair of workers needs ``--workers 3``.
  The same factors per kind of step (decode points, prefill points) go into
  ``fit.host`` as ``decode_contention`` and ``prefill_contention``: the simulator
  slows each kind by its own (services/sim/profiles.py), the conductor by the median.
* token overhead: one unified worker behind the real gateway and conductor
  (tests/cluster.py), streams of ``--output-len`` tokens, 1 and then 4 at once; the
  overhead per sequence per step is the least-squares fit (on relative error) of the
  client's time per output token minus the worker's own decode step time meanwhile
  (its heartbeats' ``step_time_ms``, read from the conductor), so that the load of the
  moment is on both sides.

The profile's step coefficients are left as they are; ``contention``,
``token_overhead_s`` and the measurements (under ``fit.host``) are replaced. The load
average before and after is recorded: a busy machine makes every factor larger.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.calibrate import time_decode, time_prefill  # noqa: E402
from common.cost_profile import load_profile, profile_from_dict, save_profile  # noqa: E402
from services.sim.profiles import Profile as SimProfile  # noqa: E402

DECODE = [(1, 128), (4, 128), (16, 128)]
PREFILL = [(128, 0), (512, 0)]
LOADER_BATCH = 4


def make_engine(model: str, threads: int):
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine
    return LLMEngine(EngineConfig(model=model, num_threads=threads, kv_cache_bytes=1 << 28,
                                  max_num_seqs=64))


def loader(model: str, threads: int, ready, run, stop) -> None:
    """A worker that is busy while ``run`` is set: decode steps of ``LOADER_BATCH``
    sequences without pause; idle (waiting on the event) otherwise."""
    from common.sampling_params import SamplingParams
    engine = make_engine(model, threads)
    rng = random.Random(os.getpid())
    params = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
    for _ in range(LOADER_BATCH):
        engine.add_request(None, [rng.randrange(100, engine.vocab_size) for _ in range(64)],
                           params)
    engine.step()
    ready.set()
    while not stop.is_set():
        if run.wait(0.05):
            engine.step()


def point_times(engine, point: tuple[int, int], decode: bool, repeats: int, rng) -> float:
    if decode:
        return time_decode(engine, *point, repeats, rng)[1]
    return time_prefill(engine, *point, max(1, repeats // 2), rng)


def alone_ratio(cp, point: tuple[int, int], decode: bool, seconds: float) -> float:
    """``seconds`` of one engine alone against what the simulator takes the step to
    cost: a decode step (B, L tokens each) at the calibration's measured point where it
    has one (the fit shaped by ``decode_shape``), a prefill (n, c) at the fit, so that
    ``contention[0]`` is the host alone and not also the fit's error at that batch."""
    if decode:
        batch, length = point
        return seconds / SimProfile.from_cost_profile(cp, kv_blocks=1).decode_step_s(
            batch, batch * length)
    return seconds / cp.prefill_s(*point)


def contention(model: str, threads: int, workers: int, repeats: int,
               cp) -> tuple[list, dict]:
    """Factors for 1 .. ``workers`` busy workers. The loaders stay started; each point
    is timed alone (loaders idle) and then busy (``k - 1`` of them stepping), back to
    back, so that other load on the machine drifting meanwhile cancels in the ratio."""
    engine = make_engine(model, threads)
    rng = random.Random(0)
    time_prefill(engine, 64, 0, 1, rng)  # warm up
    ctx = mp.get_context("spawn")
    stop, runs = ctx.Event(), [ctx.Event() for _ in range(workers - 1)]
    readies = [ctx.Event() for _ in runs]
    procs = [ctx.Process(target=loader, args=(model, threads, ready, run, stop), daemon=True)
             for ready, run in zip(readies, runs, strict=True)]
    for p in procs:
        p.start()
    factors, rows = [], []
    try:
        for ready in readies:
            if not ready.wait(300):
                raise RuntimeError("a loader process did not start within 300 s")
        points = [(p, True) for p in DECODE] + [(p, False) for p in PREFILL]
        # One busy worker: this engine alone against the profile's fitted steps.
        alone = [(point_times(engine, pt, dec, repeats, rng), pt, dec) for pt, dec in points]
        ratios = [alone_ratio(cp, pt, dec, t) for t, pt, dec in alone]
        factors.append(statistics.median(ratios))
        kinds = {kind: [m] for kind, m in kind_medians(ratios, points).items()}
        rows += [[1, *pt, t, t] for t, pt, _ in alone]
        print(f"1 worker alone: {factors[0]:.2f} x the profile "
              f"({', '.join(f'{x:.2f}' for x in ratios)})", flush=True)
        for k in range(2, workers + 1):
            ratios = []
            for point, decode in points:
                for r in runs:
                    r.clear()
                time.sleep(0.2)  # a loader's step in flight ends
                alone = point_times(engine, point, decode, repeats, rng)
                for r in runs[:k - 1]:
                    r.set()
                time.sleep(0.2)
                busy = point_times(engine, point, decode, repeats, rng)
                ratios.append(busy / alone)
                rows.append([k, *point, alone, busy])
            ratio = statistics.median(ratios)
            factors.append(ratio)
            for kind, m in kind_medians(ratios, points).items():
                kinds[kind].append(m)
            print(f"{k} busy workers: {ratio:.2f} x alone "
                  f"({', '.join(f'{x:.2f}' for x in ratios)})", flush=True)
    finally:
        stop.set()
        for p in procs:
            p.join(30)
    # Each kind of step on its own too: a decode step reads memory, a prefill computes,
    # and a busy neighbour slows the two unequally (the simulator runs each by its own).
    return factors, {"contention": rows, "alone_vs_profile": factors[0],
                     "busy_vs_alone": factors[1:],
                     **{f"{kind}_contention": [round(f, 3) for f in chained(rel)]
                        for kind, rel in kinds.items()}}


def kind_medians(ratios: list[float], points: list[tuple]) -> dict[str, float]:
    """The median ratio of the decode points and of the prefill points (``points``:
    (point, is-decode) pairs, one a ratio)."""
    return {kind: statistics.median(r for r, (_, d) in zip(ratios, points, strict=True)
                                    if d == (kind == "decode"))
            for kind in ("decode", "prefill")}


def chained(relative: list[float]) -> list[float]:
    """Factors for 1 .. k busy processes from the engine alone against the profile
    (``relative[0]``, at least 1) and k engines' busy/alone ratios: never falling."""
    factors = [max(1.0, relative[0])]
    for r in relative[1:]:
        factors.append(max(factors[-1], factors[0] * r))
    return factors


def token_overhead(model: str, output_len: int, cp) -> tuple[float, list]:
    """Seconds per sequence per decode step the serving path adds (>= 0): the client's
    time per output token against the step time the worker itself reports meanwhile."""
    from bench import serve
    from services.engine.tokenizer_export import tokenizer_dir_for
    from tests.cluster import Cluster
    rows = []
    with tempfile.TemporaryDirectory(prefix="calibrate-host-") as tmp:
        cluster = Cluster(model, Path(tmp), ["unified"], policy="least_loaded",
                          kv_cache_mib=256, gateway_args=[
                              "--tokenizer-dir", tokenizer_dir_for(model),
                              "--max-model-len", "4096"]).start(timeout_s=300)
        try:
            for batch in (1, 4):
                specs = serve.build_requests(serve.parse_args([
                    "--base-url", "http://127.0.0.1:1", "--model", model, "--dataset",
                    "random", "--num-prompts", str(batch), "--input-len", "64",
                    "--output-len", str(output_len), "--range-ratio", "0",
                    "--request-rate", "inf", "--seed", str(batch), "--no-progress"]))
                steps, done = [], threading.Event()

                def poll(steps=steps, done=done, batch=batch) -> None:
                    while not done.wait(0.25):  # the worker's last step, per heartbeat
                        w = cluster.conductor_workers().get("unified-0")
                        if w is not None and w.running == batch and w.step_time_ms > 0:
                            steps.append(w.step_time_ms / 1e3)
                poller = threading.Thread(target=poll, daemon=True)
                poller.start()
                try:
                    results = asyncio.run(serve.run_benchmark(
                        cluster.base_url, specs, model=model, endpoint="completions",
                        progress=False))
                finally:
                    done.set()
                    poller.join()
                tpots = [r.tpot_s for r in results if getattr(r, "tpot_s", None)]
                if len(tpots) != batch or not steps:
                    raise RuntimeError(f"batch {batch}: {len(tpots)} streams finished, "
                                       f"{len(steps)} step times seen")
                rows.append([batch, statistics.median(tpots), statistics.median(steps),
                             cp.decode_step_s(batch, batch * (64 + output_len // 2))])
        finally:
            cluster.stop()
    return overhead_fit([(b, t, s) for b, t, s, _ in rows]), rows


def overhead_fit(rows: list[tuple[int, float, float]]) -> float:
    """The ``o`` of ``tpot = step + B*o`` over rows ``(B, client tpot, engine step)``, by
    least squares on relative error, floored at 0."""
    num = sum(b * (t - s) / t ** 2 for b, t, s in rows)
    den = sum(b * b / t ** 2 for b, t, _ in rows)
    return max(0.0, num / den)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workers", type=int, default=3,
                    help="most busy processes at once (workers, plus one for serving's share)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--profile", default=str(ROOT / "deploy" / "profiles" / "smollm2-cpu.json"))
    args = ap.parse_args()
    if args.workers < 1:
        ap.error("--workers must be >= 1")
    cp, t0, load0 = load_profile(args.profile), time.perf_counter(), os.getloadavg()[0]
    relative, host = contention(args.model, args.threads, args.workers, args.repeats, cp)
    overhead, serving = token_overhead(args.model, args.output_len, cp)
    host["serving"] = serving
    # One busy process: the engine alone against the profile's steps; k: that times k
    # engines' busy/alone. (The simulator adds the serving processes' share of a core.)
    factors = chained(relative)
    host["columns"] = ("contention: [k busy, B or n, L or c, seconds alone, seconds busy] "
                       "(decode points, then prefill); serving: [B, client TPOT, worker's "
                       "step, profile step]")
    host["loadavg"] = [load0, os.getloadavg()[0]]
    values = cp.to_json()
    values.update(contention=[round(f, 3) for f in factors],
                  token_overhead_s=round(overhead, 5), fit={**cp.fit, "host": host})
    values["notes"] = cp.notes.split("; host:")[0] + (
        f"; host: bench/calibrate_host.py, {args.workers} busy processes at most, "
        f"load average {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    save_profile(profile_from_dict(values, args.profile), args.profile)
    print(f"contention {values['contention']}, token overhead {overhead * 1e3:.1f} ms; "
          f"wrote {args.profile} in {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
