"""bench/harness.py and bench/machine.py on fake sides with known figures: the order the
sides run in, the statistics of each side and of the per-round ratios, the machine
record, and a fresh temporary directory per run."""

from __future__ import annotations

import os
import socket
import time

import pytest

from bench import harness
from bench.harness import Metric, Session, ratios, schedule, spread
from bench.machine import cpu_info, machine_line, memory_bytes, was_busy

CPUINFO = """processor\t: 0
model name\t: Test CPU 9000
flags\t\t: fpu sse avx2 fma avx512f avx512_bf16

processor\t: 1
model name\t: Other CPU
flags\t\t: fpu
"""


def test_schedule_interleaves_sides_after_warmup():
    slots = schedule(["A", "B"], repeats=3, warmup=1)
    assert [(s.round, s.side, s.warmup) for s in slots] == [
        (0, "A", True), (0, "B", True), (1, "A", False), (1, "B", False),
        (2, "A", False), (2, "B", False), (3, "A", False), (3, "B", False)]


@pytest.mark.parametrize("args", [(["A"], 0, 0), (["A"], 1, -1), ([], 1, 0), (["A", "A"], 1, 0)])
def test_schedule_rejects_bad_plans(args):
    with pytest.raises(ValueError):
        schedule(*args)


def test_spread_of_known_values():
    s = spread([4.0, 1.0, 3.0, 2.0, 5.0])
    assert (s["median"], s["min"], s["max"], s["q1"], s["q3"], s["n"]) == (3, 1, 5, 2, 4, 5)
    assert spread([7.0]) == {"median": 7.0, "min": 7.0, "max": 7.0, "q1": 7.0, "q3": 7.0,
                             "n": 1}


def test_ratios_are_per_round_and_oriented():
    runs = {"A": [{"tok_s": 20, "ttft_s": 1.0}, {"tok_s": 30, "ttft_s": 2.0},
                  {"tok_s": 10, "ttft_s": 3.0}],
            "B": [{"tok_s": 10, "ttft_s": 2.0}, {"tok_s": 10, "ttft_s": 2.0},
                  {"tok_s": 10, "ttft_s": 1.5}]}
    metrics = [Metric("tok_s", "tok/s"), Metric("ttft_s", "TTFT", "s", higher_is_better=False)]
    r = ratios(runs, metrics)["A/B"]
    # Per round: 2, 3, 1 (not the ratio of the medians, 20/10); TTFT is B over A.
    assert (r["tok_s"]["median"], r["tok_s"]["min"], r["tok_s"]["max"]) == (2, 1, 3)
    assert (r["ttft_s"]["median"], r["ttft_s"]["min"], r["ttft_s"]["max"]) == (1, 0.5, 2)


def test_session_runs_fake_sides_interleaved_with_fresh_state(monkeypatch):
    monkeypatch.setattr(harness, "machine_info", lambda: {"cpu_model": "x", "usable_cores": 2})
    order, dirs = [], []

    def side(name, value):
        def run(ctx):
            order.append((name, ctx.round, ctx.warmup))
            assert ctx.tmp.is_dir() and not any(ctx.tmp.iterdir())  # fresh and empty
            (ctx.tmp / "ssd-block").write_bytes(b"x")  # would leak into the next run
            dirs.append(ctx.tmp)
            port = ctx.port()
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))  # free, and ours to bind
            return {"tok_s": value * (ctx.round + 1), "seed": ctx.seed}
        return run

    session = Session("fake", settings={"threads": 2}, seed=100, log=lambda _: None)
    runs = session.run({"A": side("A", 3.0), "B": side("B", 1.0)}, repeats=3, warmup=1)
    assert order == [("A", 0, True), ("B", 0, True), ("A", 1, False), ("B", 1, False),
                     ("A", 2, False), ("B", 2, False), ("A", 3, False), ("B", 3, False)]
    assert len(set(dirs)) == 8 and not any(d.exists() for d in dirs)
    # One seed per round, shared by both sides.
    assert [r["seed"] for r in runs["A"]] == [r["seed"] for r in runs["B"]] == [101, 102, 103]
    report = session.finish([Metric("tok_s", "tok/s")], runs)
    assert report["sides"]["A"]["tok_s"]["median"] == 9.0  # rounds 1..3: 6, 9, 12
    assert report["sides"]["B"]["tok_s"]["median"] == 3.0
    assert report["ratios"]["A/B"]["tok_s"] == spread([3.0, 3.0, 3.0])
    assert (report["repeats"], report["warmup"], report["seed"]) == (3, 1, 100)
    assert report["settings"] == {"threads": 2}
    assert {"load_before", "load_after", "other_cores_used"} <= set(report["machine"])


def test_session_draws_a_seed_when_none_given(monkeypatch):
    monkeypatch.setattr(harness, "machine_info", lambda: {})
    seeds = {Session("x", log=lambda _: None).seed for _ in range(5)}
    assert len(seeds) > 1


def test_busy_machine_is_flagged(monkeypatch, capsys):
    monkeypatch.setattr(harness, "machine_info", lambda: {"usable_cores": 2})
    monkeypatch.setattr(harness, "load_average", lambda: [0.1, 0.1, 0.1])
    clock = iter([(100.0, 1.0), (10_000.0, 1.0)])  # others kept the cores busy
    monkeypatch.setattr(harness, "_cpu_seconds", lambda: next(clock))
    session = Session("busy", seed=1, log=lambda _: None)
    runs = session.run({"A": lambda ctx: {"v": 1.0}}, repeats=1, warmup=0)
    report = session.finish([Metric("v", "v")], runs)
    assert report["busy"] is True and report["machine"]["other_cores_used"] > 0.25
    assert "WARNING: the machine was busy" in capsys.readouterr().err


def test_load_left_by_an_earlier_run_alone_is_not_busy(monkeypatch, capsys):
    # `make bench`: the load average still counts the benchmark that just ended, while
    # nothing else uses the cores during this one.
    monkeypatch.setattr(harness, "machine_info", lambda: {"usable_cores": 2})
    monkeypatch.setattr(harness, "load_average", lambda: [2.0, 1.5, 1.0])
    monkeypatch.setattr(harness, "_cpu_seconds", lambda: (100.0, 1.0))
    session = Session("after", seed=1, log=lambda _: None)
    report = session.finish([Metric("v", "v")], session.run(
        {"A": lambda ctx: {"v": 1.0}}, repeats=1, warmup=0))
    assert report["busy"] is False
    assert "WARNING" not in capsys.readouterr().err
    # Where the CPU time of others could not be read, the load average decides.
    assert was_busy({**report["machine"], "cpu_measured": False}) is True


def test_machine_info_keys_and_parsers():
    assert cpu_info(CPUINFO) == {"cpu_model": "Test CPU 9000",
                                 "cpu_flags": ["avx2", "avx512_bf16", "avx512f", "fma",
                                               "fpu", "sse"]}
    assert memory_bytes("MemFree: 5 kB\nMemTotal:  2048 kB\n") == 2048 * 1024
    info = harness.machine_info()
    assert {"cpu_model", "cpu_flags", "cores", "usable_cores", "memory_bytes", "python",
            "torch", "transformers", "git_commit"} <= set(info)
    assert info["cores"] >= 1 and info["memory_bytes"] > 0
    line = machine_line({**cpu_info(CPUINFO), "usable_cores": 2, "memory_bytes": 24 << 30,
                         "python": "3.11.9", "torch": "2.13.0", "transformers": "5.24.0",
                         "load_before": [0.5, 0, 0], "load_after": [2.0, 0, 0],
                         "git_commit": "0123456789abcdef"})
    assert line == ("Machine: Test CPU 9000 (avx2, fma, avx512f, avx512_bf16); 2 cores; "
                    "24 GiB; python 3.11.9, torch 2.13.0, transformers 5.24.0; "
                    "load 0.50 → 2.00; commit 0123456789ab")


def test_quiet_machine_is_not_flagged(monkeypatch, capsys):
    monkeypatch.setattr(harness, "machine_info", lambda: {"usable_cores": 2})
    monkeypatch.setattr(harness, "load_average", lambda: [0.1, 0.1, 0.1])
    monkeypatch.setattr(harness, "_cpu_seconds", lambda: (100.0, 1.0))
    session = Session("quiet", seed=1, log=lambda _: None)
    report = session.finish([Metric("v", "v")], session.run(
        {"A": lambda ctx: {"v": 1.0}}, repeats=1, warmup=0))
    assert report["busy"] is False and report["machine"]["other_cores_used"] == 0
    assert "WARNING" not in capsys.readouterr().err


def test_live_child_processes_count_as_ours():
    # A server a benchmark keeps running across rounds is its own work, not other load.
    import subprocess
    import sys as _sys

    proc = subprocess.Popen([_sys.executable, "-c",
                             "import time\nt = time.process_time()\n"
                             "while time.process_time() - t < 0.6: pass\n"
                             "time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while harness._live_descendants_cpu(os.getpid()) < 0.5 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert harness._live_descendants_cpu(os.getpid()) >= 0.5
        assert proc.poll() is None  # still running: os.times has not counted it
    finally:
        proc.kill()
        proc.wait()
