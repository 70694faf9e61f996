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

Each step's factor is its live time over the engine's step as the profile prices it
(``Profile.prefill_step_s`` of the prompt tokens in ``C`` equal chunks, uncached, plus
``Profile.decode_step_s`` of the batch at ``ctx_per_seq`` context tokens a sequence; a
step that prefills counts as a prefill), keyed by its kind, the busy processes and,
beside one busy worker, what that worker ran (``profiles.NEIGHBOURS``: a decode step
beside a long prompt's prefill ran as if alone, beside a decode or a short prompt at
the two-busy factor). Every worker's first step is left out (it warms the engine up).
``refit_host`` sets the per-kind factors and the neighbours' weights from the medians,
so the simulator charges what the traces measured; the profile's ``contention`` (what
the conductor predicts with) is left as it is. ``context_term`` refits the decode
step's cost per context token from steps run alone at two context lengths.
"""

from __future__ import annotations

import bisect
import dataclasses
import re
import statistics
from dataclasses import dataclass
from datetime import datetime

from common.cost_profile import CostProfile
from services.sim.profiles import NEIGHBOURS, Profile, host_factors, neighbour_class

STEP = re.compile(r"^(\S+)\s.*?\bstep\b.*?\bchunks=(\d+) decode=(\d+) ms=([\d.]+) "
                  r"prefill=(\d+)")
ALONE, BUSY = 0.2, 0.8  # share of a step another worker was in a step of its own
MIN_STEPS = 20  # steps of a (kind, busy) before its median replaces a factor
MIN_CTX_STEPS = 10  # alone steps of a (role, batch, context) for the context term


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


def _neighbour(step: TracedStep, other: list[TracedStep]) -> str:
    """The NEIGHBOURS class of what ``other`` ran longest during ``step``."""
    best, cls = 0.0, "decode"
    for o in other:
        inside = min(step.end, o.end) - max(step.start, o.start)
        if inside > best:
            best, cls = inside, neighbour_class(o.tokens if o.chunks else 0)
    return cls


def step_factors(traces: dict[str, list[TracedStep]], prof: Profile,
                 ctx_per_seq: float) -> dict[tuple[str, int, str], list[float]]:
    """{(kind, busy processes, neighbour): [live / engine step, ...]}: the host factor
    each step ran at, over every worker's steps but its first; busy counts the stepping
    worker; neighbour is the NEIGHBOURS class of what the one other busy worker ran
    (busy = 2), else ""."""
    ends = {w: [s.end for s in steps] for w, steps in traces.items()}
    out: dict[tuple[str, int, str], list[float]] = {}
    for wid, steps in traces.items():
        for step in steps[1:]:
            shares = {o: _share_in_steps(step.start, step.end, other, ends[o])
                      for o, other in traces.items() if o != wid}
            if any(ALONE < s < BUSY for s in shares.values()) or step.end <= step.start:
                continue
            busy = [o for o, s in shares.items() if s >= BUSY]
            cls = _neighbour(step, traces[busy[0]]) if len(busy) == 1 else ""
            engine = sum(engine_s(prof, step, ctx_per_seq))
            if engine > 0:
                out.setdefault((step.kind, 1 + len(busy), cls), []).append(
                    (step.end - step.start) / engine)
    return out


def alone_decode_s(traces: dict[str, list[TracedStep]], wid: str) -> dict[int, list[float]]:
    """{batch: [seconds, ...]} of worker ``wid``'s decode steps run alone (no other
    worker in a step for more than ``ALONE`` of it), its first step left out."""
    ends = {w: [s.end for s in steps] for w, steps in traces.items()}
    out: dict[int, list[float]] = {}
    for step in traces[wid][1:]:
        if step.kind == "decode" and step.end > step.start and all(
                _share_in_steps(step.start, step.end, other, ends[o]) <= ALONE
                for o, other in traces.items() if o != wid):
            out.setdefault(step.batch, []).append(step.end - step.start)
    return out


def context_term(alone: dict[tuple[str, int, float], list[float]], prof: Profile,
                 min_steps: int = MIN_CTX_STEPS) -> tuple[float, list] | None:
    """The decode step's seconds per context token the traces measure: for each (role,
    batch) run alone at two or more context lengths a sequence (``alone``: {(role,
    batch, context a sequence): seconds}), each with ``min_steps`` steps, the slope
    between the shortest and the longest context's median step, in the engine's units
    (over the batch, the profile's shape at it and its one-busy decode factor); the
    median slope with the pairs used; None without such a pair. One role at a time: a
    unified worker's steps run slower than a decode worker's at the same batch. A step
    does not get cheaper with more context: a slope <= 0 says the traces cannot tell
    the term (the loads differ in more than context), and the caller keeps its own."""
    by: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for (role, batch, ctx), times in alone.items():
        if len(times) >= min_steps:
            by.setdefault((role, batch), []).append((ctx, statistics.median(times)))
    slopes, used = [], []
    for (role, batch), points in sorted(by.items()):
        if len(points) < 2:
            continue
        (c0, t0), (c1, t1) = min(points), max(points)
        if c1 <= c0:
            continue
        per = (t1 - t0) / (batch * (c1 - c0) * prof.shape(batch)
                           * prof.contended(1, "decode"))
        slopes.append(per)
        used.append([role, batch, c0, round(t0, 5), c1, round(t1, 5), per])
    return (statistics.median(slopes), used) if slopes else None


def refit_host(cp: CostProfile, factors: dict[tuple[str, int, str], list[float]],
               name: str, note: str, min_steps: int = MIN_STEPS) -> CostProfile:
    """``cp`` with its per-kind host factors (``fit.host``) from the traced factors
    (``step_factors``): one busy, the median of the steps alone; two busy, the largest
    median over the neighbour classes with ``min_steps`` steps (all two-busy steps
    pooled where none has), and each such class's weight (``neighbour_weights``: where
    its median lies between the two, in [0, 1]); factors kept from falling as busy
    grows. A (kind, busy) without enough steps keeps its factor. ``ValueError`` when
    ``cp`` has no per-kind factors or nothing had enough steps."""
    host = dict(cp.fit.get("host", {})) if isinstance(cp.fit, dict) else {}
    changed: dict[str, list] = {}
    weights: dict[str, dict[str, float]] = {}

    def med(keys: list[tuple[str, int, str]]) -> tuple[int, float] | None:
        values = [v for k in keys for v in factors.get(k, [])]
        return (len(values), statistics.median(values)) if len(values) >= min_steps \
            else None

    for kind in ("decode", "prefill"):
        f = list(host_factors(cp, kind))
        if not f:
            raise ValueError(f"profile {cp.name!r} has no fit.host {kind}_contention")
        alone = med([(kind, 1, "")])
        if alone:
            f[0] = max(1.0, round(alone[1], 3))
            changed[f"{kind} x1"] = [alone[0], round(alone[1], 3)]
        if len(f) > 1:
            per = {n: m for n in NEIGHBOURS if (m := med([(kind, 2, n)]))}
            pooled = med([k for k in factors if k[:2] == (kind, 2)])
            top = max((m[1] for m in per.values()), default=pooled[1] if pooled else None)
            if top is not None:
                f[1] = max(f[0], round(top, 3))
                changed[f"{kind} x2"] = [pooled[0] if pooled else 0, f[1]]
            for n, (count, m) in per.items():
                w = 1.0 if f[1] <= f[0] else min(1.0, max(0.0, (m - f[0]) / (f[1] - f[0])))
                weights.setdefault(kind, {})[n] = round(w, 3)
                changed[f"{kind} x2 beside {n}"] = [count, round(m, 3)]
        for k in range(1, len(f)):
            f[k] = max(f[k], f[k - 1])
        host[f"{kind}_contention"] = f
    if not changed:
        raise ValueError(f"no (kind, busy) has {min_steps} traced steps")
    host["neighbour_weights"] = weights
    host["from_traces"] = {"steps_and_median_factor": changed, "note": note}
    return dataclasses.replace(cp, name=name, fit={**cp.fit, "host": host},
                               notes=f"{cp.notes}; {note}")
