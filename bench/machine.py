"""What a benchmark ran on, recorded beside its figures: a ratio taken on one machine is
only comparable with one taken on a machine like it.

``machine_info()`` reads /proc and package metadata only (it imports neither torch nor
transformers, so a benchmark's parent process stays light). ``machine_line()`` is the
one-line summary printed above every table in docs/benchmarks.md.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The instruction-set features that decide CPU matmul speed; the machine line names
# those present (the JSON keeps every flag).
KEY_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile")
PACKAGES = ("torch", "transformers")


def cpu_info(text: str | None = None) -> dict:
    """Model name and flags of the first processor in /proc/cpuinfo (``text`` for tests)."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            text = ""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor is enough: they are all alike here
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    model = fields.get("model name") or platform.processor() or platform.machine()
    return {"cpu_model": model, "cpu_flags": sorted(fields.get("flags", "").split())}


def memory_bytes(text: str | None = None) -> int:
    """MemTotal from /proc/meminfo in bytes; 0 where unknown."""
    if text is None:
        try:
            text = Path("/proc/meminfo").read_text()
        except OSError:
            return 0
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def git_commit(root: Path = ROOT) -> str:
    """HEAD's hash, with ``-dirty`` when tracked files differ from it; "" outside git."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], check=True,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"], check=True, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + ("-dirty" if dirty else "")


def machine_info() -> dict:
    """Everything that identifies the machine and software, except the load (which the
    harness samples before and after the runs)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 0
    return {**cpu_info(), "cores": os.cpu_count() or 0, "usable_cores": usable,
            "memory_bytes": memory_bytes(), "kernel": platform.release(),
            "executable": sys.executable, **versions(), "git_commit": git_commit()}


def machine_line(m: dict) -> str:
    """One line for the top of a table: CPU, its key ISA features, cores, memory,
    versions, load and commit."""
    flags = [f for f in KEY_FLAGS if f in m.get("cpu_flags", [])]
    load = m.get("load_before", []), m.get("load_after", [])
    parts = [f"{m.get('cpu_model', '?')} ({', '.join(flags) or 'no AVX2'})",
             f"{m.get('usable_cores', m.get('cores', '?'))} cores",
             f"{m.get('memory_bytes', 0) / 2**30:.0f} GiB",
             f"python {m.get('python', '?')}, torch {m.get('torch', '?')}, "
             f"transformers {m.get('transformers', '?')}"]
    if load[0] and load[1]:
        parts.append(f"load {load[0][0]:.2f} → {load[1][0]:.2f}")
    if m.get("git_commit"):
        parts.append(f"commit {m['git_commit'][:12]}")
    return "Machine: " + "; ".join(parts)


# Busy: the cores other processes used during the run (on average, including time the
# hypervisor stole) above this. The 1-minute load average before a run is recorded but
# decides only where that measure is missing: right after another benchmark (as in
# `make bench`) it still counts that benchmark's own processes, winding down.
BUSY_LOAD_PER_CORE = 0.5
BUSY_OTHER_CORES = 0.25


def was_busy(m: dict) -> bool:
    """Whether the machine ``m`` describes (a report's ``machine``) was busy."""
    other = m.get("other_cores_used")
    if other is not None and m.get("cpu_measured", True):
        return other > BUSY_OTHER_CORES
    before = m["load_before"][0] if m.get("load_before") else 0.0
    return before > BUSY_LOAD_PER_CORE * (m.get("usable_cores") or 1)
