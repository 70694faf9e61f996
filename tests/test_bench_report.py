"""bench/report.py: the marked sections of a document are rewritten from a small
harness report, and nothing else is touched."""

from __future__ import annotations

import json

from bench.report import fmt, main, regenerate

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

| | pdserve | transformers | pdserve / transformers (per round) |
|---|---|---|---|
| output (tok/s) | 135 [130, 1,500] | 73.1 [70.0, 75.2] | **1.85×** [1.70, 1.90] |
| TTFT (s) | 0.441 [0.36, 0.47] | 0.32 [0.31, 0.4] | **0.89×** [0.65, 0.91] |

Ratios: > 1× means the first side did better (faster, or more tokens per second).
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
    (tmp_path / "throughput.json").write_text(json.dumps({**REPORT, "busy": True}))
    new, _, _ = regenerate(DOC, tmp_path)
    assert "**The machine was busy during this run: figures are noisy.**" in new


def test_main_writes_and_checks(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC)
    (tmp_path / "throughput.json").write_text(json.dumps(REPORT))
    args = ["--results", str(tmp_path), "--doc", str(doc)]
    assert main([*args, "--check"]) == 1 and doc.read_text() == DOC  # stale, untouched
    assert main(args) == 0
    assert "| output (tok/s) | 135 [130, 1,500]" in doc.read_text()
    assert main([*args, "--check"]) == 0
