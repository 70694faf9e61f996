"""The harness every comparative benchmark runs on: interleaved sides, repeats, spread,
a fresh state per run, and the machine written down beside the figures.

    session = Session("throughput", settings={"dtype": "float32", "threads": 2})
    runs = session.run({"pdserve": run_ours, "transformers": run_theirs},
                       repeats=3, warmup=1)
    report = session.finish(METRICS, runs)     # the JSON written to bench/results/

Why each part:

* Sides run interleaved, A, B, A, B, ... (``schedule``), never all of A then all of B:
  load that lands on the machine for a while then hits both sides alike, and the ratio
  is taken per round (A_i over B_i), so a slow round moves both of its halves.
* Warm-up rounds run the same schedule and are dropped; every round gets one seed that
  all sides share (the same prompts), drawn at random per session unless given, so a
  second session does not replay cached prompts.
* Each run gets a ``RunContext`` with its own temporary directory (removed afterwards:
  no SSD tier, log or socket survives into the next run) and free ports.
* Figures are the median with min, max and the quartiles, of each side and of the
  per-round ratios; ``better`` says which way a metric improves, and ratios are
  oriented so that > 1 means the first side did better.
* The machine (bench/machine.py), the load average before and after, and the CPU time
  other processes took meanwhile are recorded; a busy machine prints a warning.
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from bench.machine import load_average, machine_info, was_busy
from tests.cluster import free_port  # one set of handed-out ports for clusters and runs

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"



@dataclass(frozen=True, slots=True)
class Metric:
    """One figure a side returns: its key, how a table names it, and which way is better."""

    key: str
    label: str
    unit: str = ""
    higher_is_better: bool = True


@dataclass(frozen=True, slots=True)
class Slot:
    """One place in the schedule."""

    round: int  # 0.. over warm-up and measured rounds together
    side: str
    warmup: bool


@dataclass(frozen=True, slots=True)
class RunContext:
    """What one run of one side gets: its seed (shared by the sides of its round), a
    temporary directory of its own, and free ports on request."""

    side: str
    round: int
    warmup: bool
    seed: int
    tmp: Path

    def port(self) -> int:
        return free_port()


def schedule(sides: list[str], repeats: int, warmup: int) -> list[Slot]:
    """Warm-up rounds, then measured ones; each round runs every side once, in order."""
    if repeats < 1 or warmup < 0 or not sides:
        raise ValueError(f"need sides, repeats >= 1 and warmup >= 0 (got {sides!r}, "
                         f"{repeats}, {warmup})")
    if len(set(sides)) != len(sides):
        raise ValueError(f"side names must differ: {sides!r}")
    return [Slot(r, s, r < warmup) for r in range(warmup + repeats) for s in sides]


def spread(values: list[float]) -> dict:
    """Median, min, max and quartiles (inclusive method) of ``values``."""
    if not values:
        raise ValueError("no values")
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") \
        if len(values) > 1 else (values[0],) * 3
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "q1": q1, "q3": q3, "n": len(values)}


def ratios(runs: Mapping[str, list[dict]], metrics: list[Metric]) -> dict:
    """Per-round ratios of the first side over each other one, per metric, as spreads;
    oriented so that > 1 means the first side did better."""
    names = list(runs)
    first, out = names[0], {}
    for other in names[1:]:
        table = {}
        for m in metrics:
            per = []
            for a, b in zip(runs[first], runs[other], strict=True):
                num, den = (a[m.key], b[m.key]) if m.higher_is_better else (b[m.key], a[m.key])
                per.append(num / den if den else float("inf"))
            table[m.key] = spread(per)
        out[f"{first}/{other}"] = table
    return out


def _cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, CPU seconds of this process, its reaped
    children and its live descendants), both since boot/start."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        hz = os.sysconf("SC_CLK_TCK")
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / hz  # all but idle and iowait
    except (OSError, ValueError, IndexError):
        busy = 0.0
    t = os.times()
    return busy, (t.user + t.system + t.children_user + t.children_system
                  + _live_descendants_cpu(os.getpid()))


def _live_descendants_cpu(pid: int) -> float:
    """CPU seconds of ``pid``'s descendants still running (a benchmark's long-lived
    servers): ``os.times`` counts a child only once it has been reaped, and without
    these a run would count its own processes as other load."""
    total, todo, hz = 0.0, [pid], os.sysconf("SC_CLK_TCK")
    while todo:
        parent = todo.pop()
        try:
            tasks = list(Path(f"/proc/{parent}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
            for child in children:
                try:  # utime and stime follow the parenthesised command name
                    stat = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()
                    total += (int(stat[11]) + int(stat[12])) / hz
                except (OSError, ValueError, IndexError):
                    continue
                todo.append(child)
    return total


@dataclass
class Session:
    """One benchmark invocation: samples the machine at creation, runs the schedule,
    and builds the report at ``finish``."""

    name: str
    settings: dict = field(default_factory=dict)
    seed: int | None = None
    log: Callable[[str], None] = print
    repeats: int = field(default=0, init=False)
    warmup: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.seed is None:
            self.seed = random.SystemRandom().randrange(1 << 31)
        self.machine = machine_info()
        self.machine["load_before"] = load_average()
        self._t0 = time.monotonic()
        self._cpu0 = _cpu_seconds()

    def run(self, sides: Mapping[str, Callable[[RunContext], dict]], *, repeats: int,
            warmup: int = 1) -> dict[str, list[dict]]:
        """Every side ``warmup + repeats`` times, interleaved; the measured runs' figures
        per side, in round order."""
        self.repeats, self.warmup = repeats, warmup
        runs: dict[str, list[dict]] = {s: [] for s in sides}
        for slot in schedule(list(sides), repeats, warmup):
            tmp = Path(tempfile.mkdtemp(prefix=f"bench-{self.name}-{slot.side}-"))
            ctx = RunContext(slot.side, slot.round, slot.warmup, self.seed + slot.round, tmp)
            try:
                figures = dict(sides[slot.side](ctx))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            tag = "warm-up" if slot.warmup else f"round {slot.round - warmup}"
            self.log(f"{tag} {slot.side}: " + ", ".join(
                f"{k} {v:.4g}" for k, v in figures.items() if isinstance(v, (int, float))))
            if not slot.warmup:
                runs[slot.side].append(figures)
        return runs

    def finish(self, metrics: list[Metric], runs: Mapping[str, list[dict]],
               extra: Mapping | None = None) -> dict:
        """The report: settings, machine, each side's spread, the ratios, the raw runs."""
        wall = time.monotonic() - self._t0
        busy0, ours0 = self._cpu0
        busy1, ours1 = _cpu_seconds()
        other = max(0.0, (busy1 - busy0) - (ours1 - ours0)) / wall if wall > 0 else 0.0
        self.machine["load_after"] = load_average()
        self.machine["other_cores_used"] = round(other, 3)
        self.machine["cpu_measured"] = busy1 > 0  # /proc/stat was there to read
        cores = self.machine.get("usable_cores") or 1
        before = self.machine["load_before"][0] if self.machine["load_before"] else 0.0
        busy = was_busy(self.machine)
        if busy:
            print(f"WARNING: the machine was busy (load average {before:.2f} before on "
                  f"{cores} cores; other processes used {other:.2f} cores during the "
                  f"run): treat these figures as noisy", file=sys.stderr)
        return {"benchmark": self.name, "settings": dict(self.settings), "seed": self.seed,
                "repeats": self.repeats, "warmup": self.warmup,
                "machine": self.machine, "busy": busy, "wall_s": round(wall, 1),
                "metrics": [{"key": m.key, "label": m.label, "unit": m.unit,
                             "higher_is_better": m.higher_is_better} for m in metrics],
                "sides": {s: {m.key: spread([r[m.key] for r in rows]) for m in metrics}
                          for s, rows in runs.items()},
                "ratios": ratios(runs, metrics), "runs": dict(runs), **(extra or {})}


def settings_line(settings: Mapping) -> str:
    return "settings: " + ", ".join(f"{k}={v}" for k, v in settings.items())


def print_summary(report: dict) -> None:
    """The settings, then each metric: every side's median [min, max] and the ratios."""
    print(settings_line(report["settings"]))
    for m in report["metrics"]:
        cells = [f"{s} {t[m['key']]['median']:.4g} [{t[m['key']]['min']:.4g}, "
                 f"{t[m['key']]['max']:.4g}]" for s, t in report["sides"].items()]
        cells += [f"{pair} {t[m['key']]['median']:.2f}x [{t[m['key']]['min']:.2f}, "
                  f"{t[m['key']]['max']:.2f}]" for pair, t in report["ratios"].items()]
        print(f"{m['label']}{' (' + m['unit'] + ')' if m['unit'] else ''}: "
              + "   ".join(cells))


def write(report: dict, path: Path) -> Path:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path
