"""The simulated executor: it sleeps exactly what its profile says, its tokens are
predictable and survive a handoff or a resume, its KV bytes move intact, and a worker
running it never loads torch."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from common.cost_profile import CostProfile
from common.sampling_params import SamplingParams
from services.engine.core import EngineHooks
from services.engine.sim import SimEngine, sim_token
from services.worker.engine_loop import EngineLoop

PROFILE = CostProfile("t", prefill_fixed_s=0.01, prefill_per_token_s=1e-4,
                      prefill_per_pair_s=1e-7, decode_fixed_s=0.02, decode_per_seq_s=1e-3,
                      decode_per_ctx_token_s=1e-6, kv_bytes_per_token=64, block_size=16,
                      link_bandwidth=1e9)


def engine(**kw) -> tuple[SimEngine, list[float]]:
    slept: list[float] = []
    kw.setdefault("num_blocks", 64)
    return SimEngine(PROFILE, sleep=slept.append, **kw), slept


def chain(context: list[int], n: int) -> list[int]:
    out, ctx = [], list(context)
    for _ in range(n):
        out.append(sim_token(ctx, 49152))
        ctx.append(out[-1])
    return out


def run(e: SimEngine) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    while e.has_unfinished_requests():
        for out in e.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    return got


def test_steps_sleep_what_the_profile_says():
    e, slept = engine(kv_layers=4)
    e.add_request("a", list(range(1, 101)), SamplingParams(max_tokens=3))
    e.add_request("b", list(range(1, 41)), SamplingParams(max_tokens=2))
    e.step()  # both prompts in one step: fixed cost once, token and pair terms each
    assert e.last_step.prefill == ((100, 0), (40, 0)) and e.last_step.decode_batch == 0
    want = 0.01 + 1e-4 * 140 + 1e-7 * (100 * 50 + 40 * 20)
    assert slept == pytest.approx([want / 4] * 4)  # split over the layers
    slept.clear()
    e.step()  # one decode step: 2 sequences holding 100 + 40 tokens of KV
    assert (e.last_step.decode_batch, e.last_step.decode_context) == (2, 140)
    assert sum(slept) == pytest.approx(0.02 + 2e-3 + 140e-6)
    run(e)  # b ended at 2 tokens; a decodes alone over 101 tokens
    assert e.executor.simulated_s == pytest.approx(
        want + 0.02 + 2e-3 + 140e-6 + 0.02 + 1e-3 + 101e-6)
    assert e.block_manager.num_free_blocks == 64 and not e.requests


def test_tokens_are_predictable_and_a_resume_continues_them():
    e, _ = engine(time_scale=0)
    prompt = list(range(7, 60))
    e.add_request("a", prompt, SamplingParams(max_tokens=12))
    full = run(e)["a"]
    assert full == chain(prompt, 12)
    e.add_request("b", prompt + full[:5], SamplingParams(max_tokens=7))
    assert run(e)["b"] == full[5:]  # what a gateway gets after a decode worker dies
    e.add_request("c", prompt, SamplingParams(max_tokens=50, stop_token_ids=[full[3]]))
    got = run(e)["c"]
    assert got == full[:4]  # a stop token id ends it; there is no EOS
    assert e.block_manager.num_free_blocks == 64


def test_kv_handoff_between_two_engines_moves_the_bytes_and_the_stream():
    prompt = list(range(100, 150))  # 3 full blocks + 2 tokens
    payloads: dict[int, bytes] = {}

    def on_layer(layer, seqs):
        (seq,) = seqs
        payloads[layer] = bytes(prefill.kv_store.export_layer_bytes(layer, seq.block_table))
    prefill, _ = engine(time_scale=0, kv_layers=3, hooks=EngineHooks(on_layer=on_layer))
    decode, _ = engine(time_scale=0, kv_layers=3)
    prefill.add_request("r", prompt, SamplingParams(max_tokens=1), hold_blocks=True)
    first = run(prefill)["r"]
    size = prefill.kv_store.block_bytes
    assert size == 64 * 16 // 3  # the profile's KV bytes per block, over the layers
    assert sorted(payloads) == [0, 1, 2] and all(len(p) == 4 * size for p in payloads.values())
    held = prefill.requests["r"].block_table
    slots = decode.reserve_remote_prefill("r", prompt, SamplingParams(max_tokens=6))
    assert len(slots.block_ids) == 4 and slots.num_cached_blocks == 0
    for layer, data in payloads.items():
        decode.kv_store.import_layer_bytes(layer, slots.block_ids, memoryview(data))
    out = decode.complete_remote_prefill("r", first[0])
    assert out.new_token_ids == first
    rest = run(decode)["r"]
    assert first + rest == chain(prompt, 6)
    for layer in range(3):  # the full blocks hold the pattern of their tokens on both sides
        assert decode.kv_store.export_layer_bytes(layer, slots.block_ids[:3]) == \
            prefill.kv_store.export_layer_bytes(layer, held[:3])
        assert bytes(prefill.kv_store.export_layer_bytes(layer, held[:1])) != bytes(size)
    with pytest.raises(ValueError, match="payload of 10 bytes"):
        decode.kv_store.import_layer_bytes(0, [1], memoryview(b"0123456789"))
    prefill.release("r")
    assert prefill.block_manager.num_free_blocks == decode.block_manager.num_free_blocks == 64


def test_engine_loop_reports_prefill_and_decode_samples():
    async def go():
        e, _ = engine(time_scale=0)
        done = asyncio.Event()
        finished = []

        def on_outputs(outputs, step_s):
            finished.extend(o.request_id for o in outputs if o.finished)
            if finished:
                done.set()
        loop = EngineLoop(on_outputs)
        await loop.start(lambda: e)
        await loop.call(e.add_request, "a", list(range(1, 65)), SamplingParams(max_tokens=4))
        await asyncio.wait_for(done.wait(), 5)
        await loop.call(e.add_request, "b", list(range(1, 33)), SamplingParams(max_tokens=1))
        while len(finished) < 2:
            await asyncio.sleep(0.01)
        samples = loop.take_samples()
        await loop.stop()
        return samples, loop.take_samples()
    (pre, dec), again = asyncio.run(go())
    # b shares a's first block: 16 tokens come from the prefix cache, 16 are computed.
    assert [(s.tokens, s.cached) for s in pre] == [([64], [0]), ([16], [16])]
    assert [(s.batch, s.context) for s in dec] == [(1, 64), (1, 65), (1, 66)]
    assert all(s.seconds >= 0 for s in pre + dec)
    assert again == ([], [])


def test_profiles_bad_input_and_sim_worker_and_conductor_without_torch(tmp_path):
    from common.cost_profile import load_profile

    with pytest.raises(ValueError, match="not found"):
        load_profile("no-such-profile")
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x", "prefill_fixed_s": 0}')
    with pytest.raises(ValueError, match="lacks"):
        load_profile(str(bad))
    for name in ("smollm2-cpu", "llama70b-h100x4", "zero"):
        assert load_profile(name).name == name
    code = ("import sys, services.conductor.server; "
            "from services.worker.server import build_engine; "
            "from services.worker.settings import WorkerSettings; "
            "e = build_engine(WorkerSettings(executor='sim', sim_profile='llama70b-h100x4')); "
            "print(type(e).__name__, e.block_manager.num_blocks, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["SimEngine", str(486_400 // 16), "False"]


def test_the_simulated_engine_and_the_core_import_no_torch():
    code = ("import sys, services.engine.sim, services.engine.core, "
            "services.engine.kv_store, services.engine.executor; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False"]


def test_hooks_given_at_construction_report_the_prefix_cache():
    stored, removed = [], []
    e, _ = engine(time_scale=0, num_blocks=4,
                  hooks=EngineHooks(on_stored=stored.extend, on_removed=removed.extend))
    e.add_request("a", list(range(1, 34)), SamplingParams(max_tokens=1))
    run(e)
    assert len(stored) == 2 and removed == []  # 33 tokens: two full blocks cached
    e.add_request("b", list(range(50, 113)), SamplingParams(max_tokens=1))
    run(e)  # 63 tokens need all four blocks: a's cached ones are evicted
    assert removed == stored[1::-1]  # evicted tail first
