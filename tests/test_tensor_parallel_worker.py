"""A worker with ``--tensor-parallel-size 2``: its follower lives and dies with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.worker.settings import WorkerSettings
from tests.cluster import ROOT, free_port
from tests.tiny_models import make_tiny_model


def start_worker(model: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PDSERVE_LOG_FORMAT": "console",
           "PDSERVE_CURVE_KEYS_DIR": ""}
    return subprocess.Popen(
        [sys.executable, "-m", "services.unified", "--model", str(model), "--dtype", "float64",
         "--tensor-parallel-size", "2", "--kv-cache-mib", "4",
         "--control-addr", f"tcp://127.0.0.1:{free_port()}",
         # Nobody answers there: the worker keeps asking and serves meanwhile.
         "--conductor-addr", f"tcp://127.0.0.1:{free_port()}",
         "--heartbeat-addr", f"tcp://127.0.0.1:{free_port()}"],
        cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def wait_started(proc: subprocess.Popen, log: Path, timeout_s: float = 90) -> int:
    """The follower's pid, once the worker says it started."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited {proc.returncode}:\n{log.read_text()}")
        if "worker started" in log.read_text(errors="replace"):
            # Started from the engine thread: the children are listed under that task.
            children = [c for task in Path(f"/proc/{proc.pid}/task").iterdir()
                        for c in (task / "children").read_text().split()]
            assert len(children) == 1, children
            return int(children[0])
        time.sleep(0.2)
    raise TimeoutError(log.read_text())


def gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.split(")")[-1].split()[0] == "Z"  # a zombie has exited


def test_follower_killed_takes_worker_down_then_clean_stop(tmp_path):
    model = make_tiny_model(tmp_path / "llama")
    # A follower SIGKILLed: the worker logs it, exits non-zero, leaves nothing behind.
    log = tmp_path / "killed.log"
    worker = start_worker(model, log)
    try:
        follower = wait_started(worker, log)
        os.kill(follower, signal.SIGKILL)
        code = worker.wait(timeout=45)
    finally:
        worker.kill()
    text = log.read_text(errors="replace")
    assert code != 0, text
    assert "tensor-parallel engine is dead" in text and "rank 1" in text, text
    assert gone(follower)

    # A planned stop (SIGTERM): exit 0, and the follower stopped with it.
    log = tmp_path / "stopped.log"
    worker = start_worker(model, log)
    try:
        follower = wait_started(worker, log)
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(timeout=45)
    finally:
        worker.kill()
    assert code == 0, log.read_text()
    deadline = time.monotonic() + 10
    while not gone(follower) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(follower)


def test_tensor_parallel_settings():
    # KV moves in the all-heads layout: every role, and the cache pool, take TP > 1.
    for role in ("unified", "prefill", "decode"):
        assert WorkerSettings(role=role, tensor_parallel_size=2).tensor_parallel_size == 2
    assert WorkerSettings(tensor_parallel_size=2,
                          cache_pools="tcp://127.0.0.1:1").cache_pools == "tcp://127.0.0.1:1"
    with pytest.raises(ValueError, match=">= 1"):
        WorkerSettings(tensor_parallel_size=0)
