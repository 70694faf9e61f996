"""Every process binds what its configuration names: with a loopback configuration no
socket of gateway, conductor, worker or cache pool listens on every interface, the
Prometheus servers included. The data plane runs on tcp here: ucxx's listener cannot
bind one host (common/transfer/ucx_receiver.py)."""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import free_port
from tests.pool_procs import PoolProc
from tests.test_sim_cluster import sim_cluster

pytestmark = pytest.mark.timeout(120)

ANY = ("0.0.0.0", "::")


def _address(hex_addr: str) -> tuple[str, int]:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip = ".".join(str(b) for b in raw[::-1])
    else:  # /proc writes IPv6 as four host-order 32-bit words
        words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]
        ip = ":".join(b"".join(words)[i:i + 2].hex() for i in range(0, 16, 2))
        ip = "::" if set(ip) <= {"0", ":"} else ip
    return ip, int(port, 16)


def listening(pid: int) -> set[tuple[str, int]]:
    """(host, port) of the TCP sockets process ``pid`` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                found.add(_address(cols[1]))
    return found


def test_loopback_configuration_listens_on_loopback_only(tmp_path):
    ports = {"conductor": free_port(), "decode-0": free_port(), "pool": free_port()}
    pool = PoolProc("pool-0", tmp_path, extra=["--metrics-port", str(ports["pool"]),
                                               "--transfer-backend", "tcp"])
    pool.start()
    cluster = sim_cluster(tmp_path, ["decode"],
                          conductor_args=["--metrics-port", str(ports["conductor"])],
                          worker_args=["--metrics-port", str(ports["decode-0"]),
                                       "--transfer-backend", "tcp"])
    cluster.start(timeout_s=60)
    try:
        pids = {name: p.popen.pid for name, p in cluster.procs.items()}
        pids["pool"] = pool.popen.pid
        for name, port in ports.items():
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                assert r.status == 200 and b"pdserve" in r.read(), name
        for name, pid in pids.items():
            sockets = listening(pid)
            assert sockets, f"{name} listens on nothing"
            wide = {s for s in sockets if s[0] in ANY}
            assert not wide, f"{name} listens on every interface: {sorted(wide)}"
            if name in ports:
                assert ("127.0.0.1", ports[name]) in sockets
    finally:
        cluster.stop()
        pool.stop()


async def test_ucx_listener_binds_the_configured_host_or_says_it_cannot(monkeypatch):
    from common.transfer import ucx_receiver
    from common.transfer.ucx import load_ucxx

    try:
        load_ucxx()
    except ImportError as exc:
        pytest.skip(str(exc))
    warned = []
    monkeypatch.setattr(ucx_receiver.log, "warning", lambda event, **kw: warned.append(event))
    rx = ucx_receiver.UcxReceiver("127.0.0.1", 0, sink=lambda *a: None)
    await rx.start()
    try:
        port = int(rx.address.rsplit(":", 1)[1])
        hosts = {h for h, p in listening(os.getpid()) if p == port}
        assert hosts == {"127.0.0.1"} or (
            hosts <= set(ANY) and warned == ["kv_transfer.ucx_listens_on_every_interface"])
    finally:
        await rx.close()
