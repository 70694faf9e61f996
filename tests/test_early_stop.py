"""A worker stopped while it is still importing and loading (a planner scaling in a
worker it has just started) exits 0 without serving, not killed by the signal."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.cluster import free_port


def test_sigterm_while_starting_exits_cleanly(tmp_path):
    cmd = [sys.executable, "-m", "services.decode", "--model", "no-such-model-dir",
           "--control-addr", f"tcp://127.0.0.1:{free_port()}",
           "--conductor-addr", f"tcp://127.0.0.1:{free_port()}",
           "--heartbeat-addr", f"tcp://127.0.0.1:{free_port()}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            cwd=Path(__file__).resolve().parent.parent)
    time.sleep(0.3)  # inside the imports: long before the event loop's handlers exist
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out.decode(errors="replace")[-2000:]
