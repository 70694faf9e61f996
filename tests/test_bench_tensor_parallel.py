"""bench/tensor_parallel.py end to end on a tiny model: each side runs in a process of
its own per run (so TP=1 never shares the machine with idle TP followers), the report
has every side's step times and the TP side's collective share, and no side process
is left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster import ROOT
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(240)


def test_each_side_runs_in_a_fresh_process_and_the_report_says_what_it_measured(tmp_path):
    model = make_tiny_model(tmp_path / "tiny", "llama")
    out = tmp_path / "tp.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "tensor_parallel.py"), "--model", str(model),
         "--tp", "2", "--batch", "2", "--prompt-len", "8", "--rounds", "1", "--warmup", "0",
         "--steps", "2", "--seed", "7", "--out", str(out)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
        text=True, timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert list(report["sides"]) == ["tp1", "tp2", "tp1_1thread"]
    runs = report["runs"]
    assert [len(runs[s]) for s in ("tp1", "tp2", "tp1_1thread")] == [1, 1, 1]
    assert all(len(r[0]["steps_ms"]) == 2 for r in runs.values())
    assert runs["tp1"][0]["collective_share"] == 0
    assert 0 < runs["tp2"][0]["collective_share"] < 1
    assert runs["tp1_1thread"][0]["threads"] == 1
    assert runs["tp1"][0]["threads"] == len(os.sched_getaffinity(0))
    assert set(report["ratios"]) == {"tp1/tp2", "tp1/tp1_1thread"}
    assert report["tp_collective_share"]["n"] == 1
    assert report["settings"]["sides"] == "each in a fresh process per run"
    # The order the harness ran them in, each in its own process.
    assert [line.split(":")[0] for line in proc.stdout.splitlines()
            if line.startswith("round")] == ["round 0 tp1", "round 0 tp2", "round 0 tp1_1thread"]
    assert not [p for p in Path("/proc").glob("[0-9]*/cmdline") if _mentions(p, str(model))]


def _mentions(cmdline: Path, text: str) -> bool:
    try:
        return text.encode() in cmdline.read_bytes()
    except OSError:  # gone meanwhile
        return False
