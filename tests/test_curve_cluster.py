"""A real cluster with CURVE on: the test's own unkeyed or wrong-role peers are not
heard, and a decode worker told to stream to fifty addresses keeps its descriptors
bounded."""

from __future__ import annotations

import asyncio
import os

import pytest

from common.protocol import Generate, Hello, SamplingParams, WorkerInfo
from common.zmq_auth import make_context
from common.zmq_rpc import RemoteError, RpcClient, RpcTimeout
from services.engine.tokenizer_export import tokenizer_dir_for
from services.engine.weights import DEFAULT_MODEL
from tests.cluster import Cluster, free_port, stats

pytestmark = pytest.mark.timeout(180)

GATEWAY = ["--tokenizer-dir", tokenizer_dir_for(DEFAULT_MODEL), "--max-model-len", "8192"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(DEFAULT_MODEL, tmp_path_factory.mktemp("curve"), ["decode"], executor="sim",
                sim_profile="smollm2-cpu", gateway_args=GATEWAY,
                worker_args=["--sim-time-scale", "0.02", "--heartbeat-interval-s", "0.3"])
    c.start(timeout_s=60)
    yield c
    c.stop()


def fake_worker(wid: str) -> Hello:
    return Hello(info=WorkerInfo(
        worker_id=wid, role="decode", model=DEFAULT_MODEL, control_addr="tcp://127.0.0.1:1",
        kv_addr="tcp://127.0.0.1:2", host_id="h", block_size=16, num_blocks=64,
        fingerprint="f"))


async def test_unkeyed_and_client_role_peers_cannot_register_a_worker(cluster):
    with pytest.raises(TimeoutError):  # the cluster really runs CURVE
        stats(cluster.conductor_addr, 1)
    before = set(cluster.conductor_workers())
    plain = make_context("", "client")
    tool = make_context(cluster.keys_dir, "client")
    try:
        keyless = RpcClient(plain, cluster.conductor_addr, name="keyless")
        with pytest.raises(RpcTimeout):
            await keyless.call(fake_worker("fake-0"), timeout=1.0)
        keyed = RpcClient(tool, cluster.conductor_addr, name="tool", server="conductor")
        with pytest.raises(RemoteError) as err:
            await keyed.call(fake_worker("fake-1"), timeout=5.0)
        assert err.value.code == "forbidden"
        for client in (keyless, keyed):
            await client.close()
    finally:
        plain.destroy(linger=0)
        tool.destroy(linger=0)
    assert set(cluster.conductor_workers()) == before == {"decode-0"}


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def test_generates_naming_fifty_stream_addresses_leave_descriptors_bounded(cluster):
    pid = cluster.procs["decode-0"].popen.pid
    ctx = make_context(cluster.keys_dir, "gateway")
    client = RpcClient(ctx, cluster.procs["decode-0"].control, name="gw", server="worker")
    sampling = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    try:
        await client.call(Generate(prompt_token_ids=[1, 2, 3], sampling=sampling,
                                   stream_addr=f"tcp://127.0.0.1:{free_port()}"),
                          request_id="warm", timeout=10)
        await asyncio.sleep(1.0)
        before = open_fds(pid)
        for i in range(50):
            await client.call(Generate(prompt_token_ids=[1, 2, 3 + i], sampling=sampling,
                                       stream_addr=f"tcp://127.0.0.1:{free_port()}"),
                              request_id=f"r{i}", timeout=10)
        await asyncio.sleep(2.0)  # the tokens are out, to addresses nobody listens on
        grown = open_fds(pid) - before
        assert grown < 40, f"{grown} more descriptors after 50 stream addresses"
    finally:
        await client.close()
        ctx.destroy(linger=0)
