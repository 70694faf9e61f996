"""The faults of ``bench/chaos.py``: each a small blocking function of a ``Target`` (the
running cluster, its cache pool and a way to send extra load) that strikes once and
says what it did in a ``Strike``.

A killed or stopped process is started again at once with its own arguments and
addresses, as a supervisor would (``Cluster.restart``, ``PoolProc.start``); whether the
fault really struck is checked, not assumed: the signalled pid must be gone, a cut wire
must carry nothing, a spoiled chunk must have been caught by the receiver's checksum.
A fault this machine cannot carry out (``link_cut`` without network namespaces) is
skipped, and its ``Strike`` says why.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from bench.chaos_netns import Placement
from tests.cluster import Cluster
from tests.pool_procs import PoolProc

PREFILL, DECODE = "prefill-0", "decode-2"  # the two decode workers are decode-1, decode-2


@dataclass
class Target:
    """What the faults act on. ``overload(n, over_s)`` sends ``n`` extra requests spread
    over ``over_s`` seconds and returns without waiting for them."""

    cluster: Cluster
    pool: PoolProc
    overload: Callable[[int, float], None]
    rate: float
    placement: Placement = field(default_factory=lambda: Placement(None, "not asked for"))
    corrupt_file: Path | None = None  # the prefill worker's PDSERVE_TEST_CORRUPT_KV file
    restarts: list[str] = field(default_factory=list)


class Skipped(Exception):
    """The fault cannot be carried out on this machine; the message says why."""


@dataclass(frozen=True, slots=True)
class Strike:
    """One fault as it happened: ``struck`` is the check that it took effect."""

    name: str
    start_s: float
    end_s: float
    struck: bool
    detail: str
    skipped: bool = False


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _kill_and_restart(t: Target, name: str, sig: int) -> tuple[bool, str]:
    proc = t.cluster.procs[name]
    pid = proc.popen.pid
    proc.popen.send_signal(sig)
    try:
        code = proc.popen.wait(15)
    except subprocess.TimeoutExpired:  # a SIGTERM that does not end it within 15 s
        proc.popen.kill()
        code = proc.popen.wait()
    gone = pid_gone(pid)
    t.cluster.restart(name)
    t.restarts.append(name)
    t.cluster.wait_alive(name)
    return gone, f"pid {pid} exited {code}, restarted as pid {t.cluster.procs[name].popen.pid}"


def prefill_sigkill(t: Target) -> tuple[bool, str]:
    return _kill_and_restart(t, PREFILL, signal.SIGKILL)


def prefill_sigterm(t: Target) -> tuple[bool, str]:
    return _kill_and_restart(t, PREFILL, signal.SIGTERM)


def decode_sigkill(t: Target) -> tuple[bool, str]:
    return _kill_and_restart(t, DECODE, signal.SIGKILL)


def conductor_sigterm(t: Target) -> tuple[bool, str]:
    return _kill_and_restart(t, "conductor", signal.SIGTERM)


def pool_restart(t: Target) -> tuple[bool, str]:
    pid = t.pool.popen.pid
    code = t.pool.stop(signal.SIGTERM)
    gone = pid_gone(pid)
    t.pool.start(learn_block_bytes=True)  # as at first: the workers' block size
    t.restarts.append(t.pool.instance)
    return gone, f"pid {pid} exited {code}, restarted as pid {t.pool.popen.pid}"


def overload(t: Target) -> tuple[bool, str]:
    """Ten times the steady rate for three seconds."""
    n = max(10, round(10 * t.rate * 3))
    t.overload(n, 3.0)
    return True, f"{n} extra requests over 3 s"


# ------------------------------------------------------------------- malformed input

_HOST_PORT = re.compile(r"(?:tcp://)?\[?([0-9a-fA-F.:]+?)\]?:(\d+)$")


def internal_ports(t: Target) -> list[tuple[str, str, int]]:
    """(what, host, port) of every TCP port the cluster's internal processes listen on."""
    c = t.cluster
    addrs = [("conductor", c.conductor_addr), ("heartbeat", c.heartbeat_addr),
             ("pool-control", t.pool.control), ("pool-events", t.pool.events)]
    gw = c.procs["gateway"].args
    addrs.append(("gateway-stream", gw[gw.index("--stream-bind") + 1]))
    for name, proc in c.procs.items():
        if name in ("conductor", "gateway"):
            continue
        addrs.append((f"{name}-control", proc.control))
        try:
            advert = c.worker_stats(name).kv_advert
        except TimeoutError:
            continue
        for kind, addr in (advert.endpoints if advert else {}).items():
            addrs.append((f"{name}-kv-{kind}", str(addr)))
    out = []
    for what, addr in addrs:
        m = _HOST_PORT.search(addr)
        if m:
            out.append((what, m.group(1), int(m.group(2))))
    return out


def _tcp_junk(host: str, port: int, payloads: list[bytes]) -> list[bytes]:
    """Each payload on a connection of its own; the first bytes of each answer (b"" for
    none) for every connection that took its payload."""
    answers = []
    for data in payloads:
        try:
            with socket.create_connection((host, port), timeout=2) as s:
                s.sendall(data)
                s.settimeout(1.0)
                answer = b""
                with contextlib.suppress(OSError):  # an answer is welcome, not needed
                    answer = s.recv(4096)
                answers.append(answer)
        except OSError:
            pass
    return answers


def _http_junk(t: Target) -> list[str]:
    """Malformed requests to the HTTP port; the status line of each answer."""
    model = t.cluster.model
    deep = "[" * 100_000 + "]" * 100_000
    bodies = [b"\x00\xff" * 512, b"{not json", deep.encode(),
              json.dumps({"model": model, "prompt": [[[[1]]]], "max_tokens": 4}).encode(),
              json.dumps({"model": model, "prompt": [1, 2], "max_tokens": "x"}).encode()]
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    raw = [head.encode() + f"Content-Length: {len(b)}\r\n\r\n".encode() + b for b in bodies]
    raw += [b"GARBAGE\r\n\r\n", os.urandom(4096), b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 5000]
    answers = _tcp_junk(t.cluster.host.ip, t.cluster.http_port, raw)
    return [a.split(b"\r\n", 1)[0].decode(errors="replace")[9:12] or "none" for a in answers]


def _zmq_junk(addr: str) -> int:
    """Malformed frames to the gateway's open client port: garbage, bad msgpack, deep
    nesting; each should be answered with an error, none may stop the gateway."""
    frames = [[b"\xc1\xff\x00"], [b"\x81\xa1v\x01"], [b"\x91" * 100_000 + b"\x00"],
              [os.urandom(1024)], [b"", b"", b""]]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    try:
        for f in frames:
            sock.send_multipart(f)
        replies = 0
        deadline = time.monotonic() + 3
        while replies < len(frames) and sock.poll(
                max(1, int((deadline - time.monotonic()) * 1000))):
            sock.recv_multipart()
            replies += 1
        return replies
    finally:
        sock.close(0)
        ctx.term()


def junk(t: Target) -> tuple[bool, str]:
    """Garbage to every listening port; it struck, and was handled, if the ports took it,
    no HTTP answer was a 5xx and every process is still running afterwards."""
    http = _http_junk(t)
    replies = _zmq_junk(t.cluster.zmq_addr)
    internal = internal_ports(t)
    sent = sum(len(_tcp_junk(h, p, [os.urandom(2048), b"\xff" * 64 + b"\x00" * 64]))
               for _, h, p in internal)
    dead = [n for n, p in t.cluster.procs.items() if p.popen.poll() is not None]
    if t.pool.popen.poll() is not None:
        dead.append(t.pool.instance)
    return (bool(http) and not any(h.startswith("5") for h in http) and sent > 0
            and not dead,
            f"http statuses {http}, zmq client port {replies}/5 error replies, "
            f"{sent} junk connections to {len(internal)} internal ports; dead after: {dead}")


# ---------------------------------------------------------------- wire and KV faults

CUT_S = 3.0  # a link cut lasts this long: under the KV lease, over a heartbeat or two
SPOIL_S = (2.0, 10.0)  # a corrupt_kv phase lasts at least, at most this long


def link_cut(t: Target) -> tuple[bool, str]:
    """The prefill worker's link down for ``CUT_S``, then up again; it struck if nothing
    left its side meanwhile. Took ends once the conductor lists it alive again."""
    wire = t.placement.wire
    if wire is None:
        raise Skipped(t.placement.why_not)
    side = wire.b
    side.link(up=False)
    try:
        before = side.tx_bytes()
        time.sleep(CUT_S)
        silent = side.tx_bytes() == before
    finally:
        side.link(up=True)
    t.cluster.wait_alive(PREFILL)
    return silent, f"{side.device} in {side.netns} down {CUT_S:.0f} s " \
        f"({'nothing' if silent else 'SOMETHING'} sent meanwhile), then up"


def _kv_counts(t: Target) -> tuple[int, int, int]:
    """(chunks the prefill worker resent, chunks decode workers asked for again, their
    local fall-backs)."""
    decodes = [t.cluster.worker_stats(n) for n in t.cluster.procs if n.startswith("decode")]
    return (t.cluster.worker_stats(PREFILL).kv_chunks_resent,
            sum(s.kv_chunks_retried for s in decodes), sum(s.local_fallbacks for s in decodes))


def _phase(t: Target, mode: str, seen: Callable[[tuple, tuple], bool]) -> tuple:
    """Spoil in ``mode`` for at least ``SPOIL_S[0]`` and until ``seen(before, now)`` (a
    transfer crossed meanwhile), at most ``SPOIL_S[1]``; the counts at its end."""
    was = _kv_counts(t)
    start = time.monotonic()
    t.corrupt_file.write_text(mode)
    while True:
        time.sleep(0.5)
        now = _kv_counts(t)
        took = time.monotonic() - start
        if took >= SPOIL_S[1] or (took >= SPOIL_S[0] and seen(was, now)):
            return now


def corrupt_kv(t: Target) -> tuple[bool, str]:
    """The prefill worker's KV spoiled in flight: first attempts only (each chunk is
    resent and arrives intact), then every attempt (the transfers fail on their
    checksum and the decode workers prefill locally). It struck if, in the first phase,
    receivers' checksums caught chunks and, in the second, decode workers fell back."""
    if t.corrupt_file is None:
        raise Skipped("the prefill worker was started without PDSERVE_TEST_CORRUPT_KV")
    was = _kv_counts(t)
    try:
        mid = _phase(t, "first", lambda a, b: b[1] > a[1])
        now = _phase(t, "all", lambda a, b: b[2] > a[2])
    finally:
        t.corrupt_file.write_text("off")
    caught, fell_back = mid[1] - was[1], now[2] - mid[2]
    return caught > 0 and fell_back > 0, (
        f"first attempts spoiled: {mid[0] - was[0]} chunks resent, {caught} caught; "
        f"every attempt spoiled: {now[1] - mid[1]} caught, {fell_back} local fall-backs")


FAULTS: dict[str, Callable[[Target], tuple[bool, str]]] = {
    "prefill_sigkill": prefill_sigkill, "prefill_sigterm": prefill_sigterm,
    "decode_sigkill": decode_sigkill, "conductor_sigterm": conductor_sigterm,
    "pool_restart": pool_restart, "junk": junk, "overload": overload,
    "link_cut": link_cut, "corrupt_kv": corrupt_kv,
}


def strike(t: Target, name: str, t0: float) -> Strike:
    start = time.monotonic() - t0
    skipped = False
    try:
        struck, detail = FAULTS[name](t)
    except Skipped as e:
        struck, detail, skipped = False, f"skipped: {e}", True
    # A fault that could not be carried out is a result to report, not a crash.
    except Exception as e:  # noqa: BLE001
        struck, detail = False, f"{type(e).__name__}: {e}"
    return Strike(name, start, time.monotonic() - t0, struck, detail, skipped)
