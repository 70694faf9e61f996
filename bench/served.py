"""Served latency: pdserve colocated against llama.cpp's ``llama-server``, same load.

    python bench/served.py --llama-server PATH [--f32-gguf PATH] [--num-prompts 32]
        [--input-len 390 --range-ratio 0.5 --output-len 64 --request-rate 0.5]
        [--threads 2 --parallel 8] [--quantization none|int8|int4]
        [--repeats 1 --warmup 0] [--out served.json]
        [--worker-set KEY=VALUE ...] [--log-dir DIR] [--sides pdserve,llama-server]
    python bench/served.py --simulate smollm2-cpu-quiet [--worker-set KEY=VALUE ...]

Sides, each a fresh server per run, interleaved by bench/harness.py:

* ``pdserve``: deploy/configs/colocated.toml (gateway, conductor, one unified worker
  with ``--threads`` torch threads and ``--quantization``) started by
  deploy/run_local.py, every port moved to a free one so that other deployments on the
  host are left alone; ``--worker-set`` overrides a setting of its ``[unified]``
  section (``max_prefill_tokens_with_decode=128``, ``log_level=debug`` for the
  per-step trace), ``--log-dir`` keeps each run's server output;
* ``llama-server``: ``llama-server -m <default GGUF> -np <parallel> -t <threads>``;
* ``llama-server-f32`` (with ``--f32-gguf``): the same weights as F32 (made with
  ``llama-quantize --allow-requantize <gguf> <out> F32``, docs/benchmarks.md).

``--simulate PROFILE`` runs no server: one side, ``pdserve-sim``, replays the same
requests in virtual time through the engine's real scheduler (services/engine/sim.py)
with step times from a cost profile (deploy/profiles), so that scheduling settings
(``--worker-set``) can be compared without a quiet machine; in seconds.

Every side gets the same requests per round (bench/serve.py's random dataset, token-id
prompts on ``/v1/completions``, greedy, ``ignore_eos``, streamed). Figures: mean TTFT,
TPOT and end-to-end latency (ms) and goodput (req/s within ``--slo-ttft-ms`` and
``--slo-tpot-ms``). The JSON is the harness's report; bench/report.py renders it into
docs/benchmarks.md's ``served`` section.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import serve, serve_report  # noqa: E402
from bench.harness import Metric, RunContext, Session, print_summary, write  # noqa: E402

MODEL = "smollm2-135m-instruct"
METRICS = [Metric("mean_ttft_ms", "mean TTFT", "ms", higher_is_better=False),
           Metric("mean_tpot_ms", "mean TPOT", "ms", higher_is_better=False),
           Metric("mean_e2e_ms", "mean end-to-end", "ms", higher_is_better=False),
           Metric("goodput", "goodput", "req/s")]
KEPT = ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_e2e_ms",
        "p99_e2e_ms", "p99_itl_ms", "goodput", "output_throughput", "completed", "failed")


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(v)


def parse_overrides(items: list[str]) -> dict[str, object]:
    """``KEY=VALUE`` pairs for the worker's section; an int where the value reads as one."""
    out: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--worker-set takes KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = int(value)
        except ValueError:
            out[key.strip()] = value
    return out


def colocated_config(ctx: RunContext, threads: int, quantization: str,
                     overrides: dict[str, object] | None = None) -> tuple[Path, int]:
    """deploy/configs/colocated.toml with each port a free one and ``overrides`` in its
    worker's section; (its path, HTTP port)."""
    table = tomllib.loads((ROOT / "deploy" / "configs" / "colocated.toml").read_text())
    moved: dict[int, int] = {}

    def port(p: int) -> int:
        return moved.setdefault(p, ctx.port())
    lines = []
    for section, keys in table.items():
        lines.append(f"[{section}]")
        first = len(lines)
        for key, value in keys.items():
            if key.endswith("_port") and isinstance(value, int):
                value = port(value)
            elif isinstance(value, str) and value.startswith("tcp://"):
                head, _, p = value.rpartition(":")
                value = f"{head}:{port(int(p))}"
            elif key == "num_threads":
                value = threads
            lines.append(f"{key} = {_toml_value(value)}")
        if section == "unified":
            extra = {"quantization": quantization, **(overrides or {})}
            lines[first:] = [ln for ln in lines[first:] if ln.split(" = ")[0] not in extra]
            lines += [f"{k} = {_toml_value(v)}" for k, v in extra.items()]
        lines.append("")
    path = ctx.tmp / "colocated.toml"
    path.write_text("\n".join(lines))
    return path, moved[table["gateway"]["http_port"]]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}) before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not healthy within {timeout:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def start_pdserve(ctx: RunContext, threads: int, quantization: str,
                  overrides: dict[str, object] | None = None) -> tuple[subprocess.Popen, str]:
    config, http_port = colocated_config(ctx, threads, quantization, overrides)
    log = open(ctx.tmp / "pdserve.log", "wb")  # noqa: SIM115 (outlives this call)
    proc = subprocess.Popen([sys.executable, "deploy/run_local.py", "--config", str(config)],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    return proc, f"http://127.0.0.1:{http_port}"


def start_llama(ctx: RunContext, binary: str, gguf: str, threads: int,
                parallel: int) -> tuple[subprocess.Popen, str]:
    http_port = ctx.port()
    log = open(ctx.tmp / "llama-server.log", "wb")  # noqa: SIM115 (outlives this call)
    proc = subprocess.Popen([binary, "-m", gguf, "-np", str(parallel), "-t", str(threads),
                             "--host", "127.0.0.1", "--port", str(http_port)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{http_port}"


def run_side(ctx: RunContext, args: argparse.Namespace, gguf: str) -> dict:
    if ctx.side == "pdserve":
        proc, base = start_pdserve(ctx, args.threads, args.quantization,
                                   parse_overrides(args.worker_set))
    else:
        model = args.f32_gguf if ctx.side == "llama-server-f32" else gguf
        proc, base = start_llama(ctx, args.llama_server, model, args.threads, args.parallel)
    try:
        _wait_healthy(base + "/health", proc)
        specs = serve.build_requests(serve.parse_args([
            "--model", MODEL, "--dataset", "random", "--num-prompts", str(args.num_prompts),
            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--range-ratio", str(args.range_ratio), "--request-rate", str(args.request_rate),
            "--seed", str(ctx.seed)]))
        results = asyncio.run(serve.run_benchmark(base, specs, model=MODEL,
                                                  endpoint="completions", progress=False))
    finally:
        _stop(proc)
        if args.log_dir:
            keep = Path(args.log_dir)
            keep.mkdir(parents=True, exist_ok=True)
            logs = list(ctx.tmp.glob("*.log"))
            if ctx.side == "pdserve":  # each service's own log, where run_local put it
                found = re.search(r"logs in (\S+?)\)", (ctx.tmp / "pdserve.log").read_text())
                logs += list(Path(found.group(1)).glob("*.log")) if found else []
            for log in logs:
                shutil.copy(log, keep / f"r{ctx.round}-{ctx.side}-{log.name}")
    summary = serve_report.summarize(results, serve_report.results_duration(results),
                                     serve_report.Slo(args.slo_ttft_ms, args.slo_tpot_ms))
    if summary["failed"]:
        print(f"{ctx.side}: {summary['failed']} failed: {summary['errors']}", file=sys.stderr)
    return {k: summary[k] for k in KEPT}


def run_sim(ctx: RunContext, args: argparse.Namespace) -> dict:
    """The pdserve side in virtual time: each step lasts what the profile says."""
    from common.cost_profile import load_profile
    from common.sampling_params import SamplingParams
    from services.engine.sim import SimEngine

    worker = dict(parse_overrides(args.worker_set))
    clock = [0.0]

    def advance(seconds: float) -> None:
        clock[0] += seconds
    engine = SimEngine(load_profile(args.simulate), sleep=advance,
                       kv_cache_bytes=int(worker.pop("kv_cache_mib", 512)) << 20,
                       max_num_seqs=int(worker.pop("max_num_seqs", 64)),
                       max_num_batched_tokens=int(worker.pop("max_num_batched_tokens", 2048)),
                       prefill_chunk_size=int(worker.pop("prefill_chunk_size", 0)) or None,
                       max_prefill_tokens_with_decode=int(
                           worker.pop("max_prefill_tokens_with_decode", 0)) or None)
    if worker:
        raise ValueError(f"--simulate takes no worker setting {sorted(worker)}")
    specs = serve.build_requests(serve.parse_args([
        "--model", MODEL, "--dataset", "random", "--num-prompts", str(args.num_prompts),
        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--range-ratio", str(args.range_ratio), "--request-rate", str(args.request_rate),
        "--seed", str(ctx.seed)]))
    times: dict[int, list[float]] = {i: [] for i in range(len(specs))}
    nxt = 0
    while nxt < len(specs) or engine.has_unfinished_requests():
        while nxt < len(specs) and specs[nxt].arrival_s <= clock[0]:
            spec = specs[nxt]
            engine.add_request(str(nxt), list(spec.prompt), SamplingParams(
                temperature=0, max_tokens=spec.output_len, ignore_eos=True))
            nxt += 1
        if not engine.has_unfinished_requests():
            clock[0] = specs[nxt].arrival_s
            continue
        for out in engine.step():
            times[int(out.request_id)] += [clock[0]] * len(out.new_token_ids)
    results = []
    for i, spec in enumerate(specs):
        t = times[i]
        gaps = tuple(b - a for a, b in zip(t[:-1], t[1:], strict=True))
        results.append(serve_report.RequestResult(
            index=i, prompt_len=spec.prompt_len, output_len=spec.output_len, success=True,
            output_tokens=len(t), prompt_tokens=spec.prompt_len,
            ttft_s=t[0] - spec.arrival_s, itl_s=gaps,
            e2e_s=t[-1] - spec.arrival_s, arrival_s=spec.arrival_s, start_s=spec.arrival_s))
    summary = serve_report.summarize(results, serve_report.results_duration(results),
                                     serve_report.Slo(args.slo_ttft_ms, args.slo_tpot_ms))
    return {k: summary[k] for k in KEPT}


def _server_sides(args: argparse.Namespace, ap: argparse.ArgumentParser) -> dict:
    from services.engine.weights import resolve_model
    gguf = resolve_model(MODEL)
    sides = ["pdserve", "llama-server"] + (["llama-server-f32"] if args.f32_gguf else [])
    if args.sides:
        chosen = [s.strip() for s in args.sides.split(",") if s.strip()]
        unknown = sorted(set(chosen) - set(sides))
        if unknown or not chosen:
            ap.error(f"--sides: {unknown or 'none'} not among {sides}")
        sides = [s for s in sides if s in chosen]
    return {s: (lambda ctx: run_side(ctx, args, gguf)) for s in sides}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", help="path of llama.cpp's llama-server")
    ap.add_argument("--simulate", metavar="PROFILE", default=None,
                    help="no servers: pdserve's scheduler in virtual time with this cost "
                         "profile (deploy/profiles)")
    ap.add_argument("--f32-gguf", default=None, help="the model as F32 GGUF: a third side")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=390)
    ap.add_argument("--range-ratio", type=float, default=0.5)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--request-rate", type=float, default=0.5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parallel", type=int, default=8, help="llama-server -np")
    ap.add_argument("--quantization", default="none",
                    help="pdserve's weights: none, int8, int4, w8a16, w4a16, w8a8 or w4a8")
    ap.add_argument("--slo-ttft-ms", type=float, default=5000)
    ap.add_argument("--slo-tpot-ms", type=float, default=250)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--worker-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a setting of pdserve's worker (repeatable)")
    ap.add_argument("--log-dir", default=None, help="keep each run's server output here")
    ap.add_argument("--sides", default=None,
                    help="comma-separated subset of the sides to run (default: all)")
    ap.add_argument("--out", default=None,
                    help="default bench/results/served.json (served-sim.json simulated)")
    args = ap.parse_args(argv)
    if args.simulate:
        runners = {"pdserve-sim": lambda ctx: run_sim(ctx, args)}
    elif args.llama_server:
        runners = _server_sides(args, ap)
    else:
        ap.error("give --llama-server PATH, or --simulate PROFILE")
    settings = {"prompts": args.num_prompts, "input_len": args.input_len,
                "range_ratio": args.range_ratio, "output_len": args.output_len,
                "rate": args.request_rate, "threads": args.threads,
                "llama_np": args.parallel, "quantization": args.quantization,
                "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
                **{f"worker.{k}": v for k, v in parse_overrides(args.worker_set).items()}}
    if args.simulate:  # no threads, llama-server or weights: the profile stands for them
        for key in ("threads", "llama_np", "quantization"):
            del settings[key]
        settings["simulate"] = args.simulate
    name = "served-sim" if args.simulate else "served"
    session = Session(name, settings, seed=args.seed)
    runs = session.run(runners, repeats=args.repeats, warmup=args.warmup)
    report = session.finish(METRICS, runs)
    print_summary(report)
    write(report, Path(args.out or ROOT / "bench" / "results" / f"{name}.json"))


if __name__ == "__main__":
    main()
