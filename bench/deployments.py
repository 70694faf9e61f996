"""The same load against the disaggregated and the colocated deployment, in one run.

    python bench/deployments.py [--num-prompts 24] [--request-rate 0.5] [--input-len 512]

Starts each deployment with ``deploy/run_local.py`` (disaggregated: one prefill + one
decode worker, one thread each; colocated: one unified worker with two threads), runs
``bench/serve.py``'s load against its OpenAI endpoint, stops it, and prints the two
summaries side by side with their ratios. JSON and a PNG go to ``bench/results/``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import serve  # noqa: E402
import serve_report  # noqa: E402

DEPLOYMENTS = {"disaggregated": "deploy/configs/local.toml",
               "colocated": "deploy/configs/colocated.toml"}
KEYS = ("mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "p99_itl_ms", "p50_e2e_ms",
        "output_throughput", "goodput", "completed", "failed")


def start(config: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a deployment with run_local.py; return once its gateway is healthy."""
    proc = subprocess.Popen([sys.executable, "deploy/run_local.py", "--config", config],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(1)
    os.killpg(proc.pid, signal.SIGTERM)
    raise SystemExit(f"{config}: not ready in 300 s")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    time.sleep(2)  # let the ports go


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--request-rate", type=float, default=0.5)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--slo-ttft-ms", type=float, default=5000)
    ap.add_argument("--slo-tpot-ms", type=float, default=250)
    args = ap.parse_args()
    spec_args = serve.parse_args([
        "--base-url", "http://127.0.0.1:8000", "--model", "smollm2-135m-instruct",
        "--dataset", "random", "--num-prompts", str(args.num_prompts),
        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--range-ratio", "0.5", "--request-rate", str(args.request_rate), "--no-progress"])
    specs = serve.build_requests(spec_args)
    slo = serve_report.Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    summaries = {}
    for name, config in DEPLOYMENTS.items():
        proc = start(config)
        try:
            results = asyncio.run(serve.run_benchmark(
                "http://127.0.0.1:8000", specs, model="smollm2-135m-instruct",
                endpoint="completions"))
        finally:
            stop(proc)
        summaries[name] = serve_report.summarize(
            results, serve_report.results_duration(results), slo)
    d, c = summaries["disaggregated"], summaries["colocated"]
    print(f"{'':>20} {'disaggregated':>14} {'colocated':>12} {'ratio':>7}")
    for key in KEYS:
        ratio = d[key] / c[key] if c.get(key) else float("nan")
        print(f"{key:>20} {d[key]:>14.1f} {c[key]:>12.1f} {ratio:>7.2f}")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "deployments.json").write_text(json.dumps(
        {"args": vars(args), "summaries": summaries}, indent=2))
    plot(summaries, out / "deployments.png")


def plot(summaries: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "p99_itl_ms"]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    width = 0.38
    for i, (name, s) in enumerate(summaries.items()):
        ax.bar([k + i * width for k in range(len(keys))], [s[k] for k in keys], width,
               label=name)
    ax.set_xticks([k + width / 2 for k in range(len(keys))], keys, fontsize=8)
    ax.set_ylabel("ms")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
