"""What ``pdserve advise`` shows: a progress bar while it searches, the ranked table,
and a plot of goodput against the split."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from services.advisor.search import Outcome, Slo, splits


class Progress:
    """tqdm when it is installed, else a one-line counter on ``out``."""

    def __init__(self, total: int, out: TextIO = sys.stderr, label: str = "simulating") -> None:
        self.total, self.done, self.out, self.label = total, 0, out, label
        try:
            from tqdm import tqdm
        except ImportError:
            self._bar = None
        else:
            self._bar = tqdm(total=total, desc=label, unit="deployment", file=out,
                             leave=False)

    def __call__(self, dep) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.set_postfix_str(dep.name)
            self._bar.update(1)
            return
        width = 30
        filled = width * self.done // self.total
        self.out.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] "
                       f"{self.done}/{self.total} {dep.name:<20}")
        self.out.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            self.out.write("\n")


def table(outcomes: list[Outcome], slo: Slo) -> str:
    """The ranked table, best first."""
    head = (f"{'rank':>4}  {'deployment':<20} {'goodput':>9} {'in SLO':>7} {'TTFT p50':>9} "
            f"{'p90':>8} {'p99':>8} {'TPOT p50':>9} {'p90':>8} {'p99':>8} {'local':>6} "
            f"{'rejected':>8}")
    runs = max((len(o.goodput_runs) for o in outcomes), default=0)
    if runs > 1:
        head += f" {'goodput range':>15}"
    rows = [f"SLOs: TTFT <= {slo.ttft_s:g} s, TPOT <= {slo.tpot_s * 1e3:g} ms; goodput in "
            "requests/s within both" + (f" (the median of {runs} noisy runs)" if runs > 1
                                        else ""), head]
    for i, o in enumerate(outcomes, 1):
        t, p = o.ttft_s, o.tpot_s
        rows.append(f"{i:>4}  {o.deployment.name:<20} {o.goodput_rps:>9.3g} "
                    f"{o.good_frac:>7.0%} {t['p50']:>8.3g}s {t['p90']:>7.3g}s "
                    f"{t['p99']:>7.3g}s {p['p50'] * 1e3:>7.4g}ms {p['p90'] * 1e3:>6.4g}ms "
                    f"{p['p99'] * 1e3:>6.4g}ms {o.local_prefills:>6} {o.rejected:>8}"
                    + (f" {o.goodput_runs[0]:>7.3g}-{o.goodput_runs[-1]:<7.3g}"
                       if runs > 1 else ""))
    return "\n".join(rows)


def plot(outcomes: list[Outcome], path: str | Path, title: str = "") -> Path | None:
    """Goodput against the number of prefill workers (0: colocated), with and without
    the pool; None when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for pool in (False, True):
        points = list(splits(outcomes, pool=pool))
        if not points:
            continue
        ax.plot([o.deployment.prefill for o in points], [o.goodput_rps for o in points],
                "o-" if not pool else "s--", label="with the pool" if pool else "no pool")
    xs = sorted({o.deployment.prefill for o in outcomes})
    n = outcomes[0].deployment.prefill + outcomes[0].deployment.decode
    ax.set_xticks(xs, ["colocated" if x == 0 else f"{x}P+{n - x}D" for x in xs], fontsize=8)
    ax.set_ylabel("goodput (requests/s within SLOs)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
