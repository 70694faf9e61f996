"""Experiment 1: prefill interference, real default model, this 2-core machine.

    python bench/interference.py [--lengths 128,512,1024,1536] [--seconds 30]
                                 [--out bench/results/interference]

Three deployments, each started like ``bench/deployments.py`` does (its ``start`` and
``stop``, from a config written for the run into ``--out``'s folder):

* colocated: one unified worker, 2 torch threads;
* disaggregated: a prefill worker pinned to CPU 0 and a decode worker pinned to CPU 1
  (worker setting ``cpu_affinity``), 1 thread each; every prompt is prefilled remotely
  (``least_loaded``, ``disagg_threshold`` 1);
* conditional: the same two pinned workers, conductor policy ``cache_aware`` (the
  decode worker prefills a prompt itself when that is predicted faster and stalls its
  running batch by at most ``max_decode_stall_s``; admission off).

Workload, identical for the three (fixed seeds), one run per long-prompt length L:
background chats arrive as a Poisson process (``--rate`` per second, prompts of 32-96
tokens, 48 output tokens) while a long prompt of L tokens (16 output tokens) arrives
every ``--long-every`` seconds, for ``--seconds`` seconds. Long prompts are the
interference; sweeping L shows where each deployment wins. Reported per run: p99 ITL
(inter-token gaps of all requests), p99 TTFT, and goodput (requests within TTFT <=
``--slo-ttft-ms`` and TPOT <= ``--slo-tpot-ms``). JSON and a PNG go to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import deployments  # noqa: E402
import serve  # noqa: E402
import serve_report  # noqa: E402
import zmq  # noqa: E402

from bench.datasets import RequestSpec  # noqa: E402
from common.protocol import GetStats, decode, encode  # noqa: E402

MODEL = "smollm2-135m-instruct"
BASE = "http://127.0.0.1:8000"
CONDUCTOR = "tcp://127.0.0.1:5551"
COMMON = {"conductor_addr": CONDUCTOR, "heartbeat_addr": "tcp://127.0.0.1:5552",
          "model": MODEL, "kv_cache_mib": 768}
DEPLOYMENTS = {
    "colocated": ({"policy": "least_loaded"},
                  {"unified": {"control_addr": "tcp://127.0.0.1:5560", "num_threads": 2}}),
    "disaggregated": ({"policy": "least_loaded", "disagg_threshold": 1},
                      {"prefill": {"control_addr": "tcp://127.0.0.1:5560", "num_threads": 1,
                                   "cpu_affinity": "0"},
                       "decode": {"control_addr": "tcp://127.0.0.1:5570", "num_threads": 1,
                                  "cpu_affinity": "1", "kv_port": 5571}}),
    "conditional": ({"policy": "cache_aware", "admission": False},
                    {"prefill": {"control_addr": "tcp://127.0.0.1:5560", "num_threads": 1,
                                 "cpu_affinity": "0"},
                     "decode": {"control_addr": "tcp://127.0.0.1:5570", "num_threads": 1,
                                "cpu_affinity": "1", "kv_port": 5571}}),
}


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return json.dumps(v)


def write_config(path: Path, conductor: dict, workers: dict) -> Path:
    sections = {"conductor": {"control_addr": CONDUCTOR, "heartbeat_addr": COMMON[
        "heartbeat_addr"], "cost_profile": "smollm2-cpu", **conductor}}
    for role, values in workers.items():
        sections[role] = {**COMMON, **values}
    sections["gateway"] = {"model": MODEL, "http_port": 8000, "conductor_addr": CONDUCTOR,
                           "zmq_addr": "tcp://127.0.0.1:5550",
                           "stream_bind": "tcp://127.0.0.1:5553"}
    path.write_text("\n".join(f"[{name}]\n" + "".join(f"{k} = {toml_value(v)}\n"
                                                      for k, v in values.items())
                              for name, values in sections.items()))
    return path


def workers_alive(want: int, timeout_s: float = 120.0) -> None:
    """Wait until the conductor lists ``want`` live workers."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(CONDUCTOR)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            sock.send_multipart(encode(GetStats()))
            if sock.poll(2000):
                workers = decode(sock.recv_multipart()).record.workers
                if sum(w.alive for w in workers) >= want:
                    return
            time.sleep(0.5)
    finally:
        sock.close(0)
    raise SystemExit(f"fewer than {want} workers alive after {timeout_s} s")


def workload(length: int, args, seed: int) -> list[RequestSpec]:
    rng = random.Random(seed)

    def prompt(n):
        return tuple(rng.randrange(100, 49152) for _ in range(n))
    specs, t = [], rng.expovariate(args.rate)
    while t < args.seconds:
        specs.append(RequestSpec(prompt(rng.randint(32, 96)), 48, t))
        t += rng.expovariate(args.rate)
    t = args.long_every / 2
    while t < args.seconds:
        specs.append(RequestSpec(prompt(length), 16, t))
        t += args.long_every
    return specs


def stalls(results) -> dict:
    """The tail p99 can miss at this many requests: the longest gap, and how many
    gaps between two tokens of a stream exceeded one second."""
    gaps = [x for r in results if r.success for x in r.itl_s]
    return {"max_itl_ms": round(max(gaps, default=0) * 1e3),
            "itl_over_1s": sum(g > 1.0 for g in gaps), "itl_count": len(gaps)}


def run_point(specs, slo) -> dict:
    results = asyncio.run(serve.run_benchmark(BASE, specs, model=MODEL,
                                              endpoint="completions", progress=False))
    summary = serve_report.summarize(results, serve_report.results_duration(results), slo)
    summary.update(stalls(results))
    longs = [r for r in results if r.output_len == 16 and r.success]
    summary["long_ttft_ms"] = [round(r.ttft_s * 1e3) for r in longs]
    summary["short_p99_itl_ms"] = serve_report.summarize(
        [r for r in results if r.output_len == 48], 1.0)["p99_itl_ms"]
    summary["records"] = [r.to_record() for r in results]  # to re-score other SLOs
    return summary


def rescore(path: Path, slo) -> list[dict]:
    """Rows of an earlier run, re-summarized under ``slo`` from their request records."""
    rows = json.loads(path.read_text())["rows"]
    for row in rows:
        results = [serve_report.RequestResult(**{k: tuple(v) if k == "itl_s" else v
                                          for k, v in r.items() if k != "tpot_s"})
                   for r in row["records"]]
        row.update(serve_report.summarize(results, serve_report.results_duration(results), slo))
        row.update(stalls(results))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="128,512,1024,1536")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--rate", type=float, default=1.5)
    ap.add_argument("--long-every", type=float, default=8.0)
    ap.add_argument("--slo-ttft-ms", type=float, default=5000)
    ap.add_argument("--slo-tpot-ms", type=float, default=250)
    ap.add_argument("--deployments", default=",".join(DEPLOYMENTS))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "interference"))
    ap.add_argument("--rescore", action="store_true",
                    help="re-summarize --out's JSON under the SLOs given; run nothing")
    args = ap.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    slo = serve_report.Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.rescore:
        rows = rescore(out.with_suffix(".json"), slo)
        for r in rows:
            print(f"{r['deployment']:>13} L={r['length']:>5}: p99 ITL {r['p99_itl_ms']:6.0f} "
                  f"ms, max ITL {r['max_itl_ms']:6.0f} ms, gaps > 1 s {r['itl_over_1s']:3}, "
                  f"p99 TTFT {r['p99_ttft_ms']:6.0f} ms, goodput {r['goodput_fraction']:5.1%}, "
                  f"p50 TPOT {r['p50_tpot_ms']:4.0f} ms")
        plot(rows, sorted({r["length"] for r in rows}), out.with_suffix(".png"), slo)
        saved = json.loads(out.with_suffix(".json").read_text())
        saved["args"].update(slo_ttft_ms=slo.ttft_ms, slo_tpot_ms=slo.tpot_ms)
        out.with_suffix(".json").write_text(json.dumps({**saved, "rows": rows}, indent=1))
        return
    t0 = time.perf_counter()
    rows = []
    for name in args.deployments.split(","):
        conductor, workers = DEPLOYMENTS[name]
        config = write_config(out.parent / f"interference-{name}.toml", conductor, workers)
        proc = deployments.start(str(config))
        try:
            workers_alive(len(workers))
            run_point(workload(64, argparse.Namespace(**{**vars(args), "seconds": 3.0}),
                               99), slo)  # warm up
            for length in lengths:
                s = run_point(workload(length, args, seed=length), slo)
                rows.append({"deployment": name, "length": length, **s})
                print(f"{name:>13} L={length:>5}: p99 ITL {s['p99_itl_ms']:7.0f} ms, "
                      f"p99 TTFT {s['p99_ttft_ms']:7.0f} ms, goodput "
                      f"{s['goodput_fraction']:5.1%}, long TTFT {s['long_ttft_ms']}",
                      flush=True)
        finally:
            deployments.stop(proc)
    result = {"args": vars(args), "rows": rows, "wall_s": round(time.perf_counter() - t0)}
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(rows, lengths, out.with_suffix(".png"), slo)
    print(f"wrote {out.with_suffix('.json')} and .png in {result['wall_s']} s")


def plot(rows, lengths, path: Path, slo) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for key, ax, label in (("p99_itl_ms", axes[0], "p99 ITL (ms)"),
                           ("p99_ttft_ms", axes[1], "p99 TTFT (ms)"),
                           ("goodput_fraction", axes[2], "goodput (fraction within SLO)")):
        for name in DEPLOYMENTS:
            pts = [(r["length"], r[key]) for r in rows if r["deployment"] == name]
            if pts:
                ax.plot(*zip(*pts, strict=True), "o-", label=name)
        ax.set_xlabel("long prompt length (tokens)")
        ax.set_ylabel(label)
        ax.set_xticks(lengths)
    axes[0].set_yscale("log")
    axes[2].set_ylim(0, 1.05)
    axes[2].set_title(f"SLO: TTFT <= {slo.ttft_ms:g} ms, TPOT <= {slo.tpot_ms:g} ms",
                      fontsize=9)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
