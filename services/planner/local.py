"""Scaling by starting and stopping worker processes on this machine (tests, benchmarks,
a single host without a supervisor).

A worker's command line is ``local_command`` with ``{python}`` (this interpreter),
``{role}`` and ``{name}`` (``<role>-p<N>``, a fresh id for every start, so a new worker
never takes the registry entry of one still leaving) filled in; it inherits the
planner's environment (``PDSERVE_CURVE_KEYS_DIR``, ``PDSERVE_CONFIG``). Scaling in sends
SIGTERM to the newest worker of the role; it drains and exits on its own. A worker that
exits by itself is no longer counted, so the planner starts another. ``close()`` stops
every worker it started and waits for them (SIGKILL after ``STOP_WAIT_S``).
"""

from __future__ import annotations

import asyncio
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import structlog

from services.planner.actuator import Actuator, ActuatorError

log = structlog.get_logger(__name__)

STOP_WAIT_S = 30.0


@dataclass
class _Worker:
    name: str
    popen: subprocess.Popen
    stopping: bool = False


class LocalActuator(Actuator):
    name = "local"

    def __init__(self, command: str, log_dir: str = "") -> None:
        self._template = shlex.split(command)
        if not self._template:
            raise ActuatorError("local_command is empty")
        self._log_dir = Path(log_dir) if log_dir else None
        self._workers: dict[str, list[_Worker]] = {"prefill": [], "decode": []}
        self._started = 0

    def argv(self, role: str, name: str) -> list[str]:
        return [part.format(python=sys.executable, role=role, name=name)
                for part in self._template]

    async def start(self) -> None:
        try:
            self.argv("decode", "decode-p0")
        except (KeyError, IndexError, ValueError) as exc:
            raise ActuatorError(f"local_command {shlex.join(self._template)!r}: "
                                f"unknown placeholder {exc}") from exc
        if self._log_dir is not None:
            self._log_dir.mkdir(parents=True, exist_ok=True)

    def _reap(self, role: str) -> list[_Worker]:
        """The role's workers that have not exited; logs those that have."""
        alive = []
        for w in self._workers[role]:
            code = w.popen.poll()
            if code is None:
                alive.append(w)
            else:
                how = log.info if w.stopping and code == 0 else log.warning
                how("worker exited", worker_id=w.name, code=code, stopped=w.stopping)
        self._workers[role] = alive
        return alive

    async def count(self, role: str) -> int:
        return sum(not w.stopping for w in self._reap(role))

    async def scale(self, role: str, n: int) -> None:
        up = [w for w in self._reap(role) if not w.stopping]
        for _ in range(n - len(up)):
            self._spawn(role)
        for w in reversed(up[n:] if n < len(up) else []):
            w.stopping = True
            w.popen.send_signal(signal.SIGTERM)
            log.info("worker stopping", worker_id=w.name)

    def _spawn(self, role: str) -> None:
        self._started += 1
        name = f"{role}-p{self._started}"
        out = (self._log_dir / f"{name}.log").open("w") if self._log_dir else None
        try:
            popen = subprocess.Popen(self.argv(role, name), stdin=subprocess.DEVNULL,
                                     stdout=out or subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT)
        except OSError as exc:
            raise ActuatorError(f"cannot start {name}: {exc}") from exc
        finally:
            if out is not None:
                out.close()  # the child holds its own descriptor
        self._workers[role].append(_Worker(name, popen))
        log.info("worker started", worker_id=name, pid=popen.pid)

    async def close(self) -> None:
        workers = [w for ws in self._workers.values() for w in ws]
        for w in workers:
            if w.popen.poll() is None:
                w.popen.send_signal(signal.SIGTERM)
        for w in workers:
            try:
                await asyncio.to_thread(w.popen.wait, STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                w.popen.kill()
                await asyncio.to_thread(w.popen.wait)
