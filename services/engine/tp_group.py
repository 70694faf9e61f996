"""The ranks of a tensor-parallel engine: rank 0 starts the followers, joins them in a
torch.distributed group, tells them each step, and watches them.

    rank 0 (the engine the worker drives)          ranks 1..N-1 (tp_follower.py)
    TCPStore on a free loopback port  ──────────►  subprocess, told the port
    init_process_group (gloo / nccl, timeout)  ◄─► init_process_group
    per step: plan broadcast (gloo) ───────────►  receive, run the same forward
              model collectives (all-reduce, all-gather) ◄─► the same collectives
    close: STOP plan ──────────────────────────►  leave, exit 0

Two groups: the model's collectives run on the default group, whose ``timeout`` bounds
a wait on a rank that hangs; plans go over a gloo group without a useful timeout, so an
idle follower waits for its next step as long as the engine is idle. A follower that
dies is seen by the watcher thread at once (its exit status), which logs it, kills the
other followers and marks the group failed; a collective that was waiting on it fails
with the broken connection, and the engine raises ``EngineDeadError`` from then on.
Followers die with rank 0 (parent-death signal, and their plan wait breaks).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import structlog
import torch
import torch.distributed as dist

from services.engine.tp import EngineDeadError, ParallelContext
from services.engine.tp_recv import KV_DROP, KV_EXPECT, KV_LISTEN, LeaderReceive  # noqa: F401

log = structlog.get_logger(__name__)

COLLECTIVE_TIMEOUT_S = 120.0  # a rank that neither answers nor dies, for this long
START_TIMEOUT_S = 120.0  # followers reach the rendezvous (imports, not the model load)
PLAN_TIMEOUT = timedelta(days=365)  # an idle engine sends no plans
PLAN_BYTES = 16384  # one broadcast carries a plan this size; a bigger one needs a second
HEADER = 9  # 8-byte little-endian length, 1-byte kind
STEP, STOP = 1, 2
# KV in the all-heads layout (tp_kv.py): imports, exports between steps, and a step
# whose layers are gathered as they are computed (payload: export block ids, step).
KV_IN, KV_OUT, STEP_EXPORT = 3, 4, 5
# KV_LISTEN, KV_EXPECT, KV_DROP (6, 7, 8): a decode worker's ranks each receiving their
# own heads' slices, declared in tp_recv.py.


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class PlanChannel:
    """Plans from rank 0 to every rank over ``group``: one broadcast of ``PLAN_BYTES``,
    and one more for the rest of a plan that does not fit."""

    def __init__(self, group) -> None:
        self.group = group
        self._buf = torch.zeros(PLAN_BYTES, dtype=torch.uint8)

    def send(self, kind: int, payload: bytes = b"") -> None:
        n = len(payload)
        head = n.to_bytes(8, "little") + bytes([kind]) + payload[:PLAN_BYTES - HEADER]
        self._buf[:len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        dist.broadcast(self._buf, src=0, group=self.group)
        if n > PLAN_BYTES - HEADER:
            rest = torch.frombuffer(bytearray(payload[PLAN_BYTES - HEADER:]), dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.group)

    def receive(self) -> tuple[int, bytes]:
        dist.broadcast(self._buf, src=0, group=self.group)
        head = self._buf[:HEADER].numpy().tobytes()
        n, kind = int.from_bytes(head[:8], "little"), head[8]
        first = self._buf[HEADER:HEADER + min(n, PLAN_BYTES - HEADER)].numpy().tobytes()
        if n <= PLAN_BYTES - HEADER:
            return kind, first
        rest = torch.empty(n - (PLAN_BYTES - HEADER), dtype=torch.uint8)
        dist.broadcast(rest, src=0, group=self.group)
        return kind, first + rest.numpy().tobytes()


def join_group(rank: int, world_size: int, device: torch.device, store) -> tuple[
        ParallelContext, PlanChannel, object]:
    """Join the model's group, the plan group and the KV group (every rank calls this,
    in this order). KV gathers and scatters run on host memory, so on gloo whatever
    the model's backend."""
    dist.init_process_group(backend_for(device), store=store, rank=rank,
                            world_size=world_size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    plans = dist.new_group(backend="gloo", timeout=PLAN_TIMEOUT)
    kv = dist.new_group(backend="gloo", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return ParallelContext(rank, world_size, dist.group.WORLD), PlanChannel(plans), kv


class Leader:
    """Rank 0's side: the followers, their watcher, and the plans sent to them."""

    def __init__(self, config_json: str, world_size: int, device: torch.device) -> None:
        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel engine already runs in this process")
        self.world_size = world_size
        self.failed = threading.Event()
        self.reason = ""
        self._closing = False
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                              wait_for_workers=False,
                              timeout=timedelta(seconds=START_TIMEOUT_S))
        self.procs = [subprocess.Popen(
            [sys.executable, "-m", "services.engine.tp_follower", json.dumps(
                {"rank": r, "world_size": world_size, "port": store.port,
                 "config": json.loads(config_json)})],
            stdin=subprocess.DEVNULL, env=_follower_env()) for r in range(1, world_size)]
        atexit.register(self._kill_all)
        self._watcher = threading.Thread(target=self._watch, name="tp-watcher", daemon=True)
        self._watcher.start()
        self._await_followers(store)
        self.tp, self.plans, self.kv_group = join_group(0, world_size, device, store)
        self._store = store  # kept alive: the followers' rendezvous lives in it
        self.receive = LeaderReceive(store, store.port, world_size, self.send_step)

    def _await_followers(self, store) -> None:
        """Wait for every follower to reach the rendezvous, or fail fast if one died."""
        keys = [f"up/{r}" for r in range(1, self.world_size)]
        deadline = time.monotonic() + START_TIMEOUT_S
        while not store.check(keys):
            if self.failed.is_set():
                raise EngineDeadError(self.reason)
            if time.monotonic() > deadline:
                self._kill_all()
                raise EngineDeadError("tensor-parallel followers did not start within "
                                      f"{START_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    def _watch(self) -> None:
        while not self._closing:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and not self._closing:
                    self.fail(f"tensor-parallel follower rank {rank} (pid {proc.pid}) "
                              f"exited with status {code}")
                    return
            time.sleep(0.1)

    def broken(self, what: str, exc: BaseException) -> EngineDeadError:
        """A collective failed: the group is dead. A follower's exit explains it best, so
        the watcher gets a moment to see one first."""
        self.failed.wait(1.0)
        self.fail(f"{what} failed: {exc}")
        return EngineDeadError(self.reason)

    def fail(self, reason: str) -> None:
        """Mark the group dead (once), say so loudly, and take the other followers down."""
        if self.failed.is_set():
            return
        self.reason = reason
        self.failed.set()
        log.error("tensor-parallel engine is dead", reason=reason)
        self._kill_all()

    def check(self) -> None:
        if self.failed.is_set():
            raise EngineDeadError(self.reason)

    def send_step(self, payload: bytes, kind: int = STEP) -> None:
        """Send a plan of ``kind`` (a step, or a KV operation) to the followers."""
        self.check()
        try:
            self.plans.send(kind, payload)
        except RuntimeError as exc:
            raise self.broken("sending a plan to the followers", exc) from exc

    def close(self) -> None:
        """Stop the followers (a STOP plan, then kill what lingers) and leave the group."""
        if self._closing:
            return
        self._closing = True
        if not self.failed.is_set():
            with contextlib.suppress(RuntimeError):
                self.plans.send(STOP)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        self._kill_all()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.error("tensor-parallel follower did not die", pid=proc.pid)


def _follower_env() -> dict[str, str]:
    """This environment, with the project root importable wherever rank 0 was started."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent (rank 0) dies; strictly, when the
    thread that started it ends, which in a worker is the engine thread, after close."""
    if sys.platform != "linux":
        return
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent was already gone before prctl
        os._exit(1)
