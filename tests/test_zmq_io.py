"""ZeroMQ helpers over loopback TCP: RPC matching, failures, and garbage on every socket."""

from __future__ import annotations

import asyncio
import re

import msgpack
import pytest
import zmq
import zmq.asyncio

from common import protocol as p
from common.service_main import install_uvloop
from common.zmq_io import Publisher, PullSocket, PushSocket, Subscriber
from common.zmq_rpc import RemoteError, RpcClient, RpcServer, RpcTimeout

ANY_PORT = "tcp://127.0.0.1:*"
pytestmark = pytest.mark.timeout(20)


async def _handler(msg: p.Message):
    """Route(prompt_len=ms) sleeps that long and acks; model names other behaviours."""
    rec = msg.record
    if isinstance(rec, p.GetStats):
        return p.HeldBlocks(source=msg.envelope.request_id, hashes=[], tiers=[])
    if isinstance(rec, p.Route):
        if rec.model == "explode":
            raise KeyError("no such worker")
        if rec.model == "silent":
            return None
        if rec.model == "bulk":
            return p.Ack(detail="with bulk"), [bytes(b)[::-1] for b in msg.bulk]
        if rec.model == "unencodable":
            return p.Ack(detail=object())
        await asyncio.sleep(rec.prompt_len / 1000)
        return p.Ack(detail=str(rec.prompt_len))
    return p.Error(code="invalid", message=f"unexpected {msg.envelope.type}")


@pytest.fixture
async def rpc(ctx):
    server = RpcServer(ctx, ANY_PORT, _handler, name="test-server")
    await server.start()
    client = RpcClient(ctx, server.address, name="test-client")
    yield server, client
    await client.close()
    await server.close()


async def _call_ok(client):
    reply = await client.call(p.GetStats(), request_id="again", timeout=2)
    assert reply.record == p.HeldBlocks(source="again", hashes=[], tiers=[])


async def test_address_is_resolved(rpc):
    server, _ = rpc
    assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", server.address)


async def test_round_trip_keeps_request_id_and_bulk(rpc):
    _, client = rpc
    reply = await client.call(p.GetStats(), request_id="req-7")
    assert reply.record == p.HeldBlocks(source="req-7", hashes=[], tiers=[])
    assert reply.envelope.request_id == "req-7" and reply.envelope.type == "held_blocks"

    payload = [b"\x00\x01\x02", bytes(range(256)) * 300]
    reply = await client.call(p.Route(model="bulk", prompt_len=0), bulk=payload)
    assert reply.record == p.Ack(detail="with bulk")
    assert [bytes(b) for b in reply.bulk] == [b[::-1] for b in payload]


async def test_concurrent_calls_matched_out_of_order(rpc):
    _, client = rpc
    delays = [120, 10, 80, 0, 40, 60, 20]
    finished: list[int] = []

    async def one(ms):
        reply = await client.call(p.Route(model="m", prompt_len=ms), request_id=f"r{ms}")
        finished.append(ms)
        return reply

    replies = await asyncio.gather(*(one(ms) for ms in delays))
    for ms, reply in zip(delays, replies, strict=True):
        assert reply.record.detail == str(ms)
        assert reply.envelope.request_id == f"r{ms}"
    assert finished == sorted(delays)  # replies came back in handler-time order, not send order


async def test_timeout_forgets_the_call_and_drops_the_late_reply(rpc):
    _, client = rpc
    with pytest.raises(RpcTimeout):
        await client.call(p.Route(model="m", prompt_len=300), timeout=0.05)
    assert not client._pending
    await asyncio.sleep(0.35)  # the late reply arrives and must be dropped quietly
    await _call_ok(client)


async def test_no_reply_when_handler_returns_none(rpc):
    _, client = rpc
    with pytest.raises(RpcTimeout):
        await client.call(p.Route(model="silent", prompt_len=0), timeout=0.2)


async def test_handler_exception_is_internal_error_and_server_survives(rpc):
    _, client = rpc
    with pytest.raises(RemoteError) as info:
        await client.call(p.Route(model="explode", prompt_len=0))
    assert info.value.code == "internal" and "no such worker" in info.value.message
    with pytest.raises(RemoteError) as info:
        await client.call(p.Route(model="unencodable", prompt_len=0))
    assert info.value.code == "internal" and "not encodable" in info.value.message
    with pytest.raises(RemoteError) as info:
        await client.call(p.Abort())
    assert info.value.code == "invalid"
    await _call_ok(client)


async def test_garbage_from_a_raw_dealer_gets_error_replies(ctx, rpc):
    server, client = rpc
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.address)
    try:
        cases = [
            ([b"\xc1 not msgpack"], "malformed", None),
            ([msgpack.packb({"v": p.PROTOCOL_VERSION, "type": "route", "id": "m2", "body": {}})],
             "missing_field", "m2"),
            ([msgpack.packb({"v": p.PROTOCOL_VERSION, "type": "warp", "id": "m3", "body": {}})],
             "unknown_type", "m3"),
            ([msgpack.packb({"v": 9, "type": "ack", "id": "m4", "body": {}})], "version", "m4"),
        ]
        for frames, code, parent in cases:
            await raw.send_multipart(frames)
            reply = p.decode(await asyncio.wait_for(raw.recv_multipart(), 2))
            assert isinstance(reply.record, p.Error)
            assert reply.record.code == code
            assert reply.envelope.parent == parent
    finally:
        raw.close()
    await _call_ok(client)


async def test_bad_request_from_client_surfaces_as_remote_error(ctx):
    server = RpcServer(ctx, ANY_PORT, _handler, name="small", max_frame_bytes=200)
    await server.start()
    client = RpcClient(ctx, server.address, name="c")
    try:
        with pytest.raises(RemoteError) as info:
            await client.call(p.Ack(detail="y" * 500), timeout=2)
        assert info.value.code == "oversized"
    finally:
        await client.close()
        await server.close()


async def test_client_drops_undecodable_replies(ctx):
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(ANY_PORT)
    client = RpcClient(ctx, router.getsockopt_string(zmq.LAST_ENDPOINT), name="c")

    async def fake_server():
        identity, frame0 = await router.recv_multipart()
        request = p.decode([frame0])
        await router.send_multipart([identity, b"\xc1"])
        await router.send_multipart([identity, *p.encode(p.Ack(), parent="someone-else")])
        await router.send_multipart(
            [identity, *p.encode(p.Ack(detail="real"), parent=request.envelope.id)])

    try:
        server_task = asyncio.create_task(fake_server())
        reply = await client.call(p.GetStats(), timeout=2)
        assert reply.record == p.Ack(detail="real")
        await server_task
    finally:
        await client.close()
        router.close()


async def test_close_fails_pending_calls_and_is_idempotent(ctx, rpc):
    server, client = rpc
    pending = asyncio.create_task(client.call(p.Route(model="m", prompt_len=5000)))
    await asyncio.sleep(0.05)
    await client.close()
    with pytest.raises(ConnectionError):
        await pending
    await client.close()
    with pytest.raises(ConnectionError):
        await client.call(p.GetStats())
    await server.close()
    await server.close()
    with pytest.raises(RuntimeError):
        await server.start()


async def test_server_survives_being_fed_after_close_of_a_client(ctx, rpc):
    server, client = rpc
    other = RpcClient(ctx, server.address, name="other")
    await other.send(p.Route(model="m", prompt_len=50))  # reply goes to a closed peer
    await other.close()
    await asyncio.sleep(0.1)
    await _call_ok(client)


async def _sync_pubsub(publisher_send, sub: Subscriber) -> None:
    """PUB drops messages until the subscription has propagated: probe until one lands."""
    for _ in range(200):
        await publisher_send()
        try:
            await asyncio.wait_for(sub.recv(), 0.05)
            return
        except TimeoutError:
            continue
    raise AssertionError("subscription never propagated")


async def _drain(sock, seconds=0.1) -> list[p.Message]:
    got = []
    while True:
        try:
            got.append(await asyncio.wait_for(sock.recv(), seconds))
        except TimeoutError:
            return got


async def test_pub_sub_delivers_by_topic(ctx):
    sub = Subscriber(ctx, ANY_PORT, bind=True, topics=(b"heartbeat",))
    pub = Publisher(ctx, sub.address, bind=False)
    try:
        await _sync_pubsub(lambda: pub.publish(p.Ack(detail="probe"), b"heartbeat"), sub)
        await _drain(sub)
        beat = p.Heartbeat(worker_id="w", role="decode", seq=1, waiting=0, running=2,
                           queued_prefill_tokens=0, free_blocks=5, total_blocks=8,
                           step_time_ms=3.5)
        await pub.publish(p.Ack(detail="other topic"), b"kv_event")
        await pub.publish(beat, b"heartbeat")
        got = await asyncio.wait_for(sub.recv(), 2)
        assert got.record == beat and got.envelope.type == "heartbeat"
        assert await _drain(sub) == []
    finally:
        await pub.close()
        await sub.close()
        await pub.close()
        await sub.close()


async def test_subscriber_skips_garbage(ctx):
    sub = Subscriber(ctx, ANY_PORT, bind=True, topics=(b"t",), max_frame_bytes=1000)
    raw = ctx.socket(zmq.PUB)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(sub.address)
    try:
        await _sync_pubsub(lambda: raw.send_multipart([b"t", *p.encode(p.Ack())]), sub)
        await _drain(sub)
        await raw.send_multipart([b"t"])  # topic only, no message
        await raw.send_multipart([b"t", b"\xc1"])
        await raw.send_multipart([b"t", *p.encode(p.Ack(detail="y" * 2000))])
        await raw.send_multipart([b"t", *p.encode(p.Ack(detail="good"))])
        got = await asyncio.wait_for(sub.recv(), 2)
        assert got.record == p.Ack(detail="good")
    finally:
        raw.close()
        await sub.close()


async def test_push_pull_stream_in_order(ctx):
    pull = PullSocket(ctx, ANY_PORT, bind=True)
    push = PushSocket(ctx, pull.address, bind=False)
    assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", pull.address)
    try:
        for pos in range(5):
            await push.send(p.Tokens(position=pos, token_ids=[pos * 10]), request_id="r1")
        got = [await asyncio.wait_for(pull.recv(), 2) for _ in range(5)]
        assert [m.record.position for m in got] == [0, 1, 2, 3, 4]
        assert [m.record.token_ids for m in got] == [[0], [10], [20], [30], [40]]
        assert {m.envelope.request_id for m in got} == {"r1"}
    finally:
        await push.close()
        await pull.close()
        await push.close()
        await pull.close()


async def test_pull_skips_garbage(ctx):
    pull = PullSocket(ctx, ANY_PORT, bind=True)
    raw = ctx.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(pull.address)
    try:
        await raw.send_multipart([b"\xc1\xc1"])
        await raw.send_multipart([msgpack.packb({"v": p.PROTOCOL_VERSION, "type": "tokens",
                                                 "id": "x",
                                                 "body": {"position": "0", "token_ids": []}})])
        await raw.send_multipart([msgpack.packb({"v": 99, "type": "ack", "id": "y", "body": {}})])
        await raw.send_multipart(p.encode(p.Tokens(position=0, token_ids=[7]), request_id="r"))
        got = await asyncio.wait_for(pull.recv(), 2)
        assert got.record == p.Tokens(position=0, token_ids=[7])
        assert await _drain(pull) == []
    finally:
        raw.close()
        await pull.close()


async def test_bad_bind_address_raises(ctx):
    with pytest.raises(zmq.ZMQError):
        PullSocket(ctx, "nonsense://here", bind=True)
    server = RpcServer(ctx, "nonsense://here", _handler, name="bad")
    with pytest.raises(zmq.ZMQError):
        await server.start()
    await server.close()
    with pytest.raises(RuntimeError):
        _ = server.address


def test_install_uvloop():
    import uvloop

    try:
        install_uvloop()
        assert isinstance(asyncio.get_event_loop_policy(), uvloop.EventLoopPolicy)
    finally:
        asyncio.set_event_loop_policy(None)
