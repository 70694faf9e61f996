"""The host's step factors read back from a live deployment's step traces: how much
slower each kind of engine step ran with the other workers busy than the simulator
charges for it.

``bench/calibrate_host.py`` measures the factor of a second busy process with a bare
engine stepping beside the one it times, a handful of steps per point. A live pair of
workers runs under the whole serving stack, for thousands of steps; their step lines
(worker ``log_level = "debug"``: ``step chunks=C decode=B ms=M prefill=N``, logged at
the step's end) say when each step ran, so each step of one worker is known to have run
alone (no other worker in a step for more than ``ALONE`` of it) or beside ``k`` busy
workers (each in a step for at least ``BUSY`` of it). A step half overlapped is left out.

Each step's ratio is its live time over what the simulator charges for it at that many
busy processes: the engine's step from the profile (``Profile.prefill_step_s`` of the
prompt tokens in ``C`` equal chunks, uncached, plus ``Profile.decode_step_s`` of the
batch at ``ctx_per_seq`` context tokens a sequence) times the profile's factor of its
kind (a step that prefills counts as a prefill). Every worker's first step is left out
(it warms the engine up). ``refit_host`` multiplies each factor by the median ratio of
its (kind, busy) where there are enough steps, so the simulator charges what the traces
measured; the profile's ``contention`` (what the conductor predicts with) is left as
it is.
"""

from __future__ import annotations

import bisect
import dataclasses
import re
import statistics
from dataclasses import dataclass
from datetime import datetime

from common.cost_profile import CostProfile
from services.sim.profiles import Profile, host_factors

STEP = re.compile(r"^(\S+)\s.*?\bstep\b.*?\bchunks=(\d+) decode=(\d+) ms=([\d.]+) "
                  r"prefill=(\d+)")
ALONE, BUSY = 0.2, 0.8  # share of a step another worker was in a step of its own
MIN_STEPS = 20  # steps of a (kind, busy) before its median replaces a factor


@dataclass(frozen=True, slots=True)
class TracedStep:
    start: float  # seconds (epoch)
    end: float
    chunks: int  # prompt chunks prefilled in the step
    batch: int  # sequences decoded in the step
    tokens: int  # prompt tokens prefilled in the step

    @property
    def kind(self) -> str:
        return "prefill" if self.chunks and self.tokens else "decode"


def read_steps(text: str) -> list[TracedStep]:
    """A worker log's step lines, in order; other lines (and a malformed stamp) skipped."""
    steps = []
    for m in map(STEP.search, text.splitlines()):
        if m is None:
            continue
        try:
            end = datetime.fromisoformat(m[1].replace("Z", "+00:00")).timestamp()
        except ValueError:
            continue
        steps.append(TracedStep(end - float(m[4]) / 1e3, end, int(m[2]), int(m[3]),
                                int(m[5])))
    return steps


def _share_in_steps(lo: float, hi: float, steps: list[TracedStep], ends: list[float]) -> float:
    """The share of [lo, hi] during which ``steps`` (sorted, not overlapping) run."""
    inside, i = 0.0, bisect.bisect_right(ends, lo)
    while i < len(steps) and steps[i].start < hi:
        inside += max(0.0, min(hi, steps[i].end) - max(lo, steps[i].start))
        i += 1
    return inside / (hi - lo) if hi > lo else 0.0


def engine_s(prof: Profile, step: TracedStep, ctx_per_seq: float) -> tuple[float, float]:
    """(prefill part, decode part) of the step as the profile prices it, no host factor."""
    prefill = prof.prefill_step_s([(step.tokens / step.chunks, 0)] * step.chunks) \
        if step.chunks else 0.0
    return prefill, prof.decode_step_s(step.batch, step.batch * ctx_per_seq)


def step_ratios(traces: dict[str, list[TracedStep]], prof: Profile,
                ctx_per_seq: float) -> dict[tuple[str, int], list[float]]:
    """{(kind, busy processes): [live / charged, ...]} over every worker's steps but its
    first; busy counts the stepping worker."""
    ends = {w: [s.end for s in steps] for w, steps in traces.items()}
    out: dict[tuple[str, int], list[float]] = {}
    for wid, steps in traces.items():
        for step in steps[1:]:
            shares = [_share_in_steps(step.start, step.end, other, ends[o])
                      for o, other in traces.items() if o != wid]
            if any(ALONE < s < BUSY for s in shares) or step.end <= step.start:
                continue
            busy = 1 + sum(s >= BUSY for s in shares)
            prefill, decode = engine_s(prof, step, ctx_per_seq)
            charged = prefill * prof.contended(busy, "prefill") + \
                decode * prof.contended(busy, "decode")
            if charged > 0:
                out.setdefault((step.kind, busy), []).append((step.end - step.start) / charged)
    return out


def refit_host(cp: CostProfile, ratios: dict[tuple[str, int], list[float]],
               name: str, note: str, min_steps: int = MIN_STEPS) -> CostProfile:
    """``cp`` with its per-kind host factors (``fit.host``) times the median ratio of
    each (kind, busy) that has ``min_steps`` steps, kept from falling as busy grows;
    ``ValueError`` when ``cp`` has no per-kind factors or no (kind, busy) has enough."""
    host = dict(cp.fit.get("host", {})) if isinstance(cp.fit, dict) else {}
    changed = {}
    for kind in ("decode", "prefill"):
        factors = list(host_factors(cp, kind))
        if not factors:
            raise ValueError(f"profile {cp.name!r} has no fit.host {kind}_contention")
        for k in range(1, len(factors) + 1):
            values = ratios.get((kind, k), [])
            if len(values) >= min_steps:
                factors[k - 1] = max(1.0, round(factors[k - 1] * statistics.median(values), 3))
                changed[f"{kind} x{k}"] = (len(values), round(statistics.median(values), 3))
        for k in range(1, len(factors)):
            factors[k] = max(factors[k], factors[k - 1])
        host[f"{kind}_contention"] = factors
    if not changed:
        raise ValueError(f"no (kind, busy) has {min_steps} traced steps")
    host["from_traces"] = {"steps_and_median_ratio": changed, "note": note}
    return dataclasses.replace(cp, name=name, fit={**cp.fit, "host": host},
                               notes=f"{cp.notes}; {note}")
