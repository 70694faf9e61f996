"""bench/report.py: the marked sections of a document are rewritten from a small
harness report, and nothing else is touched."""

from __future__ import annotations

import json

from bench.report import fmt, main, regenerate, render

REPORT = {
    "benchmark": "throughput", "seed": 42, "repeats": 3, "warmup": 1, "busy": False,
    "settings": {"dtype": "float32", "threads": 2},
    "machine": {"cpu_model": "Test CPU", "cpu_flags": ["avx2"], "usable_cores": 2,
                "memory_bytes": 8 << 30, "python": "3.11.9", "torch": "2.13.0",
                "transformers": "5.24.0", "load_before": [0.25, 0, 0],
                "load_after": [1.5, 0, 0], "git_commit": "abcdef0123456789"},
    "metrics": [{"key": "tok_s", "label": "output", "unit": "tok/s", "higher_is_better": True},
                {"key": "ttft_s", "label": "TTFT", "unit": "s", "higher_is_better": False}],
    "sides": {
        "pdserve": {"tok_s": {"median": 135.3, "min": 130.0, "max": 1500.0, "n": 3},
                    "ttft_s": {"median": 0.4412, "min": 0.36, "max": 0.47, "n": 3}},
        "transformers": {"tok_s": {"median": 73.1, "min": 70.0, "max": 75.25, "n": 3},
                         "ttft_s": {"median": 0.32, "min": 0.31, "max": 0.4, "n": 3}}},
    "ratios": {"pdserve/transformers": {
        "tok_s": {"median": 1.85, "min": 1.7, "max": 1.9, "n": 3},
        "ttft_s": {"median": 0.89, "min": 0.65, "max": 0.91, "n": 3}}},
}

DOC = """# Benchmarks

Hand-written text stays.

<!-- bench:throughput -->
old table
<!-- /bench:throughput -->

Between the sections.

<!-- bench:absent -->
kept as is
<!-- /bench:absent -->
"""

TABLE = """<!-- bench:throughput -->
Machine: Test CPU (avx2); 2 cores; 8 GiB; python 3.11.9, torch 2.13.0, transformers 5.24.0; \
load 0.25 → 1.50; commit abcdef012345.
Generated from `throughput.json` (median [min, max] of 3 interleaved rounds, after \
warm-up; seed 42).

Settings: `dtype=float32`, `threads=2`.

| | pdserve | transformers | pdserve vs transformers (per round) |
|---|---|---|---|
| output (tok/s) | 135 [130, 1,500] | 73.1 [70.0, 75.2] | \
**1.85×** pdserve ÷ transformers [1.70, 1.90] |
| TTFT (s) | 0.441 [0.36, 0.47] | 0.32 [0.31, 0.4] | **0.89×** transformers ÷ pdserve [0.65, 0.91] |

Ratios, per round: each cell names its quotient (a rate is the first side's over the \
other's, a time the other's over the first's), so > 1× means the first side did better.
<!-- /bench:throughput -->
"""


def test_fmt_keeps_three_figures():
    assert [fmt(x) for x in (0.012345, 4.567, 78.91, 1234.5, 0.0)] == \
        ["0.0123", "4.57", "78.9", "1,234", "0"]


def test_regenerate_rewrites_only_marked_sections(tmp_path):
    (tmp_path / "throughput.json").write_text(json.dumps(REPORT))
    new, done, missing = regenerate(DOC, tmp_path, root=tmp_path / "elsewhere")
    assert (done, missing) == (["throughput"], ["absent"])
    assert TABLE in new
    assert "old table" not in new
    assert new.startswith("# Benchmarks\n\nHand-written text stays.\n\n")
    assert "\n\nBetween the sections.\n\n<!-- bench:absent -->\nkept as is\n" in new
    # Idempotent: a second pass over its own output changes nothing.
    assert regenerate(new, tmp_path, root=tmp_path / "elsewhere")[0] == new


def test_busy_report_says_so(tmp_path):
    busy = {**REPORT, "busy": True, "machine": {**REPORT["machine"], "other_cores_used": 0.9}}
    (tmp_path / "throughput.json").write_text(json.dumps(busy))
    new, _, _ = regenerate(DOC, tmp_path)
    assert "**The machine was busy during this run: figures are noisy.**" in new
    # Judged from what the machine record says: others used next to no CPU.
    quiet = {**busy, "machine": {**REPORT["machine"], "load_before": [3.0, 0, 0],
                                 "other_cores_used": 0.01}}
    (tmp_path / "throughput.json").write_text(json.dumps(quiet))
    assert "busy" not in regenerate(DOC, tmp_path)[0]


def test_main_writes_and_checks(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC)
    (tmp_path / "throughput.json").write_text(json.dumps(REPORT))
    args = ["--results", str(tmp_path), "--doc", str(doc)]
    assert main([*args, "--check"]) == 1 and doc.read_text() == DOC  # stale, untouched
    assert main(args) == 0
    assert "| output (tok/s) | 135 [130, 1,500]" in doc.read_text()
    assert main([*args, "--check"]) == 0


def test_a_ratio_is_labelled_with_the_quotient_it_is():
    """lone_prompt's ratio is disaggregated TTFT ÷ colocated TTFT (the harness divides
    the other side's time by the first's); the table must say so, not "colocated /
    disaggregated". The number comes from the harness itself, so label and value agree."""
    from bench.harness import Metric, spread
    from bench.harness import ratios as harness_ratios

    metrics = [Metric("ttft_s", "TTFT", "s", higher_is_better=False),
               Metric("tok_s", "decode", "tok/s")]
    runs = {"colocated": [{"ttft_s": 1.0, "tok_s": 20.0}, {"ttft_s": 2.0, "tok_s": 20.0}],
            "disaggregated": [{"ttft_s": 1.2, "tok_s": 10.0}, {"ttft_s": 2.4, "tok_s": 10.0}]}
    report = {**REPORT, "metrics": [{"key": m.key, "label": m.label, "unit": m.unit,
                                     "higher_is_better": m.higher_is_better} for m in metrics],
              "sides": {s: {m.key: spread([r[m.key] for r in rows]) for m in metrics}
                        for s, rows in runs.items()},
              "ratios": harness_ratios(runs, metrics)}
    table = render(report, "lone_prompt.json")
    assert "colocated / disaggregated" not in table
    assert "| colocated vs disaggregated (per round) |" in table
    assert "| TTFT (s) | 1.50 [1.00, 2.00] | 1.80 [1.20, 2.40] | " \
           "**1.20×** disaggregated ÷ colocated [1.20, 1.20] |" in table
    assert "| decode (tok/s) | 20.0 [20.0, 20.0] | 10.0 [10.0, 10.0] | " \
           "**2.00×** colocated ÷ disaggregated [2.00, 2.00] |" in table
