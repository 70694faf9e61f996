"""kernels/cpu_build.py: a process that exits while a kernel builds in the background
waits for the build (a loader thread stopped inside C++ at exit aborts the process)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_exit_waits_for_a_background_build(tmp_path: Path) -> None:
    marker = tmp_path / "built"
    script = textwrap.dedent(f"""
        import time
        from kernels.cpu_build import CppKernel

        class Slow(CppKernel):
            def module(self):  # stands in for a compile: slow, then records it finished
                time.sleep(1.0)
                open({str(marker)!r}, "w").write("done")
                self._built.append(None)
                return None

        assert Slow("slow", "", "torch path").ready() is False  # started, not waited for
        print("exiting", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={"PYTHONPATH": str(ROOT),
                                                      "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "exiting"
    assert marker.read_text() == "done"  # the process left only once the build ended
