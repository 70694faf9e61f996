"""The cache pool and its client on two "hosts" (network namespaces joined by a veth,
``tests/netns.py``): the client listens on the address that routes to the pool, the
pool's gets find their way back, and the block bytes cross the wire on the backend the
two negotiate (ucx over tcp where ucxx is installed, else tcp), byte for byte.

The pool listens on every interface (``--kv-host 0.0.0.0``), so its advert names a
wildcard host that the client replaces with the host of the pool's control address.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.cluster import ROOT, stats
from tests.netns import DEVICE, veth_pair_or_skip
from tests.pool_procs import BLOCK

pytestmark = pytest.mark.timeout(120)

UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": DEVICE}  # as in test_netns.py
BLOCKS = 24


def _ucx_importable() -> bool:
    from common.transfer import available_backends

    return "ucx" in available_backends()


CLIENT = """
import asyncio, json, random, sys
import zmq.asyncio
from common.pool.client import PoolClient

control, backend, host_id, n, size = sys.argv[1:6]
n, size = int(n), int(size)

async def main():
    ctx = zmq.asyncio.Context()
    client = PoolClient(ctx, {"a": control}, transfer_backend=backend, host_id=host_id,
                        timeout_s=10.0)
    rng = random.Random(5)
    chain = [(rng.getrandbits(64), rng.randbytes(size), d) for d in range(n)]
    try:
        stored = await client.put(chain)
        got = await client.get([k for k, _, _ in chain])
        return {"stored": stored, "exact": got == [d for _, d, _ in chain],
                "got": len(got), "counts": dict(client.counts),
                "endpoints": client.receiver.advert().endpoints, "live": client.receiver.live(),
                "inbox": len(client.inbox)}
    finally:
        await client.close()
        ctx.destroy(linger=0)

print(json.dumps(asyncio.run(main())))
"""


@pytest.fixture(scope="module")
def wire():
    with veth_pair_or_skip("pdpool") as pair:
        yield pair


@pytest.fixture(scope="module")
def pool(wire, tmp_path_factory):
    control = f"tcp://{wire.a.ip}:25580"
    log = tmp_path_factory.mktemp("pool-netns") / "pool.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), **UCX_ENV}
    proc = subprocess.Popen(
        ["ip", "netns", "exec", wire.a.netns, sys.executable, "-m", "services.cache_pool",
         "--control-addr", control, "--events-addr", f"tcp://{wire.a.ip}:25581",
         "--kv-host", "0.0.0.0", "--host-id", wire.a.netns, "--block-bytes", str(BLOCK),
         "--dram-mib", repr(4 * BLOCKS * BLOCK / (1 << 20)), "--log-format", "console"],
        cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                wire.b.call(stats, control, 0.5)
                break
            except TimeoutError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        yield control
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("backend", ["tcp", "auto"])
def test_put_and_get_cross_the_wire_on_the_negotiated_backend(wire, pool, backend):
    expected = "tcp" if backend == "tcp" or not _ucx_importable() else "ucx"
    before = wire.b.call(stats, pool).transfers
    sent_b, sent_a = wire.b.tx_bytes(), wire.a.tx_bytes()
    env = {**os.environ, "PYTHONPATH": str(ROOT), **UCX_ENV}
    out = subprocess.run(
        ["ip", "netns", "exec", wire.b.netns, sys.executable, "-c", CLIENT, pool, backend,
         wire.b.netns, str(BLOCKS), str(BLOCK)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    nbytes = BLOCKS * BLOCK
    assert (result["stored"], result["got"], result["exact"]) == (BLOCKS, BLOCKS, True)
    assert result["counts"] == {"transfers": 2, "transfer_out_bytes": nbytes,
                                "transfer_in_bytes": nbytes, f"backend_{expected}": 1}
    assert (result["live"], result["inbox"]) == (0, 0)
    # The client listened on its side of the wire, where the pool could reach it.
    assert all(f"://{wire.b.ip}:" in a for k, a in result["endpoints"].items()
               if k != "shm")
    after = wire.b.call(stats, pool)
    gained = {k: v - before.get(k, 0) for k, v in after.transfers.items()
              if v != before.get(k, 0)}
    assert gained == {"in_ok": 1, "in_bytes": nbytes, "out_ok": 1, "out_bytes": nbytes,
                      f"out_{expected}": 1}
    assert (after.live_transfers, after.pending_puts, after.sending_gets) == (0, 0, 0)
    # And the bytes crossed the wire, each way.
    assert wire.b.tx_bytes() - sent_b >= nbytes and wire.a.tx_bytes() - sent_a >= nbytes
