"""What one run of ``bench/advise_check.py`` yields, live or simulated, and how its
runs are summed up: per-request rows, the live conductor's routing decisions read back
from its log and the live workers' stats, and, over repeated runs, the run of median
goodput with the range and the goodput at scaled SLOs."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import TYPE_CHECKING

from services.advisor.search import Slo

if TYPE_CHECKING:
    from tests.cluster import Cluster

# Goodput is also compared with both SLOs scaled by each of these (``sweep``): one SLO
# at a load's expected mean TPOT puts its median request at the edge, where a few
# percent on a step moves many requests across it.
SLO_SCALES = (1.0, 1.25, 1.5, 2.0)


def median_run(runs: list[dict], slo: Slo) -> dict:
    """The run of median goodput (the lower middle one for an even count), with the
    goodputs' ``goodput_range`` and, per SLO scale, the median goodput (``sweep``)."""
    ranked = sorted(runs, key=lambda r: r["goodput"])
    return {**ranked[(len(ranked) - 1) // 2],
            "goodput_range": [ranked[0]["goodput"], ranked[-1]["goodput"]],
            "sweep": _median_sweep(runs, slo)}


def sweep(row: dict, slo: Slo, scales: tuple[float, ...] = SLO_SCALES) -> list[float]:
    """A run's goodput with both SLOs scaled by each of ``scales``, from its per-request
    rows (``[arrival, prompt, output, TTFT ms, TPOT ms, ...]``; no TTFT: it failed; no
    TPOT: one token, which cannot miss it) over its ``duration_s``, as ``bench/serve.py``
    counts a request good."""
    rows, duration = row["requests"], row["duration_s"]
    out = []
    for k in scales:
        ttft, tpot = k * slo.ttft_s * 1e3, k * slo.tpot_s * 1e3
        good = sum(1 for r in rows if r[3] is not None and r[3] <= ttft
                   and (r[4] is None or r[4] <= tpot))
        out.append(good / duration if duration > 0 else 0.0)
    return out


def _median_sweep(runs: list[dict], slo: Slo) -> list[float]:
    """Per SLO scale, the median over ``runs`` of their goodput (the lower middle one)."""
    per_run = [sweep(r, slo) for r in runs]
    return [sorted(col)[(len(col) - 1) // 2] for col in zip(*per_run, strict=True)]


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 1)


def per_request(results: list) -> list:
    """[arrival s, prompt, output tokens, TTFT ms, TPOT ms, median and max gap between
    tokens ms] per request, in the order sent: what the mean figures hide (a decode
    stalled by a prefill shows as one long gap, a slow step as a high median)."""
    rows = []
    for r in sorted(results, key=lambda r: r.index):
        gaps = sorted(r.itl_s)
        rows.append([round(r.arrival_s, 3), r.prompt_len, r.output_tokens, ms(r.ttft_s),
                     ms(r.tpot_s), ms(gaps[len(gaps) // 2] if gaps else None),
                     ms(gaps[-1] if gaps else None)])
    return rows


ROUTED = re.compile(r"\brouted\b.*?\bprefill=(\S+) reason=(.*) request_id=(\S+)")


def routes_logged(log: Path) -> list:
    """The live conductor's decisions from its log (``routed``: decode, prefill or
    None, the reason), in the order it made them."""
    if not log.exists():
        return []
    return [[m.group(1) != "None", m.group(2).strip("'\"")]
            for m in map(ROUTED.search, log.read_text(errors="replace").splitlines()) if m]


def routed(cluster: Cluster, roles: list[str], sent: int) -> dict:
    """Where the live prompts were prefilled (the prefill workers' finished jobs; the
    rest on their decode worker) and the step costs the conductor refitted from the
    workers' reports: what the simulator's routing and costs are compared with."""
    try:
        remote = sum(cluster.worker_stats(f"{role}-{i}").prefills_done
                     for i, role in enumerate(roles) if role == "prefill")
        fallbacks = sum(cluster.worker_stats(f"{role}-{i}").local_fallbacks
                        for i, role in enumerate(roles) if role == "decode")
        fitted = dataclasses.astuple(cluster.conductor_stats().cost_model)
    except (OSError, TimeoutError, RuntimeError) as exc:
        return {"local_prefills": None, "conductor_cost_model": None, "stats_error": str(exc)}
    return {"local_prefills": sent - remote, "local_fallbacks": fallbacks,
            "conductor_cost_model": fitted}
