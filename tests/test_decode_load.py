"""A decode worker's load counts the requests waiting for their KV and the blocks its
held requests will still take for their output: in the engine's snapshot, the
heartbeat, the conductor's view and its predictions (as the simulator counts them)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from common.cost_profile import CostProfile
from common.protocol import Heartbeat, WorkerInfo
from common.records import CostCoefficients
from common.sampling_params import SamplingParams
from services.conductor.cache_policy import CacheAwarePolicy, PolicyConfig, Rejection
from services.conductor.cost_model import CostModel
from services.conductor.policy import Decision, LeastLoaded
from services.conductor.prefix_index import PrefixIndex
from services.conductor.registry import Registry, WorkerView
from services.conductor.routing_policy import PolicyRequest
from services.engine.sim import SimEngine
from services.worker.engine_loop import EngineLoop

PROFILE = CostProfile("t", prefill_fixed_s=0.01, prefill_per_token_s=1e-4,
                      prefill_per_pair_s=1e-7, decode_fixed_s=0.02, decode_per_seq_s=1e-3,
                      decode_per_ctx_token_s=1e-6, kv_bytes_per_token=64, block_size=16,
                      link_bandwidth=1e9)


def test_engine_load_counts_a_request_waiting_for_kv_and_its_output_blocks():
    gate = threading.Event()  # holds the engine inside its first decode step

    async def until(loop, done) -> object:
        """The loop's snapshot once ``done`` holds for it (it is refreshed on the engine
        thread between commands and steps)."""
        async with asyncio.timeout(10):
            while not done(loop.load):
                await asyncio.sleep(0.005)
        return loop.load

    async def go():
        e = SimEngine(PROFILE, sleep=lambda s: gate.wait(10), num_blocks=64)
        loop = EngineLoop(lambda outputs, step_s: None)
        await loop.start(lambda: e)
        prompt = list(range(1, 51))  # 4 blocks; with 40 output tokens 90 tokens: 6 blocks
        await loop.call(e.reserve_remote_prefill, "r", prompt, SamplingParams(max_tokens=40))
        waiting = await until(loop, lambda load: load.num_requests == 1)
        await loop.call(e.complete_remote_prefill, "r", 7)
        # taken as the step that holds on the gate starts
        joined = await until(loop, lambda load: load.running == 1)
        gate.set()
        await loop.call(e.abort, "r")
        gone = await until(loop, lambda load: load.num_requests == 0)
        await loop.stop()
        return waiting, joined, gone
    waiting, joined, gone = asyncio.run(go())
    assert (waiting.waiting, waiting.running, waiting.waiting_for_kv) == (0, 0, 1)
    assert (waiting.free_blocks, waiting.reserved_blocks) == (60, 2)
    assert (joined.waiting_for_kv, joined.free_blocks, joined.reserved_blocks) == (0, 60, 2)
    assert (gone.waiting_for_kv, gone.reserved_blocks, gone.free_blocks) == (0, 0, 64)


CAL = CostCoefficients(prefill_fixed_s=0.01, prefill_per_token_s=1e-4, prefill_per_pair_s=1e-9,
                       decode_fixed_s=0.02, decode_per_seq_s=1e-3, decode_per_ctx_token_s=1e-7)
PROMPT = 1024


def decode_view(wid: str = "d1") -> WorkerView:
    return WorkerView(WorkerInfo(worker_id=wid, role="decode", model="m", control_addr="",
                                 kv_addr="", host_id="h", block_size=16, num_blocks=600,
                                 fingerprint="fp"), free_blocks=600, last_seen=0.0)


def beat(reg: Registry, wid: str, *, waiting_for_kv: int, reserved: int, free: int = 536,
         now: float = 1.0) -> None:
    assert reg.heartbeat(Heartbeat(
        worker_id=wid, role="decode", seq=1, waiting=0, running=0, queued_prefill_tokens=0,
        free_blocks=free, total_blocks=600, step_time_ms=0.0, waiting_for_kv=waiting_for_kv,
        reserved_blocks=reserved), now=now)


def route(ws, slo_ttft_s: float, output: int = 16):
    cfg = PolicyConfig(kv_bytes_per_token=1, link_bandwidth=1e9)
    pol = CacheAwarePolicy(PrefixIndex(), CostModel(CAL), cfg)
    return pol.decide(ws, PolicyRequest(prompt_tokens=PROMPT, block_hashes=[], block_size=16,
                                        output_tokens=output, slo_ttft_s=slo_ttft_s))


def test_conductor_predicts_ttft_with_the_request_waiting_for_kv():
    prefill = 0.01 + 1e-4 * PROMPT + 1e-9 * PROMPT * (PROMPT / 2)
    # The request awaiting KV holds 64 blocks (1024 tokens) and joins the batch when its
    # KV lands: a local prefill there waits for that decode step.
    step = 0.02 + 1e-3 + 1e-7 * 64 * 16
    reg = Registry()
    reg.workers["d1"] = d1 = decode_view()
    beat(reg, "d1", waiting_for_kv=0, reserved=0, free=600)
    assert d1.load == 0
    assert isinstance(route([d1], slo_ttft_s=prefill + 1e-6), Decision)
    beat(reg, "d1", waiting_for_kv=1, reserved=1, now=2.0)
    assert (d1.waiting_for_kv, d1.reserved_blocks, d1.load) == (1, 1, 1)
    assert isinstance(route([d1], slo_ttft_s=prefill + step - 1e-6), Rejection)
    assert isinstance(route([d1], slo_ttft_s=prefill + step + 1e-6), Decision)
    status = d1.status()
    assert status.waiting == 0  # the worker list keeps its old meaning


def test_reserved_output_blocks_are_not_free_for_the_next_request():
    reg = Registry()
    reg.workers["d1"] = d1 = decode_view()
    need = -(-(PROMPT + 16) // 16)  # 65 blocks
    beat(reg, "d1", waiting_for_kv=1, reserved=536 - need + 1)
    assert d1.unpromised_blocks == need - 1
    rejected = route([d1], slo_ttft_s=60.0)
    assert isinstance(rejected, Rejection) and "room" in rejected.reason
    beat(reg, "d1", waiting_for_kv=1, reserved=536 - need, now=2.0)
    assert isinstance(route([d1], slo_ttft_s=60.0), Decision)


def test_least_loaded_counts_requests_waiting_for_kv():
    reg = Registry()
    for wid in ("d1", "d2"):
        reg.workers[wid] = decode_view(wid)
    beat(reg, "d1", waiting_for_kv=1, reserved=0)
    beat(reg, "d2", waiting_for_kv=0, reserved=0, free=500)
    views = list(reg.workers.values())
    assert LeastLoaded().pick(views, 100).worker_id == "d2"


@pytest.mark.parametrize("field", ["waiting_for_kv", "reserved_blocks"])
def test_heartbeat_defaults_keep_old_senders_readable(field):
    hb = Heartbeat(worker_id="w", role="decode", seq=0, waiting=0, running=0,
                   queued_prefill_tokens=0, free_blocks=1, total_blocks=1, step_time_ms=0)
    assert getattr(hb, field) == 0
