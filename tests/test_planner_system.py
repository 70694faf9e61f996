"""The planner as a real process over a real conductor, gateway and simulated workers
(``--executor sim``) that it starts and stops itself (the local actuator): a load step
from low to high and back makes it add workers of both roles and then drain them
away, every request completes with exactly the tokens asked for, and each decision is
logged and counted on the planner's /metrics."""

from __future__ import annotations

import concurrent.futures
import re
import shlex
import threading
import time
import urllib.request

import pytest

from common.client import Client
from services.engine.tokenizer_export import tokenizer_dir_for
from services.engine.weights import DEFAULT_MODEL
from tests.cluster import Cluster, free_port
from tests.test_sim_cluster import expected
from tests.tiny_models import random_prompts

pytestmark = pytest.mark.timeout(240)

GATEWAY = ["--tokenizer-dir", tokenizer_dir_for(DEFAULT_MODEL), "--max-model-len", "8192"]
MAX_TOKENS = 128


def start_planned_cluster(tmp_path, planner_args: list[str]) -> tuple[Cluster, int]:
    """Conductor, gateway and a planner whose local actuator starts every worker."""
    cluster = Cluster(DEFAULT_MODEL, tmp_path, [], executor="sim", gateway_args=GATEWAY,
                      sim_profile="smollm2-cpu", policy="least_loaded")
    worker = shlex.join([
        "--model", DEFAULT_MODEL, "--control-addr", "tcp://127.0.0.1:0",
        "--conductor-addr", cluster.conductor_addr, "--heartbeat-addr", cluster.heartbeat_addr,
        "--kv-cache-mib", "1024", "--num-threads", "1", "--executor", "sim",
        "--sim-profile", "smollm2-cpu", "--sim-time-scale", "0.1", "--max-num-seqs", "2",
        "--heartbeat-interval-s", "0.3"])
    metrics = free_port()
    cluster.start_conductor()
    cluster._spawn("planner", [
        "services.planner", "--conductor-addr", cluster.conductor_addr,
        "--actuator", "local", "--local-log-dir", str(tmp_path),
        "--local-command", "{python} -m services.{role} --worker-id {name} " + worker,
        "--metrics-port", str(metrics), *planner_args])
    cluster._spawn("gateway", [
        "services.gateway", "--model", cluster.model, "--http-port", str(cluster.http_port),
        "--zmq-addr", cluster.zmq_addr, "--conductor-addr", cluster.conductor_addr,
        "--stream-bind", f"tcp://127.0.0.1:{free_port()}", "--request-timeout-s", "120",
        *GATEWAY])
    try:
        deadline = time.monotonic() + 90
        while alive_counts(cluster) != (1, 1):
            for proc in cluster.procs.values():
                if proc.popen.poll() is not None:
                    raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError("the planner's first workers did not come up:\n"
                                   + cluster.procs["planner"].tail())
            time.sleep(0.3)
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(cluster.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.3)
        else:
            raise TimeoutError("the gateway is not ready:\n" + cluster.procs["gateway"].tail())
    except BaseException:
        cluster.stop()
        raise
    return cluster, metrics


def alive_counts(cluster: Cluster) -> tuple[int, int]:
    try:
        workers = cluster.conductor_stats(5).workers
    except TimeoutError:
        return (-1, -1)
    return tuple(sum(w.alive and w.info.role == r for w in workers)
                 for r in ("prefill", "decode"))


def decisions(port: int) -> dict[tuple[str, str, str], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    pat = re.compile(r'^pdserve:planner_decisions_total\{action="(\w+)",reason="(\w+)",'
                     r'role="(\w+)"\} ([\d.e+]+)$', re.M)
    return {(role, action, reason): float(v) for action, reason, role, v in pat.findall(text)}


def test_a_load_step_adds_workers_and_drains_them_away_losing_no_request(tmp_path):
    cluster, metrics = start_planned_cluster(tmp_path, [
        "--min-prefill", "1", "--max-prefill", "2", "--min-decode", "1", "--max-decode", "2",
        "--interval-s", "0.3", "--queue-high", "2", "--queue-low", "0.5", "--up-ticks", "2",
        "--down-ticks", "4", "--cooldown-up-s", "2", "--cooldown-down-s", "2",
        # A decode worker runs every request whose KV has landed (no queue forms there):
        # its pressure is the predicted step time against the TBT SLO.
        "--slo-tbt-ms", "15"])
    results: list[tuple[list[int], list[int]]] = []
    peak = [0, 0]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            got = alive_counts(cluster)
            peak[0], peak[1] = max(peak[0], got[0]), max(peak[1], got[1])
            time.sleep(0.3)

    def client_loop(seed: int, until: float, pause: float):
        with Client(cluster.zmq_addr, timeout_s=120) as client:
            i = 0
            while time.monotonic() < until:
                (prompt,) = random_prompts([300], vocab=49152, seed=seed * 1000 + i)
                got = client.generate(prompt_token_ids=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0.0).token_ids
                results.append((prompt, got))
                i += 1
                time.sleep(pause)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        client_loop(0, time.monotonic() + 2, 0.3)  # low: one client at a time
        assert alive_counts(cluster) == (1, 1)
        high_until = time.monotonic() + 14
        with concurrent.futures.ThreadPoolExecutor(24) as pool:  # high: 24 at once
            list(pool.map(lambda k: client_loop(k, high_until, 0.0), range(1, 25)))
        # Back to low: the planner drains the added workers while requests still run.
        deadline = time.monotonic() + 60
        k = 100
        while alive_counts(cluster) != (1, 1) and time.monotonic() < deadline:
            client_loop(k, time.monotonic() + 1, 0.3)
            k += 1
        assert alive_counts(cluster) == (1, 1)
    finally:
        stop.set()
        watcher.join()
        planner_log = cluster.procs["planner"].log.read_text()
        counted = decisions(metrics)
        cluster.stop()
    assert peak == [2, 2], peak
    assert results and all(got == expected(p, MAX_TOKENS) for p, got in results)
    for role, why in (("prefill", "queue"), ("decode", "tbt")):
        assert counted[(role, "scale_out", "min")] == 1  # the first worker
        assert counted[(role, "scale_out", why)] >= 1
        # Every worker added under pressure was taken away when the load fell.
        outs = sum(v for (r, a, why), v in counted.items() if r == role and a == "scale_out"
                   and why != "min")
        assert outs == counted[(role, "scale_in", "idle")]
        logged = re.findall(rf"planner decision .*action=(\w+) .*reason=(\w+) .*role={role}",
                            planner_log)
        assert ("scale_out", why) in logged and ("scale_in", "idle") in logged
    # Every worker the planner stopped drained and exited cleanly.
    stopped = re.findall(r"worker exited +code=(-?\d+) .*stopped=True", planner_log)
    assert stopped and set(stopped) == {"0"}, stopped
