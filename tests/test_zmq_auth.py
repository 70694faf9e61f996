"""CURVE on the control plane: only processes holding a role's key are heard, and each
role only for the messages it may send; plain mode still works; token streams stay
bounded whatever addresses requests name."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil

import pytest
import zmq.asyncio
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from common.protocol import (
    Abort,
    Ack,
    GetStats,
    Heartbeat,
    Hello,
    Tokens,
    WorkerInfo,
)
from common.zmq_auth import (
    KEY_NAMES,
    PLAIN_WARNING,
    ROLES,
    CurveKeys,
    generate_keys,
    make_context,
)
from common.zmq_io import Publisher, PushSocket
from common.zmq_metrics import ControlMetrics
from common.zmq_policy import WORKER_CONTROL
from common.zmq_rpc import RemoteError, RpcClient, RpcServer, RpcTimeout
from services.cli import main as cli_main
from services.conductor.server import Conductor, ConductorSettings
from services.gateway.cluster_backend import ClusterBackend
from services.worker.token_streams import TokenStreams
from tests.cluster import free_port


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    out = tmp_path_factory.mktemp("keys")
    assert cli_main(["keys", "--out", str(out)]) == 0
    return str(out)


@pytest.fixture(scope="module")
def rogue_keys(tmp_path_factory, keys):
    """Valid CURVE key pairs this deployment never admitted, beside its public keys (so
    a rogue knows whom to connect to, as anyone on the host may)."""
    out = tmp_path_factory.mktemp("rogue")
    generate_keys(out)
    for name in KEY_NAMES:
        shutil.copy(os.path.join(keys, f"{name}.key"), out / f"{name}.key")
    return str(out)


@pytest.fixture
async def contexts(keys):
    made: list[zmq.asyncio.Context] = []

    def make(role: str, keys_dir: str | None = None) -> zmq.asyncio.Context:
        ctx = make_context(keys if keys_dir is None else keys_dir, role)
        made.append(ctx)
        return ctx

    yield make
    for ctx in made:
        ctx.destroy(linger=0)


def info(wid: str, role: str = "decode") -> WorkerInfo:
    return WorkerInfo(worker_id=wid, role=role, model="m", control_addr=f"tcp://{wid}:1",
                      kv_addr=f"tcp://{wid}:2", host_id=wid, block_size=16, num_blocks=64,
                      fingerprint="f")


def test_pdserve_keys_writes_a_loadable_pair_per_role(keys):
    for name in KEY_NAMES:
        assert os.stat(os.path.join(keys, f"{name}.key_secret")).st_mode & 0o077 == 0
    loaded = [CurveKeys.load(keys, role) for role in ROLES]
    assert len({k.own.public for k in loaded}) == len(ROLES)  # a distinct pair per role
    assert {k.roles_by_key[k.own.public] for k in loaded} == set(ROLES)
    with pytest.raises(ValueError, match="role"):
        CurveKeys.load(keys, "mallory")
    with pytest.raises(ValueError, match="cannot read"):
        CurveKeys.load(os.path.join(keys, "missing"), "decode")


@pytest.fixture
async def conductor(keys):
    c = Conductor(ConductorSettings(
        control_addr=f"tcp://127.0.0.1:{free_port()}",
        heartbeat_addr=f"tcp://127.0.0.1:{free_port()}", heartbeat_interval_s=60.0,
        curve_keys_dir=keys))
    await c.start()
    yield c
    await c.close()


async def test_only_a_worker_key_registers_a_worker(conductor, contexts, rogue_keys):
    addr = conductor.rpc.address
    plain = zmq.asyncio.Context()
    try:
        keyless = RpcClient(plain, addr, name="keyless")
        with pytest.raises(RpcTimeout):  # no CURVE handshake: never heard
            await keyless.call(Hello(info=info("fake-0")), timeout=0.5)
        await keyless.close()
    finally:
        plain.destroy(linger=0)
    # A real key pair, but not one of this deployment's: the ZAP handler refuses it.
    rogue = RpcClient(contexts("decode", rogue_keys), addr, name="rogue", server="conductor")
    with pytest.raises(RpcTimeout):
        await rogue.call(Hello(info=info("fake-1")), timeout=0.5)
    assert conductor.ctx.refused >= 1
    # A known key of a role that may not register workers.
    tool = RpcClient(contexts("client"), addr, name="tool", server="conductor")
    with pytest.raises(RemoteError) as err:
        await tool.call(Hello(info=info("fake-2")), timeout=2)
    assert err.value.code == "forbidden"
    assert conductor.rpc.forbidden == 1
    metric = conductor.metrics.get_sample_value  # what its /metrics serves
    assert metric("pdserve:control_forbidden_total", {
        "endpoint": "control", "role": "client", "message_type": "hello"}) == 1
    assert metric("pdserve:control_unknown_keys_total") >= 1  # the rogue key
    assert conductor.registry.workers == {}
    assert (await tool.call(GetStats(), timeout=2)).record.workers == []  # stats: any role
    worker = RpcClient(contexts("decode"), addr, name="worker", server="conductor")
    await worker.call(Hello(info=info("decode-0")), timeout=2)
    assert set(conductor.registry.workers) == {"decode-0"}
    for client in (rogue, tool, worker):
        await client.close()


async def test_heartbeats_from_a_non_worker_role_are_dropped(conductor, contexts):
    beat = Heartbeat(worker_id="decode-0", role="decode", seq=0, waiting=0, running=0,
                     queued_prefill_tokens=0, free_blocks=1, total_blocks=64,
                     step_time_ms=0.0)
    tool = Publisher(contexts("client"), conductor.settings.heartbeat_addr, bind=False,
                     server="conductor")
    for _ in range(40):
        await tool.publish(beat)
        await asyncio.sleep(0.05)
        if conductor.sub.forbidden:
            break
    assert conductor.sub.forbidden >= 1
    assert conductor.metrics.get_sample_value("pdserve:control_forbidden_total", {
        "endpoint": "sub", "role": "client", "message_type": "heartbeat"}) >= 1
    await tool.close()


async def test_tokens_are_taken_only_from_worker_roles(contexts):
    backend = ClusterBackend(contexts("gateway"), "tcp://127.0.0.1:1", "tcp://127.0.0.1:0",
                             "m")
    await backend.start()
    queue: asyncio.Queue = asyncio.Queue()
    backend.queues["r1"] = queue
    forged = Tokens(position=1, token_ids=[666], finished=True, finish_reason="stop")
    plain = zmq.asyncio.Context()
    keyless = PushSocket(plain, backend.stream_addr, bind=False)
    tool = PushSocket(contexts("client"), backend.stream_addr, bind=False, server="gateway")
    real = PushSocket(contexts("decode"), backend.stream_addr, bind=False, server="gateway")
    try:
        # A PUSH whose only peer refused the handshake may have no pipe to queue into:
        # its send then waits for a peer that never comes. Not arriving is the point.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(keyless.send(forged, request_id="r1"), 2)
        await tool.send(forged, request_id="r1")
        for _ in range(40):
            if backend.pull.forbidden:
                break
            await asyncio.sleep(0.05)
        assert backend.pull.forbidden == 1
        assert _forbidden(backend.ctx) == {("pull", "client", "tokens"): 1}
        await real.send(Tokens(position=1, token_ids=[7]), request_id="r1")
        got = await asyncio.wait_for(queue.get(), 5)
        assert got.token_ids == [7]
        await asyncio.sleep(0.2)
        assert queue.empty()  # the keyless push never arrived either
    finally:
        for sock in (keyless, tool, real):
            await sock.close()
        plain.destroy(linger=0)
        await backend.close()


def _forbidden(ctx) -> dict[tuple[str, str, str], float]:
    """The ``pdserve:control_forbidden_total`` samples a registry with ``ctx``'s
    ControlMetrics exposes, by (endpoint, role, message type)."""
    registry = CollectorRegistry()
    registry.register(ControlMetrics(ctx))
    return {(s.labels["endpoint"], s.labels["role"], s.labels["message_type"]): s.value
            for m in registry.collect() for s in m.samples
            if s.name == "pdserve:control_forbidden_total"}


class Recorder:
    def __init__(self) -> None:
        self.seen: list[str] = []

    async def __call__(self, msg):
        self.seen.append(msg.envelope.type)
        return Ack()


async def test_worker_takes_abort_only_from_gateway_or_decode(contexts):
    handler = Recorder()
    ctx = contexts("decode")
    server = RpcServer(ctx, "tcp://127.0.0.1:0", handler, name="worker",
                       allowed=WORKER_CONTROL)
    await server.start()
    plain = zmq.asyncio.Context()
    keyless = RpcClient(plain, server.address, name="keyless")
    clients = {role: RpcClient(contexts(role), server.address, name=role, server="worker")
               for role in ("client", "prefill", "gateway", "decode")}
    try:
        with pytest.raises(RpcTimeout):
            await keyless.call(Abort(), request_id="r1", timeout=0.5)
        for role in ("client", "prefill"):
            with pytest.raises(RemoteError) as err:
                await clients[role].call(Abort(), request_id="r1", timeout=2)
            assert err.value.code == "forbidden"
        assert handler.seen == []
        for role in ("gateway", "decode"):
            await clients[role].call(Abort(), request_id="r1", timeout=2)
        assert handler.seen == ["abort", "abort"]
        assert server.forbidden == 2
        assert _forbidden(ctx) == {("control", "client", "abort"): 1,
                                           ("control", "prefill", "abort"): 1}
    finally:
        for client in (keyless, *clients.values()):
            await client.close()
        plain.destroy(linger=0)
        await server.close()


async def test_plain_mode_serves_everyone_and_says_so():
    with capture_logs() as logs:
        ctx = make_context("", "conductor")
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == [PLAIN_WARNING]
    handler = Recorder()
    server = RpcServer(ctx, "tcp://127.0.0.1:0", handler, name="worker",
                       allowed=WORKER_CONTROL)
    await server.start()
    client = RpcClient(ctx, server.address, name="any", server="worker")
    try:
        await client.call(Hello(info=info("w")), timeout=2)
        await client.call(Abort(), request_id="r1", timeout=2)
        assert handler.seen == ["hello", "abort"]
    finally:
        await client.close()
        await server.close()
        ctx.destroy(linger=0)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_token_streams_to_many_addresses_keep_descriptors_bounded(contexts):
    streams = TokenStreams(contexts("decode"), max_streams=4, idle_close_s=0.3)
    ports = [free_port() for _ in range(50)]
    streams.send(f"tcp://127.0.0.1:{ports[0]}", "r0", Tokens(position=1, token_ids=[1]))
    await asyncio.sleep(0.1)
    before = open_fds()
    try:
        for i, port in enumerate(ports[1:], 1):
            streams.send(f"tcp://127.0.0.1:{port}", f"r{i}", Tokens(position=1, token_ids=[i]))
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert len(streams) <= 4
        assert open_fds() - before <= 3 * 4  # a few per stream, not one per address
        await asyncio.sleep(0.6)
        assert len(streams) == 0  # idle streams close
    finally:
        await streams.close()


def test_every_service_takes_curve_keys_dir_from_env_and_flags():
    from common.config import load_settings
    from services.cache_pool.settings import PoolSettings
    from services.gateway.server import GatewaySettings
    from services.worker.settings import WorkerSettings

    for cls, section in ((ConductorSettings, "conductor"), (GatewaySettings, "gateway"),
                         (WorkerSettings, "decode"), (PoolSettings, "cache_pool")):
        assert load_settings(cls, section, [], env={}).curve_keys_dir == ""
        env = {"PDSERVE_CURVE_KEYS_DIR": "/k/env"}
        assert load_settings(cls, section, [], env=env).curve_keys_dir == "/k/env"
        flags = ["--curve-keys-dir", "/k/flag"]
        assert load_settings(cls, section, flags, env=env).curve_keys_dir == "/k/flag"
