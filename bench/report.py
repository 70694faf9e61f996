"""Regenerate the tables of docs/benchmarks.md from the JSON the benchmarks wrote, so
that no figure there is typed by hand.

    python bench/report.py [--results bench/results] [--doc docs/benchmarks.md] [--check]

A section of the document between

    <!-- bench:NAME -->
    ...
    <!-- /bench:NAME -->

is replaced by the table of ``<results>/NAME.json`` (a report of bench/harness.py): the
machine line, the settings, then one row per metric with each side's median [min, max]
and the per-round ratio of the first side against each other one, named for what it
divides: a rate the first side's by the other's, a time the other side's by the first's
(bench/harness.py ``ratios``), so > 1× always means the first side did better. Sections
whose JSON is absent are left as they are (and named on stderr); text outside the
markers is never touched.
``--check`` exits 1 instead of writing when the document would change.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import machine_line, was_busy  # noqa: E402

SECTION = re.compile(r"(<!-- bench:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)"
                     r"(<!-- /bench:(?P=name) -->)", re.S)


def fmt(x: float) -> str:
    """Three significant figures at most, thousands separated: 0.0123, 4.56, 78.9, 1,234."""
    if x != x or x in (float("inf"), float("-inf")):
        return str(x)
    a = abs(x)
    if a >= 100:
        return f"{x:,.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def cell(s: dict, unit: str = "") -> str:
    return f"{fmt(s['median'])}{unit} [{fmt(s['min'])}, {fmt(s['max'])}]"


def quotient(pair: str, metric: dict) -> str:
    """What the harness's ratio of ``pair`` ("first/other") divides for ``metric``."""
    first, other = pair.split("/", 1)
    return f"{first} ÷ {other}" if metric["higher_is_better"] else f"{other} ÷ {first}"


def render(report: dict, source: str) -> str:
    """The markdown of one report (without the markers)."""
    sides, pairs = list(report["sides"]), list(report["ratios"])
    n = min(t[next(iter(t))]["n"] for t in report["sides"].values())
    lines = [f"{machine_line(report['machine'])}.",
             f"Generated from `{source}` (median [min, max] of {n} interleaved rounds"
             f"{', after warm-up' if report.get('warmup') else ''}; "
             f"seed {report.get('seed')}).",
             ""]
    if was_busy(report["machine"]) if "machine" in report else report.get("busy"):
        lines[1] += " **The machine was busy during this run: figures are noisy.**"
    settings = report.get("settings", {})
    if settings:
        lines += ["Settings: " + ", ".join(f"`{k}={v}`" for k, v in settings.items()) + ".",
                  ""]
    head = [*sides, *(f"{p.replace('/', ' vs ')} (per round)" for p in pairs)]
    lines += ["| | " + " | ".join(head) + " |", "|" + "---|" * (len(head) + 1)]
    for m in report["metrics"]:
        label = m["label"] + (f" ({m['unit']})" if m["unit"] else "")
        row = [label, *(cell(report["sides"][s][m["key"]]) for s in sides)]
        row += [f"**{fmt(report['ratios'][p][m['key']]['median'])}×** {quotient(p, m)} "
                f"[{fmt(report['ratios'][p][m['key']]['min'])}, "
                f"{fmt(report['ratios'][p][m['key']]['max'])}]" for p in pairs]
        lines.append("| " + " | ".join(row) + " |")
    if pairs:
        lines += ["", "Ratios, per round: each cell names its quotient (a rate is the "
                  "first side's over the other's, a time the other's over the first's), "
                  "so > 1× means the first side did better."]
    return "\n".join(lines) + "\n"


def regenerate(doc: str, results: Path, root: Path = ROOT) -> tuple[str, list[str], list[str]]:
    """(new document text, sections rewritten, sections whose JSON is missing)."""
    done, missing = [], []

    def sub(match: re.Match) -> str:
        name = match["name"]
        path = results / f"{name}.json"
        if not path.exists():
            missing.append(name)
            return match.group(0)
        report = json.loads(path.read_text())
        try:
            source = str(path.resolve().relative_to(root))
        except ValueError:
            source = path.name
        done.append(name)
        return match.group(1) + render(report, source) + match.group(4)

    return SECTION.sub(sub, doc), done, missing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--doc", default=str(ROOT / "docs" / "benchmarks.md"))
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if the document is not up to date; write nothing")
    args = ap.parse_args(argv)
    doc = Path(args.doc)
    old = doc.read_text()
    new, done, missing = regenerate(old, Path(args.results))
    for name in missing:
        print(f"report: no {name}.json under {args.results}; section left as is",
              file=sys.stderr)
    if args.check:
        return int(new != old)
    if new != old:
        doc.write_text(new)
    print(f"report: {len(done)} section(s) regenerated in {doc}: {', '.join(done) or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
