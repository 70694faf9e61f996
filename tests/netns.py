"""Two "hosts" on one machine for cross-host system tests: two network namespaces joined
by a veth pair. Needs root and iproute2 (``ip``, ``tc``); Linux only.

    namespace <prefix>-a                      namespace <prefix>-b
    lo, wire0 10.77.0.1/24  ◄── veth pair ──► wire0 10.77.0.2/24, lo

The addresses live only inside the two namespaces, so concurrent runs (each with its
own prefix) cannot clash, and the test's own namespace is left as it was. The test
process talks to one side through ``Side.call``, which runs a function on a thread
that has entered that side's namespace.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import json
import os
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

DEVICE = "wire0"
_CLONE_NEWNET = 0x40000000


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not root, no iproute2, no kernel
    support); the message says which command failed and why."""


def ip(*args: str, netns: str | None = None) -> None:
    """Run ``ip [-n netns] args``; RuntimeError with its stderr if it fails."""
    cmd = ["ip", *(("-n", netns) if netns else ()), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip()}")


@dataclass(frozen=True, slots=True)
class Side:
    """One end of the pair: its namespace, its veth device and its address there."""

    netns: str
    ip: str
    device: str = DEVICE

    def call(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """``fn(*args, **kwargs)`` on a new thread inside this namespace (sockets it
        opens, and threads it starts, are in it); returns or raises what ``fn`` does."""
        def inside():
            _enter(self.netns)
            return fn(*args, **kwargs)

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(inside).result()

    def link(self, up: bool) -> None:
        """Set this side's end of the wire up or down (down: nothing crosses, either way)."""
        ip("link", "set", self.device, "up" if up else "down", netns=self.netns)

    def tx_bytes(self) -> int:
        """Bytes this side has sent over the wire so far."""
        out = subprocess.run(["ip", "-n", self.netns, "-j", "-s", "link", "show", "dev",
                              self.device], capture_output=True, text=True, timeout=10)
        if out.returncode != 0:
            raise RuntimeError(f"ip link show {self.device} in {self.netns}: {out.stderr}")
        return json.loads(out.stdout)[0]["stats64"]["tx"]["bytes"]

    def limit_rate(self, rate: str | None) -> None:
        """Shape what this side sends to ``rate`` (tc's units, e.g. "2mbit"); None lifts
        it. RuntimeError if the kernel lacks the tbf queueing discipline."""
        base = ["ip", "netns", "exec", self.netns, "tc", "qdisc"]
        if rate is None:
            cmd = [*base, "del", "dev", self.device, "root"]
        else:
            cmd = [*base, "replace", "dev", self.device, "root", "tbf", "rate", rate,
                   "burst", "32kb", "latency", "1s"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip()}")


class VethPair:
    """Creates the two namespaces and the wire between them on ``create()``; ``delete()``
    removes them (and with them the veth pair), whatever state they are in."""

    def __init__(self, prefix: str) -> None:
        self.a = Side(f"{prefix}-a", "10.77.0.1")
        self.b = Side(f"{prefix}-b", "10.77.0.2")

    def create(self) -> VethPair:
        """Raises NetnsUnavailable when the namespaces cannot be made; any later failure
        (an odd kernel) is a RuntimeError. Either way nothing is left behind."""
        try:
            ip("netns", "add", self.a.netns)
        except (OSError, RuntimeError) as exc:  # OSError: no ip binary at all
            raise NetnsUnavailable(f"cannot create a network namespace: {exc}") from exc
        try:
            ip("netns", "add", self.b.netns)
            ip("link", "add", "name", self.a.device, "type", "veth", "peer", "name",
               self.b.device, "netns", self.b.netns, netns=self.a.netns)
            for side in (self.a, self.b):
                ip("addr", "add", f"{side.ip}/24", "dev", side.device, netns=side.netns)
                ip("link", "set", "lo", "up", netns=side.netns)
                side.link(up=True)
        except BaseException:
            self.delete()
            raise
        return self

    def delete(self) -> None:
        for side in (self.a, self.b):
            subprocess.run(["ip", "netns", "del", side.netns], capture_output=True, timeout=10)


def _enter(netns: str) -> None:
    """Move the calling thread (only) into the named network namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {netns}: {os.strerror(err)}")
    finally:
        os.close(fd)


@contextlib.contextmanager
def veth_pair_or_skip(prefix: str) -> Iterator[VethPair]:
    """A ``VethPair`` named ``<prefix>-<pid>`` for the ``with`` body, deleted after; skips
    the test, saying why, where network namespaces cannot be created."""
    import pytest

    pair = VethPair(f"{prefix}-{os.getpid()}")
    try:
        pair.create()
    except NetnsUnavailable as exc:
        pytest.skip(f"cross-host tests need network namespaces (root, iproute2): {exc}")
    try:
        yield pair
    finally:
        pair.delete()
