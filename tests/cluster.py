"""Real pdserve processes for system tests: start, wait, inspect, stop.

By default every process runs here, on 127.0.0.1. A ``Host`` puts processes in a network
namespace, binding and advertising that namespace's address (``tests/netns.py`` builds
two such hosts joined by a veth pair).

The control plane runs with CURVE: a cluster generates keys into its work directory at
start and hands them to every process (``PDSERVE_CURVE_KEYS_DIR``); the test's own peers
(``stats``, ``dealer``) hold the ``client`` role's key. ``curve=False`` runs plain."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from common.protocol import (
    ConductorStats,
    GetStats,
    WorkerStats,
    WorkerStatus,
    decode,
    encode,
)
from common.zmq_auth import CurveKeys, generate_keys

ROOT = Path(__file__).resolve().parents[1]


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range, so that no socket bound
    to port 0 meanwhile (ZeroMQ, UCX listeners) can take it before its process binds."""
    for _ in range(200):
        port = random.randrange(20000, 32000)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no free port found in 20000-32000")


def make_served_tiny_model(path: Path, seed: int = 0) -> Path:
    """A tiny random Llama with the default model's vocabulary and tokenizer files."""
    from services.engine.tokenizer_export import tokenizer_dir_for
    from services.engine.weights import DEFAULT_MODEL
    from tests.tiny_models import make_tiny_model

    make_tiny_model(path, "llama", seed=seed, vocab_size=49152, max_position_embeddings=1024,
                    eos_token_id=2)
    for f in Path(tokenizer_dir_for(DEFAULT_MODEL)).iterdir():
        if f.is_file():
            shutil.copy(f, path / f.name)
    return path


def make_keys(workdir: Path) -> str:
    """CURVE keys for one cluster, in ``workdir/keys`` (made once)."""
    out = workdir / "keys"
    if not (out / "client.key_secret").exists():
        generate_keys(out)
    return str(out)


def dealer(ctx: zmq.Context, addr: str, *, server: str = "conductor",
           keys_dir: str = "") -> zmq.Socket:
    """A blocking DEALER connected to ``addr``; with ``keys_dir``, a CURVE client holding
    the ``client`` role's key, expecting the ``server`` role's."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys_dir:
        keys = CurveKeys.load(keys_dir, "client")
        sock.curve_serverkey = keys.server_key(server)
        sock.curve_publickey = keys.own.public
        sock.curve_secretkey = keys.own.secret
    sock.connect(addr)
    return sock


def stats(addr: str, timeout_s: float = 15.0, *, server: str = "conductor",
          keys_dir: str = ""):
    """Ask a worker, the conductor or a cache pool (``server``) for its stats record (a
    blocking DEALER call); with ``keys_dir``, over CURVE.

    A context of its own per call: its I/O thread, which opens the connection, is then
    in the caller's network namespace (see ``tests/netns.py``)."""
    ctx = zmq.Context()
    sock = dealer(ctx, addr, server=server, keys_dir=keys_dir)
    try:
        sock.send_multipart(encode(GetStats()))
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no stats from {addr}")
        return decode(sock.recv_multipart()).record
    finally:
        sock.close(0)
        ctx.term()


@dataclass(frozen=True, slots=True)
class Host:
    """Where a process runs: a network namespace (None: the test's own), the address it
    binds and its peers reach it at, and variables added to its environment. A worker
    in a namespace takes the namespace's name as its host id."""

    ip: str = "127.0.0.1"
    netns: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    control: str = ""
    args: list[str] = field(default_factory=list)
    host: Host | None = None
    starts: int = 1

    def tail(self, n: int = 40) -> str:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return "\n".join(lines[-n:])


@dataclass
class Cluster:
    """gateway + conductor + workers as subprocesses; ``roles`` like ["prefill", "decode"].

    ``policy`` defaults to the static least-loaded rule, under which exactly the prompts
    of ``disagg_threshold`` tokens or more cross to a prefill worker, so data-path tests
    know in advance which requests move KV; routing tests choose "cache_aware".
    ``executor="sim"`` starts simulated workers (``sim_profile``); ``conductor_args``
    and ``worker_args`` are extra flags for those processes. Conductor and gateway run
    on ``host``, each worker on ``worker_hosts[name]`` if given, else on ``host``."""

    model: str
    workdir: Path
    roles: list[str]
    dtype: str = "float32"
    disagg_threshold: int = 16
    kv_lease_s: float = 10.0
    kv_cache_mib: int = 64
    max_model_len: int = 0
    policy: str = "least_loaded"
    executor: str = "model"
    sim_profile: str = "zero"
    conductor_args: list[str] = field(default_factory=list)
    worker_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    host: Host = field(default_factory=Host)
    worker_hosts: dict[str, Host] = field(default_factory=dict)
    procs: dict[str, Proc] = field(default_factory=dict)
    curve: bool = True

    def __post_init__(self) -> None:
        self.keys_dir = make_keys(Path(self.workdir)) if self.curve else ""
        ip = self.host.ip
        self.http_port = free_port()
        self.zmq_addr = f"tcp://{ip}:{free_port()}"
        self.conductor_addr = f"tcp://{ip}:{free_port()}"
        self.heartbeat_addr = f"tcp://{ip}:{free_port()}"
        self.base_url = f"http://{ip}:{self.http_port}"

    def _spawn(self, name: str, args: list[str], control: str = "",
               host: Host | None = None, starts: int = 1) -> Proc:
        host = host or self.host
        log = self.workdir / f"{name}.log"
        if starts > 1:  # a restart keeps the dead process's log
            log = self.workdir / f"{name}.{starts}.log"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PDSERVE_LOG_FORMAT": "console",
               "PDSERVE_CURVE_KEYS_DIR": self.keys_dir, **host.env}
        cmd = [sys.executable, "-m", *args]
        if host.netns:  # ip execs the command: the process keeps the pid we signal
            cmd = ["ip", "netns", "exec", host.netns, *cmd]
        popen = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"),
                                 stderr=subprocess.STDOUT)
        proc = self.procs[name] = Proc(name, popen, log, control, args, host, starts)
        return proc

    def restart(self, name: str, timeout_s: float = 15.0) -> Proc:
        """Start ``name`` again with its own arguments and addresses, as a supervisor
        would, once the old process has exited (killed after ``timeout_s``)."""
        old = self.procs[name]
        try:
            old.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            old.popen.kill()
            old.popen.wait()
        return self._spawn(name, old.args, old.control, old.host, old.starts + 1)

    def wait_alive(self, name: str, timeout_s: float = 60.0) -> None:
        """Until process ``name`` answers for itself and the conductor lists it (a
        worker) or every worker (the conductor) as alive."""
        deadline = time.monotonic() + timeout_s
        answered = False
        while time.monotonic() < deadline:
            if self.procs[name].popen.poll() is not None:
                raise RuntimeError(f"{name} exited:\n{self.procs[name].tail()}")
            try:
                if not answered:  # the new process, not the dead one's registration
                    if name != "conductor":
                        self.worker_stats(name)
                    answered = True
                workers = self.conductor_workers()
                want = set(self.procs) - {"conductor", "gateway"} if name == "conductor" \
                    else {name}
                if all(w in workers and workers[w].alive for w in want):
                    return
            except TimeoutError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{name} not alive within {timeout_s} s")

    def start_worker(self, name: str, role: str) -> Proc:
        host = self.worker_hosts.get(name, self.host)
        control = f"tcp://{host.ip}:{free_port()}"
        placement = ["--kv-host", host.ip, *(("--host-id", host.netns) if host.netns else ())]
        return self._spawn(name, [
            f"services.{role}", "--worker-id", name, "--model", self.model,
            "--dtype", self.dtype, "--control-addr", control,
            "--conductor-addr", self.conductor_addr, "--heartbeat-addr", self.heartbeat_addr,
            "--kv-cache-mib", str(self.kv_cache_mib), "--kv-lease-s", str(self.kv_lease_s),
            "--num-threads", "1", "--max-model-len", str(self.max_model_len),
            "--executor", self.executor, "--sim-profile", self.sim_profile,
            *placement, *self.worker_args], control, host)

    def restart_worker(self, name: str, role: str) -> Proc:
        """Start worker ``name`` again once its process has exited (killed by a test),
        at a new control address; its earlier log is kept as ``<name>.log.1``."""
        old = self.procs[name]
        if old.popen.poll() is None:
            raise RuntimeError(f"{name} is still running")
        if old.log.exists():
            old.log.rename(old.log.with_suffix(".log.1"))
        return self.start_worker(name, role)

    def start_conductor(self) -> Proc:
        return self._spawn("conductor", [
            "services.conductor", "--control-addr", self.conductor_addr,
            "--heartbeat-addr", self.heartbeat_addr, "--policy", self.policy,
            "--disagg-threshold", str(self.disagg_threshold), *self.conductor_args],
            self.conductor_addr)

    def start(self, timeout_s: float = 120.0) -> Cluster:
        self.start_conductor()
        for i, role in enumerate(self.roles):
            self.start_worker(f"{role}-{i}", role)
        self._spawn("gateway", [
            "services.gateway", "--model", self.model, "--http-host", self.host.ip,
            "--http-port", str(self.http_port), "--zmq-addr", self.zmq_addr,
            "--conductor-addr", self.conductor_addr,
            "--stream-bind", f"tcp://{self.host.ip}:{free_port()}",
            "--request-timeout-s", "120", *self.gateway_args])
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()  # a cluster that never came up must not outlive the test
            raise
        return self

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        want = {n for n in self.procs if n not in ("conductor", "gateway")}
        while time.monotonic() < deadline:
            for proc in self.procs.values():
                if proc.popen.poll() is not None:
                    raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
            try:
                alive = {w.info.worker_id for w in self.conductor_stats(1).workers
                         if w.alive}
                with urllib.request.urlopen(self.base_url + "/health", timeout=1) as r:
                    if r.status == 200 and want <= alive:
                        return
            except (OSError, TimeoutError, KeyError):
                pass
            time.sleep(0.3)
        raise TimeoutError("cluster not ready:\n" + "\n".join(
            f"--- {p.name}\n{p.tail(15)}" for p in self.procs.values()))

    def worker_stats(self, name: str) -> WorkerStats:
        return stats(self.procs[name].control, server="worker", keys_dir=self.keys_dir)

    def conductor_stats(self, timeout_s: float = 15.0) -> ConductorStats:
        return stats(self.conductor_addr, timeout_s, keys_dir=self.keys_dir)

    def conductor_workers(self) -> dict[str, WorkerStatus]:
        return {w.info.worker_id: w for w in self.conductor_stats().workers}

    def signal(self, name: str, sig: int) -> None:
        self.procs[name].popen.send_signal(sig)

    def stop(self) -> None:
        """Workers first, then the conductor and gateway: a worker stopping tells the
        conductor it leaves, and with the conductor already gone it would wait out that
        call's timeout (2 s) before exiting."""
        front = ("conductor", "gateway")
        _terminate([p for n, p in self.procs.items() if n not in front])
        _terminate([p for n, p in self.procs.items() if n in front])


def _terminate(procs: list[Proc]) -> None:
    """SIGTERM each process (resumed first, if stopped) and wait; killed after 10 s."""
    for proc in procs:
        if proc.popen.poll() is None:
            proc.popen.send_signal(signal.SIGCONT)
            proc.popen.terminate()
    for proc in procs:
        try:
            proc.popen.wait(10)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.popen.wait()


def stream_each(cluster: Cluster, prompts: list[list[int]], max_tokens: int,
                started: list[int], timeout_s: float = 240):
    """Stream each prompt (greedy, ``max_tokens``, EOS ignored) from a thread of its own;
    ``started`` gets one entry per stream that saw its first chunk. Futures of each
    stream's chunks."""
    import concurrent.futures

    from common.client import Client

    def one(prompt):
        with Client(cluster.zmq_addr, timeout_s=timeout_s) as client:
            chunks = []
            for chunk in client.stream(prompt_token_ids=prompt, max_tokens=max_tokens,
                                       temperature=0, ignore_eos=True):
                if not chunks:
                    started.append(1)
                chunks.append(chunk)
            return chunks
    pool = concurrent.futures.ThreadPoolExecutor(len(prompts))
    return [pool.submit(one, p) for p in prompts]
