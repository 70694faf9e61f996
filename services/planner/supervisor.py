"""Scaling through supervisord's XML-RPC interface: start and stop configured programs.

Each role has an ordered list of supervisord programs (``decode``, ``decode-2``,
``decode-3``; the spares defined with ``autostart=false``, see deploy/run_local.py).
Scaling out starts the first ones that are not running; scaling in stops the last
running ones. supervisord's stop sends the program's stop signal (SIGTERM) and waits
``stopwaitsecs`` before SIGKILL: that is the worker's time to drain.

supervisord listens on a unix socket (``unix:///path/supervisor.sock``; its file mode
says who may start and stop programs) or on HTTP (``http://user:pass@host:port``).
The calls block, so they run in a thread.
"""

from __future__ import annotations

import asyncio
import http.client
import socket
import xmlrpc.client
from urllib.parse import urlsplit

from services.planner.actuator import Actuator, ActuatorError

# Counted as running: up, or on its way up (supervisord retries a program in BACKOFF).
UP_STATES = {"RUNNING", "STARTING", "BACKOFF"}
TIMEOUT_S = 10.0


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=TIMEOUT_S)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(TIMEOUT_S)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class _UnixTransport(xmlrpc.client.Transport):
    def __init__(self, path: str) -> None:
        super().__init__()
        self._path = path

    def make_connection(self, host):
        return _UnixConnection(self._path)


def server_proxy(url: str) -> xmlrpc.client.ServerProxy:
    """An XML-RPC proxy to supervisord at ``url`` (unix:// or http://)."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return xmlrpc.client.ServerProxy("http://localhost/RPC2",
                                         transport=_UnixTransport(parts.path))
    if parts.scheme in ("http", "https"):
        path = parts.path if parts.path not in ("", "/") else "/RPC2"
        return xmlrpc.client.ServerProxy(parts._replace(path=path).geturl())
    raise ValueError(f"supervisor_url must be unix:// or http(s)://, got {url!r}")


class SupervisorActuator(Actuator):
    name = "supervisord"

    def __init__(self, url: str, programs: dict[str, tuple[str, ...]]) -> None:
        self._url = url
        self._programs = programs

    def _call(self, method: str, *args):
        try:
            proxy = server_proxy(self._url)
            return getattr(proxy.supervisor, method)(*args)
        except xmlrpc.client.Fault as exc:
            raise ActuatorError(f"supervisord {method}{args}: {exc.faultString}") from exc
        except (OSError, xmlrpc.client.ProtocolError) as exc:
            raise ActuatorError(f"supervisord at {self._url}: {exc}") from exc

    async def _states(self) -> dict[str, str]:
        infos = await asyncio.to_thread(self._call, "getAllProcessInfo")
        return {_full_name(i): i["statename"] for i in infos}

    async def start(self) -> None:
        states = await self._states()
        missing = [p for names in self._programs.values() for p in names if p not in states]
        if missing:
            raise ActuatorError(f"supervisord at {self._url} has no programs {missing} "
                                f"(it has {sorted(states)})")

    async def count(self, role: str) -> int:
        states = await self._states()
        return sum(states.get(p) in UP_STATES for p in self._programs[role])

    async def scale(self, role: str, n: int) -> None:
        states = await self._states()
        names = self._programs[role]
        up = [p for p in names if states.get(p) in UP_STATES]
        if n > len(up):
            for name in [p for p in names if p not in up][:n - len(up)]:
                await asyncio.to_thread(self._call, "startProcess", name, False)
        for name in reversed(up[n:] if n < len(up) else []):
            await asyncio.to_thread(self._call, "stopProcess", name, False)


def _full_name(info: dict) -> str:
    """supervisord's name for a process: its program's name, or group:name in a group."""
    return info["name"] if info["group"] == info["name"] else f"{info['group']}:{info['name']}"
