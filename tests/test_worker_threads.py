"""A worker's OpenMP wait policy: set before torch loads, and a user's own value kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Runs an entry module as `python -m` would, noting OMP_WAIT_POLICY at the moment torch
# is first imported (a meta-path hook sees the import before torch's code runs). With
# --help the worker stops before it builds its engine, which is where it imports torch;
# the probe imports torch after it, as the engine build would in the same process.
PROBE = r"""
import importlib.abc, json, os, runpy, sys
seen = {}
class Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and "at_torch" not in seen:
            seen["at_torch"] = os.environ.get("OMP_WAIT_POLICY")
        return None
sys.meta_path.insert(0, Hook())
sys.argv = [sys.argv[1], "--help"]
try:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
except SystemExit:
    pass
import torch
print(json.dumps(seen))
"""


def _probe(module: str, **env: str) -> dict:
    base = {k: v for k, v in os.environ.items()
            if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", PROBE, module], cwd=ROOT, capture_output=True,
                         text=True, timeout=120,
                         env={**base, "PYTHONPATH": str(ROOT), **env})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", ["services.prefill", "services.decode", "services.unified"])
def test_worker_entry_sets_passive_before_torch_loads(module):
    assert _probe(module) == {"at_torch": "PASSIVE"}


def test_pdserve_cli_worker_sets_passive_before_torch_loads():
    # `pdserve decode` imports the worker lazily; the probe runs the CLI module instead.
    code = PROBE.replace('sys.argv = [sys.argv[1], "--help"]',
                         'sys.argv = [sys.argv[1], "decode", "--help"]')
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code, "services.cli"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120,
                         env={**base, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"at_torch": "PASSIVE"}


def test_user_wait_policy_is_kept():
    assert _probe("services.decode", OMP_WAIT_POLICY="ACTIVE") == {"at_torch": "ACTIVE"}
