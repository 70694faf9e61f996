"""Where ``bench/chaos.py``'s processes run. With network namespaces (root, iproute2) the
prefill worker is a "host" of its own, joined to the rest by a veth pair as in
``tests/netns.py``, so that the ``link_cut`` fault can take its link down::

    namespace <prefix>-a (10.77.0.1): conductor, gateway, decode workers, cache pool,
                                      and the load generator (a thread entered there)
    namespace <prefix>-b (10.77.0.2): prefill-0

Everything the prefill worker does crosses the wire (its KV negotiates ucx over tcp
where ucxx is installed, else tcp: the host ids differ, so never shared memory).
Without namespaces everything runs on loopback and ``link_cut`` is skipped, saying why.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from tests.cluster import Host, free_port
from tests.netns import DEVICE, NetnsUnavailable, VethPair
from tests.pool_procs import PoolProc

T = TypeVar("T")
# UCX on its TCP transport over the wire, as tests/test_netns.py pins it: left to choose,
# UCX could reach a process on the same machine without crossing the veth.
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": DEVICE}


@dataclass
class Placement:
    """The wire (None on loopback, ``why_not`` then says why) and the hosts on it."""

    wire: VethPair | None
    why_not: str = ""

    @property
    def host(self) -> Host:
        if self.wire is None:
            return Host()
        return Host(self.wire.a.ip, self.wire.a.netns, UCX_ENV)

    def prefill_host(self, env: dict[str, str]) -> Host:
        if self.wire is None:
            return Host(env=env)
        return Host(self.wire.b.ip, self.wire.b.netns, {**UCX_ENV, **env})

    def run(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` where the cluster's side can be reached (inside namespace -a)."""
        return fn(*args) if self.wire is None else self.wire.a.call(fn, *args)

    def delete(self) -> None:
        if self.wire is not None:
            self.wire.delete()


def place(prefix: str = "pdchaos") -> Placement:
    pair = VethPair(f"{prefix}-{os.getpid()}")
    try:
        return Placement(pair.create())
    except NetnsUnavailable as exc:
        return Placement(None, f"no network namespaces here: {exc}")
    except RuntimeError as exc:  # an odd kernel; create() left nothing behind
        return Placement(None, f"no veth pair here: {exc}")


@dataclass
class HostedPoolProc(PoolProc):
    """A cache pool on ``host`` (its namespace and address) instead of loopback."""

    host: Host = field(default_factory=Host)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.control = f"tcp://{self.host.ip}:{free_port()}"
        self.events = f"tcp://{self.host.ip}:{free_port()}"

    def command(self, learn_block_bytes: bool = False) -> list[str]:
        cmd = super().command(learn_block_bytes)
        if self.host.netns:  # ip execs the command: the pid is the pool's
            cmd = ["ip", "netns", "exec", self.host.netns, *cmd]
        return cmd

    def env(self) -> dict[str, str]:
        return {**super().env(), **self.host.env}


def corrupt_env(path: Path) -> dict[str, str]:
    """The prefill worker's environment for the ``corrupt_kv`` fault: its KV senders
    spoil chunks while ``path`` says so (common/transfer/fault_hook.py)."""
    return {"PDSERVE_TEST_CORRUPT_KV": str(path)}
