"""The numbers of a serving benchmark run: what happened to each request, the summary
(latency percentiles, throughputs, goodput under SLOs), its table, its JSON and its CDF
plot. ``bench/serve.py`` produces the results; other benchmarks summarize with this too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2e")
MAX_ERROR_SAMPLES = 5


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency targets in ms; ``None`` means no target for that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def __post_init__(self):
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"SLO {name} must be positive, got {value}")

    @property
    def given(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None


@dataclass(frozen=True, slots=True)
class RequestResult:
    """What happened to one request. Times are seconds; ``arrival_s`` and ``start_s``
    count from the start of the run, ``start_s`` being when it was sent (after any wait
    for a concurrency slot). ``prompt_tokens`` is the server's count, if it sent usage."""

    index: int
    prompt_len: int
    output_len: int
    success: bool
    output_tokens: int
    prompt_tokens: int | None
    ttft_s: float | None
    itl_s: tuple[float, ...]
    e2e_s: float
    arrival_s: float
    start_s: float
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if not self.success or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_record(self) -> dict:
        return {**asdict(self), "itl_s": list(self.itl_s), "tpot_s": self.tpot_s}


def results_duration(results: Sequence[RequestResult]) -> float:
    """Seconds from the start of the run to the last request's end."""
    return max((r.start_s + r.e2e_s for r in results), default=0.0)


def _stats(name: str, values_s: Sequence[float]) -> dict:
    keys = [f"{s}_{name}_ms" for s in ("mean", "p50", "p90", "p99")]
    if not values_s:
        return dict.fromkeys(keys)
    ms = np.asarray(values_s) * 1000.0
    values = [ms.mean(), *np.percentile(ms, [50, 90, 99])]
    return {k: float(v) for k, v in zip(keys, values, strict=True)}


def meets_slo(result: RequestResult, slo: Slo) -> bool:
    """Succeeded within both targets. A one-token output has no TPOT, so it cannot miss."""
    if not result.success:
        return False
    if slo.ttft_ms is not None and result.ttft_s * 1000 > slo.ttft_ms:
        return False
    tpot = result.tpot_s
    return slo.tpot_ms is None or tpot is None or tpot * 1000 <= slo.tpot_ms


def summarize(results: Sequence[RequestResult], duration: float,
              slo: Slo | None = None) -> dict:
    """Aggregate numbers of a run. Latencies come from successful requests only; rates
    are per second of ``duration``. Goodput (requests/s meeting every given SLO) and its
    fraction of all requests are None when no SLO is given."""
    slo = slo or Slo()
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    input_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len
                       for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    summary = {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(failed),
        "errors": [f"request {r.index}: {r.error}" for r in failed[:MAX_ERROR_SAMPLES]],
        "output_len_mismatch": sum(r.output_tokens != r.output_len for r in ok),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
        "slo_ttft_ms": slo.ttft_ms,
        "slo_tpot_ms": slo.tpot_ms,
        "goodput": None,
        "goodput_fraction": None,
    }
    if slo.given:
        good = sum(meets_slo(r, slo) for r in results)
        summary["goodput"] = per_s(good)
        summary["goodput_fraction"] = good / len(results) if results else 0.0
    summary.update(_stats("ttft", [r.ttft_s for r in ok]))
    summary.update(_stats("tpot", [r.tpot_s for r in ok if r.tpot_s is not None]))
    summary.update(_stats("itl", [x for r in ok for x in r.itl_s]))
    summary.update(_stats("e2e", [r.e2e_s for r in ok]))
    return summary


# --------------------------------------------------------------------------- report


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.2f}"
    return f"{value:,}"


def format_summary(summary: dict, label: str = "") -> str:
    rows = [
        ("Successful requests", summary["completed"]),
        ("Failed requests", summary["failed"]),
        ("Benchmark duration (s)", summary["duration_s"]),
        ("Total input tokens", summary["total_input_tokens"]),
        ("Total output tokens", summary["total_output_tokens"]),
        ("Request throughput (req/s)", summary["request_throughput"]),
        ("Output token throughput (tok/s)", summary["output_throughput"]),
        ("Total token throughput (tok/s)", summary["total_token_throughput"]),
    ]
    if summary["goodput"] is not None:
        slo = ", ".join(f"{m} <= {summary[f'slo_{m}_ms']:g} ms" for m in ("ttft", "tpot")
                        if summary[f"slo_{m}_ms"] is not None)
        rows += [(f"Goodput (req/s, {slo})", summary["goodput"]),
                 ("Requests meeting SLOs (%)", 100 * summary["goodput_fraction"])]
    if summary["output_len_mismatch"]:
        rows.append(("Outputs of unexpected length", summary["output_len_mismatch"]))
    width = 64
    lines = [f" Serving benchmark {label} ".center(width, "=")]
    lines += [f"{name:<48}{_fmt(value):>16}" for name, value in rows]
    lines.append(f"{'(ms)':<16}" + "".join(f"{h:>12}" for h in ("mean", "p50", "p90", "p99")))
    for m in METRICS:
        lines.append(f"{m.upper():<16}" + "".join(
            f"{_fmt(summary[f'{s}_{m}_ms']):>12}" for s in ("mean", "p50", "p90", "p99")))
    for err in summary["errors"]:
        lines.append(f"  ! {err}")
    lines.append("=" * width)
    return "\n".join(lines)


def write_json(path: Path, label: str, config: dict, summary: dict,
               results: Sequence[RequestResult]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {"label": label, "config": config, "summary": summary,
              "requests": [r.to_record() for r in results]}
    path.write_text(json.dumps(report, indent=1))


def plot_cdfs(path: Path, label: str, results: Sequence[RequestResult], slo: Slo) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.success]
    series = (("TTFT", [r.ttft_s * 1000 for r in ok], slo.ttft_ms),
              ("ITL", [x * 1000 for r in ok for x in r.itl_s], slo.tpot_ms))
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, (name, values, target) in zip(axes, series, strict=True):
        if values:
            xs = np.sort(values)
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), color="#3070b0")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", transform=ax.transAxes)
        if target is not None:
            # For ITL the TPOT target is the natural yardstick: it bounds the mean gap.
            ax.axvline(target, color="#c04040", ls="--", lw=1,
                       label=f"{'TTFT' if name == 'TTFT' else 'TPOT'} SLO {target:g} ms")
            ax.legend(fontsize=8)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction")
        ax.grid(alpha=0.3)
    fig.suptitle(f"serve {label}: {len(ok)}/{len(results)} ok", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
