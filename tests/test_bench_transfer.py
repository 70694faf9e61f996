"""bench/transfer.py end to end on tcp at its smallest: a round is as many whole
transfers as ``--round-mib`` asks, the same count on both sides, and each side's CPU
is split into its two processes."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_1mib(tmp_path: Path, backend: str, round_mib: str) -> dict:
    """bench/transfer.py at 1 MiB, three measured rounds: the cell's harness report."""
    done = subprocess.run(
        [sys.executable, "bench/transfer.py", "--sizes", "1", "--backends", backend,
         "--scale", "0.1", "--round-mib", round_mib, "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads((tmp_path / f"transfer-{backend}-1mib.json").read_text())


def test_rounds_of_several_transfers_and_the_cpu_split(tmp_path: Path) -> None:
    report = run_1mib(tmp_path, "tcp", "3")
    settings = report["settings"]
    # 30 layers of two 24 KiB blocks: 1,474,560 bytes, so 3 MiB takes three of them.
    assert settings["bytes"] == 1_474_560
    assert settings["loop"] in ("uvloop", "asyncio")  # what it was measured on
    assert settings["transfers_per_round"] == math.ceil(3 * (1 << 20) / 1_474_560) == 3
    # Each sender waits for its own word that all landed, once a transfer.
    assert settings["transfer_ends"] == {"backend": "its verdict (finish)",
                                         "limit": "the receiver's stdout line",
                                         "checked": "the receiver's stdout line"}
    # tcp runs a third side, its limit with the checksum, and is divided by it too.
    assert "xxh3_64 of each batch" in settings["checked"]
    assert set(report["ratios"]) == {"backend/limit", "backend/checked"}
    for side in ("backend", "limit", "checked"):
        runs = report["runs"][side]
        assert len(runs) == 3  # max(3, round(0.1 * 31)) measured rounds
        for run in runs:
            assert run["cpu_ms"] == run["send_cpu_ms"] + run["recv_cpu_ms"]
            assert run["send_cpu_ms"] > 0 and run["recv_cpu_ms"] > 0
            # Three transfers' bytes in the round's wall time.
            assert math.isclose(run["gbps"], 3 * 1_474_560 / run["seconds"] / 1e9)
    assert {m["key"] for m in report["metrics"]} == {
        "gbps", "cpu_ms", "send_cpu_ms", "recv_cpu_ms"}


def test_checked_tcp_limit_lands_and_checks_each_batch() -> None:
    """The checked limit's receiver says "done" after a last batch whose checksum holds,
    nothing after one that is not the last, and dies on one that does not hold."""
    import socket

    import xxhash

    sys.path.insert(0, str(ROOT))
    from bench.transfer_limits import _CHECKED_HEAD

    proc = subprocess.Popen([sys.executable, "bench/transfer.py", "--serve", "raw", "tcp",
                             "checked"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline().removeprefix("addr "))
        a, b = bytes(range(256)) * 40, b"x" * 70_000
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(_CHECKED_HEAD.pack(len(a), xxhash.xxh3_64_intdigest(a), 0) + a)
            sock.sendall(_CHECKED_HEAD.pack(len(b), xxhash.xxh3_64_intdigest(b), 1) + b)
            assert proc.stdout.readline().startswith("done ")  # after the last one only
            sock.sendall(_CHECKED_HEAD.pack(len(b), xxhash.xxh3_64_intdigest(a), 1) + b)
            assert proc.wait(timeout=30) != 0
        assert proc.stdout.read() == ""  # no "done" for the spoiled batch
    finally:
        proc.kill()
        proc.wait()


def test_shm_limit_wakes_its_receiver_per_group() -> None:
    sys.path.insert(0, str(ROOT))
    from bench.transfer_limits import shm_groups

    # ~sqrt(bytes / 300 kB) groups, at least one, at most one a message.
    assert [shm_groups(30, n) for n in (1_474_560, 16_957_440, 281_018_368)] == [2, 8, 30]
    assert shm_groups(30, 1000) == 1 and shm_groups(4, 281_018_368) == 4


def test_shm_cell_end_to_end(tmp_path: Path) -> None:
    report = run_1mib(tmp_path, "shm", "0")
    assert "after each group" in report["settings"]["limit"]
    for side in ("backend", "limit"):
        runs = report["runs"][side]
        assert len(runs) == 3 and all(r["gbps"] > 0 and r["recv_cpu_ms"] > 0 for r in runs)


def test_both_processes_run_on_the_services_loop(monkeypatch) -> None:
    import asyncio

    from bench import transfer

    monkeypatch.delenv("PDSERVE_BENCH_LOOP", raising=False)
    try:
        import uvloop
    except ImportError:
        assert transfer.loop_factory() is None
    else:
        assert transfer.loop_factory() is uvloop.new_event_loop
        with asyncio.Runner(loop_factory=transfer.loop_factory()) as runner:
            # What the report's settings name: the loop's package.
            assert type(runner.get_loop()).__module__.partition(".")[0] == "uvloop"
    monkeypatch.setenv("PDSERVE_BENCH_LOOP", "asyncio")
    assert transfer.loop_factory() is None
