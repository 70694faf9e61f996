"""The worker's parts and their seams: the roles and the pool link see a RoleContext,
never the worker (their imports: tests/test_layering.py); the engine is reached only
through its loop; each role reports its own counters."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import threading
import time

import pytest
from prometheus_client import generate_latest

from common.protocol import WorkerStats
from common.sampling_params import SamplingParams
from services.worker import server
from services.worker.context import RoleContext
from services.worker.decode_role import DecodeRole
from services.worker.engine_loop import EngineLoop
from services.worker.prefill_role import PrefillRole
from services.worker.server import Worker, build_engine
from services.worker.settings import WorkerSettings


def test_the_context_is_a_frozen_record():
    assert RoleContext.__dataclass_params__.frozen and hasattr(RoleContext, "__slots__")
    fields = {f.name for f in dataclasses.fields(RoleContext)}
    assert fields == {"worker_id", "settings", "loop", "streams", "metrics", "zmq", "peer",
                      "tracer"}


def test_the_engine_is_reached_through_its_loop_only():
    async def go():
        engine = build_engine(WorkerSettings(executor="sim", sim_time_scale=0))
        loop = EngineLoop(lambda outputs, step_s: None)
        assert not hasattr(loop, "engine")
        with pytest.raises(RuntimeError, match="not built"):
            _ = loop.facts
        await loop.start(lambda: engine)
        try:
            seen = await loop.run(lambda e, x: (e, x), 7)
            with pytest.raises(RuntimeError, match="engine thread only"):
                loop.export_layer(0, [0])
            # From the engine thread (an engine call, as from a hook) it exports.
            out = await loop.run(lambda e: loop.export_layer(0, [0]))
            added = await loop.run(lambda e: e.add_request(
                "r", [1, 2, 3], SamplingParams(max_tokens=1)))
        finally:
            await loop.stop()
        return engine, loop, seen, out, added
    engine, loop, seen, out, added = asyncio.run(go())
    assert seen == (engine, 7) and added == "r"
    assert out.nbytes == engine.kv_store.block_nbytes // engine.kv_store.num_layers
    assert loop.facts.block_size == 16 and loop.facts.fingerprint == engine.fingerprint
    assert loop.facts.num_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("role", ["prefill", "decode", "unified"])
def test_each_role_reports_its_own_counters(role):
    async def go():
        settings = WorkerSettings(role=role, executor="sim", sim_time_scale=0,
                                  conductor_addr="tcp://127.0.0.1:1",
                                  heartbeat_addr="tcp://127.0.0.1:1")
        worker = Worker(settings, functools.partial(build_engine, settings))
        await worker.start()
        try:
            if role == "prefill":
                worker.role.sent_bytes, worker.role.done = 123, 2
                worker.role.backends["tcp"] += 1
            else:
                worker.role.local_fallbacks, worker.role.received_bytes = 3, 456
            return worker.role, worker.stats()
        finally:
            await worker.close()
    part, stats = asyncio.run(go())
    assert isinstance(stats, WorkerStats) and stats.info.role == role
    if role == "prefill":
        assert isinstance(part, PrefillRole)
        assert (stats.kv_bytes_sent, stats.prefills_done, stats.transfer_backends) == (
            123, 2, {"tcp": 1})
        assert (stats.local_fallbacks, stats.kv_bytes_received) == (0, 0)
        assert stats.kv_advert is None and stats.info.kv_addr == ""
    else:
        assert isinstance(part, DecodeRole)
        assert (stats.local_fallbacks, stats.kv_bytes_received) == (3, 456)
        assert (stats.kv_bytes_sent, stats.prefills_done, stats.prefill_jobs) == (0, 0, 0)
        assert stats.kv_advert is not None and stats.info.kv_addr.startswith("tcp://")


def _sim_settings(**kw) -> WorkerSettings:
    return WorkerSettings(executor="sim", sim_time_scale=0, conductor_addr="tcp://127.0.0.1:1",
                          heartbeat_addr="tcp://127.0.0.1:1", **kw)


def test_a_stop_during_a_long_model_load_is_obeyed_at_once(monkeypatch):
    release = threading.Event()
    loading = threading.Event()

    def slow_build(settings, hooks):  # a model load that has not finished
        loading.set()
        release.wait(30)
        return build_engine(settings, hooks)

    monkeypatch.setattr(server, "build_engine", slow_build)

    async def go():
        stop = asyncio.Event()
        serving = asyncio.create_task(server.serve(_sim_settings(), stop))
        await asyncio.to_thread(loading.wait, 10)
        began = time.monotonic()
        stop.set()
        await asyncio.wait_for(serving, 5)
        return time.monotonic() - began
    try:
        assert asyncio.run(go()) < 2.0
    finally:
        release.set()  # the abandoned load ends; its thread does not serve


def test_a_model_that_fails_to_load_fails_the_start(monkeypatch):
    def broken_build(settings, hooks):
        raise ValueError("no model at /nowhere")

    monkeypatch.setattr(server, "build_engine", broken_build)

    async def go():
        await server.serve(_sim_settings(), asyncio.Event())
    with pytest.raises(ValueError, match="no model at /nowhere"):
        asyncio.run(go())


def test_an_abort_that_overtakes_its_generate_cancels_it():
    """An Abort handled before, or while, its Generate is admitted leaves nothing running."""
    from common.protocol import Error, Generate

    async def go():
        settings = _sim_settings(role="unified")
        worker = Worker(settings, functools.partial(build_engine, settings))
        await worker.start()
        role = worker.role
        gen = Generate(prompt_token_ids=list(range(1, 40)),
                       sampling=SamplingParams(max_tokens=10_000, ignore_eos=True),
                       stream_addr="tcp://127.0.0.1:1")
        try:
            free = await worker.loop.run(lambda e: e.block_manager.num_free_blocks)
            await role.abort("early")  # before its Generate arrives
            early = await asyncio.wait_for(role.handle("early", gen), 10)

            entered, go_on = asyncio.Event(), asyncio.Event()
            admit = role.pool.with_prefix

            async def slow_pool(*args, **kwargs):  # the pool answers late
                entered.set()
                await go_on.wait()
                return await admit(*args, **kwargs)
            role.pool.with_prefix = slow_pool
            during = asyncio.create_task(role.handle("during", gen))
            await asyncio.wait_for(entered.wait(), 10)
            await role.abort("during")
            go_on.set()
            late = await asyncio.wait_for(during, 10)
            # Read from the engine itself: the load snapshot is refreshed only by steps.
            left, now_free, load = await worker.loop.run(lambda e: (
                sorted(e.requests), e.block_manager.num_free_blocks,
                (len(e.scheduler.running), len(e.scheduler.waiting))))
            return early, late, left, free, now_free, load
        finally:
            await worker.close()
    early, late, left, free, now_free, load = asyncio.run(go())
    assert isinstance(early, Error) and early.code == "aborted"
    assert isinstance(late, Error) and late.code == "aborted"
    assert left == [] and load == (0, 0)
    assert now_free == free


def test_a_request_finished_before_its_admission_returns_is_not_called_aborted():
    """On a busy host the engine may run a short request to its end before the
    coroutine that admitted it resumes: the reply is still its Ack, not 'aborted'."""
    from common.protocol import Ack, Generate

    async def go():
        settings = _sim_settings(role="unified")
        worker = Worker(settings, functools.partial(build_engine, settings))
        await worker.start()
        role, admit = worker.role, worker.role.pool.with_prefix
        finished_first, sent = [], []

        async def late_resume(*args, **kwargs):  # resumes only once it has finished
            result = await admit(*args, **kwargs)
            for _ in range(1000):
                if "short" not in role.streams:
                    break
                await asyncio.sleep(0.01)
            finished_first.append("short" not in role.streams)
            return result
        role.pool.with_prefix = late_resume
        worker.streams.send = lambda addr, rid, rec: sent.append((rid, rec))
        gen = Generate(prompt_token_ids=[1, 2, 3],
                       sampling=SamplingParams(max_tokens=2, ignore_eos=True),
                       stream_addr="tcp://127.0.0.1:1")
        try:
            reply = await asyncio.wait_for(role.handle("short", gen), 20)
            left = await worker.loop.run(lambda e: sorted(e.requests))
            return reply, finished_first, sent, left
        finally:
            await worker.close()
    reply, finished_first, sent, left = asyncio.run(go())
    assert finished_first == [True]  # the race this test is about did happen
    assert isinstance(reply, Ack) and reply.detail == "local"
    tokens = [rec for rid, rec in sent if rid == "short"]
    assert sum(len(t.token_ids) for t in tokens) == 2 and tokens[-1].finished
    assert tokens[-1].finish_reason == "length" and left == []


def test_remote_prefill_kv_is_taken_only_with_its_transfer_token():
    """The decode worker draws a token per remote prefill and sends it in Prefill; KV
    sent to its receiver under the request's id without that token is refused and
    counted, and writes nothing into the reserved blocks."""
    import secrets

    import zmq.asyncio

    from common.protocol import Ack, Generate, Prefill
    from common.transfer import MultiSender
    from common.zmq_rpc import RpcServer

    async def go():
        settings = _sim_settings(role="decode", kv_lease_s=30)
        worker = Worker(settings, functools.partial(build_engine, settings))
        await worker.start()
        ctx = zmq.asyncio.Context()
        asked: list[Prefill] = []

        async def fake_prefill(msg):  # takes the request, sends nothing yet
            asked.append(msg.record)
            await asyncio.sleep(60)
            return Ack()
        prefill = RpcServer(ctx, "tcp://127.0.0.1:*", fake_prefill, name="fake-prefill")
        await prefill.start()
        rogue = MultiSender()
        role = worker.role
        try:
            reply = await role.handle("r", Generate(
                prompt_token_ids=list(range(1, 70)), sampling=SamplingParams(max_tokens=4),
                stream_addr="tcp://127.0.0.1:1", prefill_id="p",
                prefill_addr=prefill.address))
            async with asyncio.timeout(10):
                while not asked:
                    await asyncio.sleep(0.01)
            rec, transfer = asked[0], role.remote["r"].transfer
            address = rogue.address_for(rec.kv_advert)
            dest = rec.block_ids[rec.skip_blocks:]
            facts = worker.loop.facts
            layer_bytes = facts.block_nbytes // facts.num_layers * len(dest)
            for token in (b"", secrets.token_bytes(16)):
                await rogue.send(address, "r", 0, dest, bytes(layer_bytes), token=token)
            await rogue.finish(address, "r", 1, token=b"")
            async with asyncio.timeout(10):
                while role.receiver.refused < 3:
                    await asyncio.sleep(0.01)
            return (reply, rec, transfer.token, transfer.chunks_received, transfer.is_live,
                    role.report(worker.stats()), generate_latest(worker.metrics.registry))
        finally:
            await rogue.close()
            await prefill.close()
            await worker.close()
            ctx.term()
    reply, rec, token, chunks, live, stats, metrics = asyncio.run(go())
    assert reply == Ack(detail="remote")
    assert len(rec.kv_token) == 16 and rec.kv_token == token
    assert chunks == 0 and live  # nothing written, the transfer still waits for prefill
    assert stats.kv_messages_refused == 3 and stats.kv_bytes_received == 0
    assert b"\npdserve:kv_messages_refused_total 3.0\n" in metrics


def test_a_prefill_worker_exports_zero_refused_kv_messages():
    async def go():
        settings = _sim_settings(role="prefill")
        worker = Worker(settings, functools.partial(build_engine, settings))
        await worker.start()
        try:
            return generate_latest(worker.metrics.registry)
        finally:
            await worker.close()
    assert b"\npdserve:kv_messages_refused_total 0.0\n" in asyncio.run(go())
