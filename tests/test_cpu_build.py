"""kernels/cpu_build.py: a built kernel is imported from its recorded file (no compiler,
no build lock); a process exits at once while a compile runs in the background, and
waits only for a load that is not a compile (a loader thread stopped inside C++ at exit
aborts the process)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_script(body: str, timeout: float = 60) -> subprocess.CompletedProcess:
    script = "import time\nfrom kernels.cpu_build import CppKernel\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_exit_does_not_wait_for_a_compile() -> None:
    started = time.monotonic()
    done = run_script("""
        class Stuck(CppKernel):
            def _compile(self):  # a compile that never ends (say, a lock never freed)
                time.sleep(3600)

        Stuck("pdserve_test_stuck", "int f();", "torch path").ready()
        time.sleep(0.5)
        print("exiting", flush=True)
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "exiting"
    assert time.monotonic() - started < 30  # torch's import takes most of it


def test_exit_waits_for_a_load_in_progress(tmp_path: Path) -> None:
    marker = tmp_path / "imported"
    done = run_script(f"""
        class SlowImport(CppKernel):
            def _load(self):  # stands in for finding and importing a built file
                time.sleep(1.0)
                open({str(marker)!r}, "w").write("done")

        SlowImport("pdserve_test_import", "", "torch path").ready()
        time.sleep(0.2)
        print("exiting", flush=True)
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    assert marker.read_text() == "done"  # the process left only once the import ended


def test_a_built_kernel_loads_from_its_record_despite_a_lock(tmp_path, monkeypatch) -> None:
    """A lock left by a process killed mid-build does not stall a kernel already built."""
    from kernels import cpu_build, cpu_copysum

    real = cpu_copysum._KERNEL
    if not real.available():
        pytest.skip("no C++ compiler here")
    path = cpu_build.built_file(real.name, real.digest())
    assert path is not None and Path(path).is_file()

    monkeypatch.setattr("torch.utils.cpp_extension._get_build_directory",
                        lambda name, verbose: str(tmp_path / name))
    kernel = cpu_build.CppKernel(real.name, real.source, "torch path")
    (tmp_path / real.name).mkdir()
    (tmp_path / real.name / "lock").write_text("")  # young: _clear_stale_lock keeps it
    assert cpu_build.built_file(real.name, kernel.digest()) is None
    cpu_build.record_built(real.name, kernel.digest(), path)
    assert cpu_build.built_file(real.name, kernel.digest()) == path
    # A different source (or flags, or torch) is another digest: not this file.
    assert cpu_build.built_file(real.name, "0" * 32) is None

    def no_compile():
        raise AssertionError("compiled although built")
    monkeypatch.setattr(kernel, "_compile", no_compile)
    mod = kernel.module()
    assert mod is not None and mod.__file__ == path
    names = [n for n in dir(real.module()) if not n.startswith("_")]
    assert "copy_all" in names and [n for n in dir(mod) if not n.startswith("_")] == names
