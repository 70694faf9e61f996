"""Cluster preflight: a worker whose KV cannot be exchanged with its model's others is
refused at Hello, field by field, with both values named; the registry keeps serving
the good ones and remembers the refusal."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import zmq.asyncio

from common.block_hash import BLOCK_HASH_ALGORITHM, BLOCK_HASH_SEED
from common.protocol import (
    PROTOCOL_VERSION,
    ConductorStats,
    GetStats,
    Heartbeat,
    HeldBlocks,
    Hello,
    ListWorkers,
    Resync,
    Welcome,
    WorkerInfo,
    WorkerList,
    WorkerStats,
)
from common.zmq_rpc import RemoteError, RpcClient, RpcServer
from services.conductor.compat import CHECKED, mismatch
from services.conductor.registry import REFUSALS_KEPT, Registry, WorkerView
from services.conductor.server import Conductor, ConductorSettings
from services.worker.handshake import KVLayout, hash_and_version, kv_layout
from tests.cluster import free_port


def info(wid: str, role: str = "decode", model: str = "m", **changes) -> WorkerInfo:
    base = WorkerInfo(
        worker_id=wid, role=role, model=model, control_addr=f"tcp://{wid}:1",
        kv_addr=f"tcp://{wid}:2", host_id=wid, block_size=16, num_blocks=64,
        fingerprint="fp", kv_dtype="float32", num_layers=4, num_kv_heads=2, head_dim=8,
        **hash_and_version())
    return dataclasses.replace(base, **changes)


# A value that differs from info()'s, for each checked field.
OTHER = {"protocol_version": PROTOCOL_VERSION + 1, "block_size": 32,
         "block_hash": "md5-chain-v0", "block_hash_seed": 7, "kv_dtype": "bfloat16",
         "num_layers": 5, "num_kv_heads": 4, "head_dim": 16, "fingerprint": "other"}


def test_every_kv_field_is_checked_and_has_a_test_value():
    assert set(CHECKED) == set(OTHER)


@pytest.mark.parametrize("name", CHECKED)
def test_a_differing_kv_field_is_named_with_both_values(name):
    ref, new = info("d0"), info("d1", **{name: OTHER[name]})
    found = mismatch(ref, new)
    assert (found.field, found.expected, found.got, found.reference_id) == \
        (name, getattr(ref, name), OTHER[name], "d0")
    assert found.reason.startswith(f"{name} {OTHER[name]!r} differs from "
                                   f"{getattr(ref, name)!r} of d0")


def test_what_kv_exchange_does_not_depend_on_is_not_checked():
    ref = info("d0")
    # TP sizes differ between prefill and decode by design; the KV heads are the model's.
    assert mismatch(ref, info("p0", role="prefill", tp_size=4, num_blocks=9999,
                              host_id="elsewhere")) is None
    assert mismatch(ref, ref) is None


def test_the_most_basic_difference_is_the_one_named():
    # A different block size changes the fingerprint too: the cause is named, not it.
    found = mismatch(info("d0"), info("d1", block_size=32, fingerprint="other",
                                      kv_dtype="bfloat16"))
    assert found.field == "block_size"


def test_worker_reports_this_builds_hash_and_protocol():
    assert hash_and_version() == {"block_hash": BLOCK_HASH_ALGORITHM,
                                  "block_hash_seed": BLOCK_HASH_SEED,
                                  "protocol_version": PROTOCOL_VERSION}


def test_kv_layout_of_the_simulated_engine():
    from common.cost_profile import load_profile
    from services.engine.sim import SimEngine

    engine = SimEngine(load_profile("zero"), block_size=16, num_blocks=8, kv_layers=3)
    assert kv_layout(engine) == KVLayout("sim", 3, 0, 0)


def test_kv_layout_of_the_model_counts_the_models_heads(tmp_path):
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine
    from tests.tiny_models import make_tiny_model

    path = make_tiny_model(tmp_path / "m", "llama")
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu",
                                    kv_cache_bytes=1 << 20))
    # tiny_models: 2 layers, 4 heads of which 2 KV heads, hidden size 64: head dim 16.
    assert kv_layout(engine) == KVLayout("float32", 2, 2, 16)


# --- the registry -----------------------------------------------------------------------

def test_first_registered_is_the_reference_and_a_mismatch_is_refused_and_kept():
    reg = Registry()
    assert reg.admit(WorkerView(info("d0"))) is None
    assert reg.admit(WorkerView(info("p0", role="prefill", tp_size=2))) is None
    found = reg.admit(WorkerView(info("d1", block_size=32)))
    assert (found.field, found.expected, found.got) == ("block_size", 16, 32)
    assert list(reg.workers) == ["d0", "p0"]  # the good ones, still listed
    [refusal] = reg.refusals()
    assert (refusal.worker_id, refusal.role, refusal.model, refusal.setting) == \
        ("d1", "decode", "m", "block_size")
    assert refusal.reason == found.reason and refusal.at > 0
    assert reg.refusals("other-model") == []
    # Another model has its own reference.
    assert reg.admit(WorkerView(info("x0", model="other-model", block_size=32))) is None


def test_reference_is_the_first_live_worker_not_the_worker_itself():
    reg = Registry()
    assert reg.admit(WorkerView(info("d0"))) is None
    assert reg.admit(WorkerView(info("d1"))) is None
    # d0 restarted with another block size while d1 lives: d1 is the reference now.
    found = reg.admit(WorkerView(info("d0", block_size=32)))
    assert (found.field, found.reference_id) == ("block_size", "d1")
    # Every worker of the old settings gone: the new settings are accepted.
    reg.workers["d0"].alive = reg.workers["d1"].alive = False
    assert reg.admit(WorkerView(info("d0", block_size=32))) is None
    assert reg.refusals() == []  # admitted since: no longer listed as refused
    assert reg.workers["d0"].block_size == 32
    found = reg.admit(WorkerView(info("d1")))
    assert (found.field, found.expected, found.got, found.reference_id) == \
        ("block_size", 32, 16, "d0")


def test_refusals_kept_are_bounded_latest_last():
    reg = Registry()
    reg.admit(WorkerView(info("d0")))
    for i in range(REFUSALS_KEPT + 3):
        assert reg.admit(WorkerView(info(f"bad-{i}", kv_dtype="float16"))) is not None
    kept = [r.worker_id for r in reg.refusals()]
    assert kept == [f"bad-{i}" for i in range(3, REFUSALS_KEPT + 3)]
    reg.admit(WorkerView(info("bad-3", head_dim=4)))  # refused again: moves to the end
    assert [r.worker_id for r in reg.refusals()][-1] == "bad-3"
    assert reg.refusals()[-1].setting == "head_dim"


# --- the live conductor -----------------------------------------------------------------

async def test_conductor_refuses_a_mismatched_hello_and_serves_the_rest():
    conductor = Conductor(ConductorSettings(
        control_addr=f"tcp://127.0.0.1:{free_port()}",
        heartbeat_addr=f"tcp://127.0.0.1:{free_port()}", heartbeat_interval_s=60.0))
    await conductor.start()
    ctx = zmq.asyncio.Context()
    client = RpcClient(ctx, conductor.rpc.address, name="test")
    try:
        for w in (info("d0"), info("p0", role="prefill", tp_size=2)):
            assert isinstance((await client.call(Hello(info=w), timeout=5)).record, Welcome)
        with pytest.raises(RemoteError) as err:
            await client.call(Hello(info=info("d1", kv_dtype="bfloat16")), timeout=5)
        assert err.value.code == "incompatible"
        assert err.value.message == ("kv_dtype 'bfloat16' differs from 'float32' of d0, "
                                     "the first registered worker of the model")
        listed = (await client.call(ListWorkers(model="m"), timeout=5)).record
        assert isinstance(listed, WorkerList)
        assert [w.info.worker_id for w in listed.workers] == ["d0", "p0"]
        assert [(r.worker_id, r.setting, r.reason) for r in listed.refused] == \
            [("d1", "kv_dtype", err.value.message)]
        assert (await client.call(ListWorkers(model="n"), timeout=5)).record.refused == []
        stats = (await client.call(GetStats(), timeout=5)).record
        assert isinstance(stats, ConductorStats)
        assert [r.worker_id for r in stats.refused] == ["d1"]
        counted = conductor.metrics.get_sample_value
        assert counted("pdserve:workers_refused_total", {"reason": "kv_dtype"}) == 1.0
        # The refused worker, its settings fixed, is admitted and no longer listed.
        assert isinstance((await client.call(Hello(info=info("d1")), timeout=5)).record,
                          Welcome)
        listed = (await client.call(ListWorkers(), timeout=5)).record
        assert [w.info.worker_id for w in listed.workers] == ["d0", "p0", "d1"]
        assert listed.refused == []
    finally:
        await client.close()
        ctx.term()
        await conductor.close()


async def test_after_a_restart_a_rediscovered_mismatch_is_refused_and_not_asked_again():
    """A restarted conductor learns workers from their heartbeats (GetStats): the first
    rediscovered of the model is the reference, a mismatched one is refused and its
    later heartbeats do not make the conductor ask it again."""
    conductor = Conductor(ConductorSettings(
        control_addr=f"tcp://127.0.0.1:{free_port()}",
        heartbeat_addr=f"tcp://127.0.0.1:{free_port()}", heartbeat_interval_s=60.0))
    await conductor.start()
    ctx = zmq.asyncio.Context()
    asked: list[str] = []
    servers = []

    def fake_worker(w: WorkerInfo) -> RpcServer:
        async def handle(msg):
            asked.append(w.worker_id)
            if isinstance(msg.record, Resync):
                return HeldBlocks(source=w.worker_id, hashes=[], tiers=[])
            return WorkerStats(info=w, executor="sim", free_blocks=64, waiting=0, running=0,
                               num_requests=0)
        server = RpcServer(ctx, w.control_addr, handle, name=w.worker_id)
        servers.append(server)
        return server

    def beat(w: WorkerInfo) -> Heartbeat:
        return Heartbeat(worker_id=w.worker_id, role=w.role, seq=0, waiting=0, running=0,
                         queued_prefill_tokens=0, free_blocks=64, total_blocks=64,
                         step_time_ms=0.0, control_addr=w.control_addr)

    good = info("d0", control_addr=f"tcp://127.0.0.1:{free_port()}")
    bad = info("d1", control_addr=f"tcp://127.0.0.1:{free_port()}", num_layers=6)
    try:
        for w in (good, bad):
            await fake_worker(w).start()
        conductor.apply_heartbeat(beat(good))
        for _ in range(100):
            if "d0" in conductor.registry.workers and asked.count("d0") == 2:
                break  # GetStats, then Resync
            await asyncio.sleep(0.05)
        conductor.apply_heartbeat(beat(bad))
        for _ in range(100):
            if conductor.registry.refused:
                break
            await asyncio.sleep(0.05)
        assert list(conductor.registry.workers) == ["d0"]
        [refusal] = conductor.registry.refusals()
        assert (refusal.worker_id, refusal.setting) == ("d1", "num_layers")
        assert not conductor.apply_heartbeat(beat(bad))
        await asyncio.sleep(0.2)
        assert asked.count("d1") == 1  # asked once, at the first heartbeat
    finally:
        for server in servers:
            await server.close()
        ctx.term()
        await conductor.close()
