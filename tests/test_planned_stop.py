"""A planned stop (SIGTERM) of a prefill worker: it tells the conductor before it goes, so
nothing more is routed to it, and it exits cleanly; the conductor does not wait for its
heartbeats to lapse."""

from __future__ import annotations

import signal

import pytest

from services.engine.tokenizer_export import tokenizer_dir_for
from services.engine.weights import DEFAULT_MODEL
from tests.cluster import Cluster

pytestmark = pytest.mark.timeout(180)

# Dead only after three missed heartbeats of 2 s: 6 s that a stop must not have to wait.
HEARTBEAT_S = 2.0


def test_stopped_prefill_worker_leaves_the_registry_at_once(tmp_path):
    gateway = ["--tokenizer-dir", tokenizer_dir_for(DEFAULT_MODEL), "--max-model-len", "8192"]
    cluster = Cluster(DEFAULT_MODEL, tmp_path, ["prefill", "decode"], executor="sim",
                      sim_profile="smollm2-cpu", gateway_args=gateway,
                      conductor_args=["--heartbeat-interval-s", str(HEARTBEAT_S)],
                      worker_args=["--sim-time-scale", "0.02",
                                   "--heartbeat-interval-s", str(HEARTBEAT_S)])
    cluster.start(timeout_s=90)
    try:
        assert cluster.conductor_workers()["prefill-0"].alive
        cluster.signal("prefill-0", signal.SIGTERM)
        assert cluster.procs["prefill-0"].popen.wait(30) == 0
        workers = cluster.conductor_workers()
        assert not workers["prefill-0"].alive and workers["decode-1"].alive
        leaving = [line for line in cluster.procs["conductor"].log.read_text().splitlines()
                   if "worker leaving" in line or "worker dead" in line]
        assert len(leaving) == 1 and "worker leaving" in leaving[0]
        assert "prefill-0" in leaving[0]
        assert "prefills drained" in cluster.procs["prefill-0"].log.read_text()
    finally:
        cluster.stop()
