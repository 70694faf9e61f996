"""A new request whose first ``Generate`` fails: the decode worker the conductor chose is
stopping (answers ``unavailable``), frozen (never answers) or gone (killed just as the
request was routed to it). The request must run on another live decode worker, as a
stream that loses a worker mid-way does, and not end in 503.

Fake conductor and fake decode workers on real ZeroMQ sockets, one process. The
gateway's ``Generate`` timeout (2 s) is longer than its route wait (1.5 s) on purpose: a
worker that never answers is found out only after the wait, and must not cost the
request its second chance.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from common.protocol import (
    Tokens,
)
from services.gateway.backend import BackendUnavailable, GenerationRequest
from services.gateway.cluster_backend import ClusterBackend
from services.gateway.failover import FailoverSettings
from tests.gateway_fakes import FakeCluster, fake_cluster_and_backend, until

pytestmark = pytest.mark.timeout(60)

PROMPT = [5, 6, 7]
SAMPLING = {"max_tokens": 6, "temperature": 0.0, "seed": 3}
REFERENCE = [40, 41, 42, 43, 44, 45]  # what the live worker generates


@pytest.fixture
async def fake():
    async with fake_cluster_and_backend(stall_check_s=5.0) as pair:
        yield pair


async def _collect(backend: ClusterBackend, rid: str) -> list[Tokens]:
    return [t async for t in backend.generate(GenerationRequest(rid, PROMPT, SAMPLING))]



async def _completes_on_d1(cluster: FakeCluster, backend: ClusterBackend, rid: str,
                           task: asyncio.Task) -> None:
    """The request went to d0 first, then to d1 under its first failover id; the stream
    d1 sends is the client's, whole; d0 is told to drop it."""
    first = await cluster.wait_generated(1, task)
    assert first[:2] == ("d0", rid)
    worker, wire, gen = await cluster.wait_generated(2, task)
    assert (worker, wire) == ("d1", f"{rid}.r1")
    assert gen.prompt_token_ids == PROMPT and gen.start_position == 0  # nothing streamed
    assert gen.sampling.max_tokens == 6 and gen.sampling.seed == 3
    assert cluster.excludes[-1] == ["d0"]  # the conductor was told to avoid it
    await cluster.send(backend.stream_addr, wire, Tokens(0, REFERENCE[:2]))
    await cluster.send(backend.stream_addr, wire, Tokens(2, REFERENCE[2:], finished=True,
                                                         finish_reason="length"))
    events = await asyncio.wait_for(task, 10)
    assert [t for e in events for t in e.token_ids] == REFERENCE
    assert [e.position for e in events] == [0, 2]
    assert events[-1].finish_reason == "length" and events[-1].error is None
    await until(lambda: ("d0", rid) in cluster.aborted)  # in case it admitted it
    assert ("d1", wire) not in cluster.aborted
    assert len(cluster.generated) == 2
    assert not backend.queues and not backend.decoders


async def test_stopping_worker_that_refuses_the_first_generate_is_passed_over(fake):
    cluster, backend = fake
    cluster.mode["d0"] = "refuse"
    task = asyncio.create_task(_collect(backend, "s"))
    await _completes_on_d1(cluster, backend, "s", task)


async def test_frozen_worker_that_never_answers_is_passed_over(fake):
    cluster, backend = fake
    cluster.mode["d0"] = "silent"  # SIGSTOPped right as the request was routed to it
    start = time.monotonic()
    task = asyncio.create_task(_collect(backend, "f"))
    await cluster.wait_generated(2, task)
    assert time.monotonic() - start >= 1.9  # the Generate timed out first
    await _completes_on_d1(cluster, backend, "f", task)


async def test_killed_worker_is_passed_over(fake):
    cluster, backend = fake
    await cluster.workers["d0"].close()  # gone; its address still listed alive
    task = asyncio.create_task(_collect(backend, "k"))
    worker, wire, gen = await cluster.wait_generated(1, task)
    assert (worker, wire, gen.start_position) == ("d1", "k.r1", 0)
    assert cluster.excludes == [[], ["d0"]]
    await cluster.send(backend.stream_addr, wire, Tokens(0, REFERENCE, finished=True,
                                                         finish_reason="length"))
    events = await asyncio.wait_for(task, 10)
    assert [t for e in events for t in e.token_ids] == REFERENCE
    assert not backend.queues and not backend.decoders


async def test_every_worker_refusing_ends_unavailable_within_the_route_wait(fake):
    cluster, backend = fake
    cluster.mode.update(d0="refuse", d1="refuse")
    start = time.monotonic()
    with pytest.raises(BackendUnavailable, match="waited 1.5s"):
        await asyncio.wait_for(_collect(backend, "u"), 10)
    elapsed = time.monotonic() - start
    assert 1.4 <= elapsed < 6  # waited for a worker to come back, then gave up
    assert [g[:2] for g in cluster.generated] == [("d0", "u"), ("d1", "u.r1")]
    assert cluster.excludes[1] == ["d0"] and cluster.excludes[2] == ["d0", "d1"]
    await until(lambda: {("d0", "u"), ("d1", "u.r1")} <= set(cluster.aborted))
    assert not backend.queues and not backend.decoders


async def test_no_route_wait_still_tries_another_live_worker(fake):
    """``route_wait_s`` 0 means: do not wait for a worker to appear; a live one that is
    already listed still takes the request when the first refuses it."""
    cluster, backend = fake
    backend.failover = FailoverSettings(route_wait_s=0, poll_s=0.1)
    cluster.mode["d0"] = "refuse"
    task = asyncio.create_task(_collect(backend, "z"))
    await _completes_on_d1(cluster, backend, "z", task)
