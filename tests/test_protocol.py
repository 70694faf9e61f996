"""The message codec: round trips, every rejection code, and the spec in docs/protocol.md."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import msgpack
import pytest
import zmq

from common import protocol as p

INFO = p.WorkerInfo(
    worker_id="decode-0", role="decode", model="smollm2", control_addr="tcp://10.0.0.2:5000",
    kv_addr="tcp://10.0.0.2:5001", host_id="host-a", block_size=16, num_blocks=4096,
    fingerprint="f" * 16, kv_dtype="bfloat16", num_layers=30, num_kv_heads=3, head_dim=64,
    tp_size=2, block_hash="xxh3_64-chain-v1", block_hash_seed=0x7064_7365_7276_6531,
    protocol_version=p.PROTOCOL_VERSION,
)
REFUSAL = p.WorkerRefusal(worker_id="decode-1", role="decode", model="smollm2",
                          setting="block_size", reason="block_size 32 differs from 16",
                          at=1.5e9)
ADVERT = p.KVAdvert(host_id="h", endpoints={"shm": "shm://h:2", "tcp": "tcp://h:1"})
STATUS = p.WorkerStatus(info=INFO, alive=True, waiting=1, running=2, free_blocks=9,
                        step_time_ms=3.5)

NESTED = {"CostCoefficients", "KVAdvert", "PoolInstanceStatus", "SamplingParams", "StepSample",
          "TokenLogprob", "TopLogprob", "Usage", "WorkerInfo", "WorkerPoolCounts", "WorkerRefusal",
          "WorkerStatus", "Timing", "TtftSample", "RankAdvert"}

SAMPLES = {
    "error": p.Error(code="internal", message="boom"),
    "ack": p.Ack(detail="queued"),
    "hello": p.Hello(info=INFO),
    "welcome": p.Welcome(conductor_id="cond-1", heartbeat_interval_s=0.5),
    "leaving": p.Leaving(worker_id="decode-0"),
    "heartbeat": p.Heartbeat(
        worker_id="prefill-3", role="prefill", seq=12, waiting=2, running=7,
        queued_prefill_tokens=4096, free_blocks=100, total_blocks=512, step_time_ms=12.5,
        control_addr="tcp://10.0.0.3:5000",
        prefill_steps=[p.StepSample(seconds=0.25, tokens=[512, 64], cached=[0, 512])],
        decode_steps=[p.StepSample(seconds=0.01, batch=4, context=900)],
        ttft_samples=[p.TtftSample(request_id="r-1", seconds=1.25, remote=True)],
    ),
    "route": p.Route(model="m", prompt_len=40, block_hashes=[0, 2**64 - 1, 12345],
                     exclude=["decode-1"]),
    "route_reply": p.RouteReply(decode_id="d0", decode_addr="tcp://d0:1", prefill_id=None,
                                prefill_addr=None, reason="short_prompt"),
    "generate": p.Generate(
        prompt_token_ids=[1, 2, 3],
        sampling=p.SamplingParams(temperature=0.7, top_p=0.9, seed=2**64 - 1,
                                  stop_token_ids=(2, 7), logprobs=3),
        stream_addr="tcp://gw:7000", prefill_id="p0", prefill_addr="tcp://p0:1",
        cache_salt="tenant-a", start_position=5,
    ),
    "prefill": p.Prefill(
        prompt_token_ids=list(range(100)), sampling=p.SamplingParams(temperature=0.0),
        stream_addr="tcp://gw:7000", kv_addr="tcp://d0:2", block_ids=[7, 8, 9], skip_blocks=3,
        lease_s=2.0, decode_id="d0", cache_salt=None, kv_advert=ADVERT,
    ),
    "prefill_done": p.PrefillDone(first_token=42, num_chunks=6, cached_tokens=48),
    "abort": p.Abort(reason="timeout"),
    "tokens": p.Tokens(
        position=3, token_ids=[5, 6], finished=True, finish_reason="stop", prompt_tokens=10,
        cached_tokens=4, source="decode", error=None,
        logprobs=[p.TokenLogprob(token_id=5, logprob=-0.1, rank=1,
                                 top=[p.TopLogprob(5, -0.1), p.TopLogprob(9, -2.0)]),
                  p.TokenLogprob(token_id=6, logprob=-2.5)],
    ),
    "get_stats": p.GetStats(),
    "worker_stats": p.WorkerStats(
        info=INFO, executor="torch", free_blocks=10, waiting=0, running=1, num_requests=1,
        transfer_backends={"shm": 3}, kv_advert=ADVERT,
        pool=p.WorkerPoolCounts(fetches=2, fetch_seconds=0.5, instances=["pool-0"])),
    "conductor_stats": p.ConductorStats(
        workers=[STATUS], policy="cache_aware", cost_profile="x",
        cost_model=p.CostCoefficients(0.1, 1e-3, 1e-6, 0.01, 1e-3, 1e-5),
        cost_observations=[3, 4], bad_samples=0, index_blocks=7,
        index_locations={"decode-0": 7},
        cache_pools=[p.PoolInstanceStatus("a", "tcp://a:1", "tcp://a:2", True, 7, 0.5)],
        refused=[REFUSAL], contention=[1.0, 1.5]),
    "pool_stats": p.PoolStats(
        instance_id="a", boot_id="b", control_addr="tcp://a:1", events_addr="tcp://a:2",
        block_bytes=4096, policy="lru", dram_capacity_bytes=1 << 30, ssd_capacity_bytes=0,
        kv_advert=ADVERT, dram_blocks=3, transfers={"in_ok": 1}),
    "list_workers": p.ListWorkers(model="m"),
    "worker_list": p.WorkerList(workers=[STATUS, dataclasses.replace(STATUS, alive=False)],
                                refused=[REFUSAL]),
    "held_blocks": p.HeldBlocks(source="pool:a", hashes=[1, 2**64 - 1], tiers=["dram", "ssd"]),
    "client_request": p.ClientRequest(
        model="m", sampling={"max_tokens": 8}, prompt=None, prompt_token_ids=None,
        messages=[{"role": "user", "content": "hi"}], stop=["\n\n"], stream=False,
        cache_salt="s", timeout_s=30.0,
    ),
    "client_chunk": p.ClientChunk(
        text="Hello", token_ids=[9906], position=0, finished=True, finish_reason="length",
        usage=p.Usage(prompt_tokens=3, completion_tokens=1, total_tokens=4, cached_tokens=0),
        error=None,
    ),
    "pool_put": p.PoolPut(keys=[0, 2**64 - 1], depths=[0, 1], block_bytes=4096,
                          transfer_id="t1", lease_s=2.0),
    "pool_ready": p.PoolReady(kv_advert=ADVERT),
    "pool_commit": p.PoolCommit(transfer_id="t1", abort="checksum mismatch"),
    "pool_get": p.PoolGet(keys=[5, 6, 7], transfer_id="t2", kv_advert=ADVERT, lease_s=2.0),
    "pool_blocks": p.PoolBlocks(found=2),
    "pool_exists": p.PoolExists(keys=[2**63, 1]),
    "pool_found": p.PoolFound(found=2, tiers=["dram", "ssd"]),
    "pool_remove": p.PoolRemove(keys=[]),
    "kv_event": p.KVEvent(source="pool:a", kind="stored", hashes=[1, 2**64 - 1], tier="dram"),
    "resync": p.Resync(),
    "migrate": p.Migrate(
        prompt_token_ids=[1, 2, 3], output_token_ids=[9, 8], stream_addr="tcp://gw:7000",
        sampling=p.SamplingParams(temperature=0.5, seed=7, max_tokens=40),
        start_position=4, source_id="decode-0", cache_salt="t", cached_tokens=16),
    "migrate_ready": p.MigrateReady(block_ids=[4, 5, 6], skip_blocks=1, lease_s=10.0,
                                    kv_advert=ADVERT, kv_token=b"\x00" * 16),
    "migrate_done": p.MigrateDone(num_chunks=30),
    "stream_moved": p.StreamMoved(worker_id="decode-1", control_addr="tcp://d1:1",
                                  position=6),
}


def _frame0(**overrides):
    head = {"v": p.PROTOCOL_VERSION, "type": "ack", "id": "m1", "parent": None, "rid": None,
            "body": {}}
    head.update(overrides)
    return msgpack.packb(head, use_bin_type=True)


def _code(frames, **kw) -> str:
    with pytest.raises(p.ProtocolError) as info:
        p.decode(frames, **kw)
    return info.value.code


def test_samples_cover_the_registry():
    assert set(SAMPLES) == set(p.registry())
    for name, record in SAMPLES.items():
        assert p.registry()[name] is type(record)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_round_trip_with_bulk(name):
    record = SAMPLES[name]
    bulk = [b"\x00\x01\xff" * 1000, memoryview(bytearray(b"kv-bytes")), b""]
    frames = p.encode(record, request_id="req-1", parent="msg-0", msg_id="msg-1", bulk=bulk)
    assert len(frames) == 1 + len(bulk)
    for wire in (frames, [bytes(f) for f in frames], [zmq.Frame(bytes(f)) for f in frames]):
        got = p.decode(wire)
        assert got.record == record
        assert type(got.record) is type(record)
        assert got.envelope == p.Envelope(type=name, id="msg-1", parent="msg-0",
                                          request_id="req-1", version=p.PROTOCOL_VERSION)
        assert [bytes(b) for b in got.bulk] == [bytes(b) for b in bulk]


def test_encode_defaults_and_fresh_ids():
    a, b = p.encode(p.Ack()), p.encode(p.Ack())
    assert len(a) == 1
    env_a, env_b = p.decode(a).envelope, p.decode(b).envelope
    assert re.fullmatch(r"[0-9a-f]{32}", env_a.id) and env_a.id != env_b.id
    assert env_a.parent is None and env_a.request_id is None


def test_wire_envelope_layout():
    [frame] = p.encode(p.Abort(), request_id="r", parent="q", msg_id="m")
    assert msgpack.unpackb(frame) == {"v": 2, "type": "abort", "id": "m", "parent": "q",
                                      "rid": "r", "body": {"reason": "client"}}


def test_optional_fields_may_be_omitted_and_unknown_ones_are_ignored():
    body = {"position": 0, "token_ids": [1], "added_in_v1_5": {"x": 1}}
    got = p.decode([_frame0(type="tokens", body=body, extra_key="ignored")])
    assert got.record == p.Tokens(position=0, token_ids=[1])
    assert got.record.logprobs == [] and got.record.source == "decode"


def test_envelope_parent_and_rid_may_be_absent():
    head = {"v": p.PROTOCOL_VERSION, "type": "ack", "id": "x", "body": {}}
    env = p.decode([msgpack.packb(head)]).envelope
    assert env.parent is None and env.request_id is None


def test_float_field_accepts_int_and_makes_it_float():
    body = {"conductor_id": "c", "heartbeat_interval_s": 2}
    got = p.decode([_frame0(type="welcome", body=body)]).record
    assert got.heartbeat_interval_s == 2.0 and type(got.heartbeat_interval_s) is float


@pytest.mark.parametrize("frames", [
    [],
    [b"\xc1"],  # a byte msgpack never uses
    [b"\x92\x01"],  # truncated array
    [msgpack.packb([1, 2])],  # not a map
    [_frame0(id="x") + b"\x00"],  # trailing bytes
    [_frame0(id=None)],
    [_frame0(type=7)],
    [_frame0(v=True)],
    [_frame0(parent=5)],
    [_frame0(body=[])],
    [_frame0(body={"detail": msgpack.ExtType(1, b"x")})],
    [_frame0(), 12345],  # a bulk frame that is not bytes-like
])
def test_malformed(frames):
    assert _code(frames) == "malformed"


def test_unknown_type_keeps_envelope():
    with pytest.raises(p.ProtocolError) as info:
        p.decode([_frame0(type="teleport", id="abc", rid="r9")])
    assert info.value.code == "unknown_type"
    assert info.value.envelope.id == "abc" and info.value.envelope.request_id == "r9"


@pytest.mark.parametrize("version", [0, 1, 3, 999])
def test_wrong_version(version):
    with pytest.raises(p.ProtocolError) as info:
        p.decode([_frame0(v=version)])
    assert info.value.code == "version" and info.value.envelope.version == version


def test_missing_required_field():
    with pytest.raises(p.ProtocolError) as info:
        p.decode([_frame0(type="error", body={"code": "x"})])
    assert info.value.code == "missing_field" and "message" in info.value.message


@pytest.mark.parametrize("type_name, body", [
    ("prefill_done", {"first_token": True, "num_chunks": 1}),  # bool is not int
    ("prefill_done", {"first_token": 1.0, "num_chunks": 1}),
    ("tokens", {"position": 0, "token_ids": "1,2,3"}),  # str for list[int]
    ("tokens", {"position": 0, "token_ids": [1, True]}),
    ("tokens", {"position": 0, "token_ids": [1, "2"]}),
    ("tokens", {"position": 0, "token_ids": [1], "finished": 1}),
    ("tokens", {"position": 0, "token_ids": [1], "logprobs": [1.0]}),
    ("tokens", {"position": None, "token_ids": [1]}),  # None only where Optional
    ("error", {"code": b"bytes", "message": "m"}),
    ("welcome", {"conductor_id": "c", "heartbeat_interval_s": "1"}),
    ("client_request", {"model": "m", "sampling": {1: "int key"}}),
    ("client_request", {"model": "m", "sampling": [["a", 1]]}),
    ("client_request", {"model": "m", "sampling": {"t": msgpack.Timestamp(1)}}),
    ("hello", {"info": "decode-0"}),  # a nested record is a map
    ("hello", {"info": {"worker_id": "w"}}),  # with its required fields
    ("pool_ready", {"kv_advert": {"host_id": 7, "endpoints": {}}}),
    ("tokens", {"position": 0, "token_ids": [1], "logprobs": [{"token_id": 1, "logprob": "x"}]}),
    ("generate", {"prompt_token_ids": [1], "stream_addr": "s",
                  "sampling": {"top_p": 2.0}}),  # SamplingParams' own checks refuse it
    ("generate", {"prompt_token_ids": [1], "stream_addr": "s",
                  "sampling": {"stop_token_ids": [1, "2"]}}),
    ("client_request", {"model": "m", "sampling": {}, "prompt_token_ids": [0.5]}),
    ("route", {"model": "m", "prompt_len": 1, "exclude": [1]}),
])
def test_wrong_type(type_name, body):
    assert _code([_frame0(type=type_name, body=body)]) == "wrong_type"


def test_oversized_envelope_and_bulk():
    frame = p.encode(p.Ack(detail="x" * 1000))[0]
    assert _code([frame], max_frame_bytes=999) == "oversized"
    assert _code([b"\xc1" * 1001], max_frame_bytes=1000) == "oversized"  # before unpacking
    big = p.encode(p.Ack(detail="x" * 1000), msg_id="big", request_id="r")
    with pytest.raises(p.ProtocolError) as info:
        p.decode(big, max_frame_bytes=999)
    assert info.value.envelope == p.Envelope("ack", "big", None, "r", p.PROTOCOL_VERSION)
    frames = p.encode(p.Ack(), bulk=[b"a" * 10, b"b" * 101])
    assert len(p.decode(frames, max_bulk_bytes=101).bulk) == 2
    assert _code(frames, max_bulk_bytes=100) == "oversized"


def test_encode_refuses_objects_instead_of_pickling():
    class Opaque:
        pass

    with pytest.raises(p.ProtocolError, match="ack.detail: expected str, got Opaque") as info:
        p.encode(p.Ack(detail=Opaque()))
    assert info.value.code == "wrong_type"
    with pytest.raises(p.ProtocolError, match="Opaque is not a plain msgpack value"):
        p.encode(p.ClientRequest(model="m", sampling={"x": [1, Opaque()]}))
    with pytest.raises(p.ProtocolError, match="too big|cannot encode"):
        p.encode(p.ClientRequest(model="m", sampling={"x": 2**70}))


@pytest.mark.parametrize("record", [
    p.PrefillDone(first_token=True, num_chunks=1),
    p.Tokens(position=0, token_ids=(1, 2)),
    p.Route(model="m", prompt_len=1, block_hashes=[1, None]),
    p.ClientRequest(model="m", sampling={3: "int key"}),
    p.Hello(info={"worker_id": "w"}),  # a dict is not the nested record
    p.PoolReady(kv_advert=p.KVAdvert(host_id=7, endpoints={})),
    p.Heartbeat(worker_id="w", role="r", seq=0, waiting=0, running=0, queued_prefill_tokens=0,
                free_blocks=0, total_blocks=0, step_time_ms=0.0,
                prefill_steps=[p.StepSample(seconds=1.0, tokens=[1], cached=[True])]),
])
def test_encode_checks_field_types(record):
    with pytest.raises(p.ProtocolError) as info:
        p.encode(record)
    assert info.value.code == "wrong_type"


def test_encode_rejects_unregistered_records_and_bad_bulk():
    @dataclass(frozen=True, slots=True)
    class NotAMessage:
        x: int

    with pytest.raises(TypeError, match="not a registered message record"):
        p.encode(NotAMessage(1))
    with pytest.raises(TypeError, match="bulk item 0"):
        p.encode(p.Ack(), bulk=["text"])


def test_registration_rules():
    @dataclass(frozen=True)
    class NoSlots:
        x: int

    @dataclass(slots=True)
    class NotFrozen:
        x: int

    @dataclass(frozen=True, slots=True)
    class BadField:
        x: set

    @dataclass(frozen=True, slots=True)
    class Fine:
        x: int

    with pytest.raises(TypeError, match="frozen, slotted"):
        p.message("t_no_slots")(NoSlots)
    with pytest.raises(TypeError, match="frozen, slotted"):
        p.message("t_not_frozen")(NotFrozen)
    with pytest.raises(TypeError, match="unsupported field type"):
        p.message("t_bad_field")(BadField)
    with pytest.raises(TypeError, match="registered twice"):
        p.message("error")(Fine)
    assert set(p.registry()) == set(SAMPLES)


def test_nested_records_round_trip_as_maps_and_rebuild_as_records():
    record = SAMPLES["conductor_stats"]
    [frame] = p.encode(record)
    body = msgpack.unpackb(frame)["body"]
    assert body["workers"][0]["info"]["block_size"] == 16  # a map on the wire
    assert body["cost_model"]["decode_fixed_s"] == 0.01
    got = p.decode([frame]).record
    assert got == record and type(got.workers[0].info) is p.WorkerInfo
    assert type(got.cache_pools[0]) is p.PoolInstanceStatus
    # tuple[int, ...]: a list on the wire, a tuple again in the record.
    sampling = p.decode(p.encode(SAMPLES["generate"])).record.sampling
    assert sampling.stop_token_ids == (2, 7) and type(sampling) is p.SamplingParams


@pytest.mark.parametrize("type_name, body, where", [
    ("generate", {"prompt_token_ids": [1], "stream_addr": "s", "sampling": {"top_k": "3"}},
     "generate.sampling.top_k: expected int, got str"),
    ("worker_list", {"workers": [{"info": {**dataclasses.asdict(INFO), "block_size": 1.5},
                                  "alive": True}]},
     "worker_list.workers[0].info.block_size: expected int, got float"),
    ("hello", {"info": {k: v for k, v in dataclasses.asdict(INFO).items() if k != "role"}},
     "hello.info: missing field 'role'"),
    ("tokens", {"position": 0, "token_ids": [1, 2, "x"]},
     "tokens.token_ids[2]: expected int, got str"),
    ("tokens", {"position": 0, "token_ids": [1], "logprobs": [
        {"token_id": 1, "logprob": -1.0, "top": [{"token_id": 1, "logprob": None}]}]},
     "tokens.logprobs[0].top[0].logprob: expected float, got NoneType"),
])
def test_wrong_nested_type_names_its_path(type_name, body, where):
    with pytest.raises(p.ProtocolError) as info:
        p.decode([_frame0(type=type_name, body=body)])
    assert info.value.code == "wrong_type" and info.value.message == where
    assert info.value.envelope is not None


def _deep(levels: int, leaf=0):
    value = leaf
    for _ in range(levels):
        value = {"a": value}
    return value


@pytest.mark.parametrize("make_body", [
    lambda v: {"model": "m", "sampling": v},  # a plain dict field
    lambda v: {"model": "m", "sampling": {}, "messages": [v]},  # inside list[dict]
    lambda v: {"model": "m", "sampling": {}, "newer_field": v},  # a key the record ignores
    lambda v: v,  # the body itself
])
def test_values_nested_1000_deep_are_malformed_not_a_crash(make_body):
    frame = _frame0(type="client_request", body=make_body(_deep(1000)))
    assert _code([frame]) == "malformed"
    # Lists too, and just past the limit; just within it is accepted.
    deep_list = [0]
    for _ in range(1000):
        deep_list = [deep_list]
    assert _code([_frame0(type="client_request",
                          body={"model": "m", "sampling": {"x": deep_list}})]) == "malformed"
    ok = _frame0(type="client_request", body={"model": "m", "sampling": _deep(31)})
    assert p.decode([ok]).record.sampling == _deep(31)
    with pytest.raises(p.ProtocolError) as info:
        p.encode(p.ClientRequest(model="m", sampling=_deep(1000)))
    assert info.value.code == "wrong_type"


def test_decode_raises_only_protocol_errors_for_any_bytes():
    import random

    rng = random.Random(5)
    good = [bytes(p.encode(r)[0]) for r in SAMPLES.values()]
    for i in range(3000):
        frame = bytearray(rng.choice(good))
        for _ in range(rng.randrange(1, 6)):
            if frame:
                frame[rng.randrange(len(frame))] = rng.randrange(256)
        if i % 7 == 0:
            frame = frame[: rng.randrange(len(frame) + 1)]
        with contextlib.suppress(p.ProtocolError):
            p.decode([bytes(frame)])


def test_nested_record_registration_rules():
    @dataclass(frozen=True)
    class NoSlots:
        x: int

    with pytest.raises(TypeError, match="frozen, slotted"):
        p.record(NoSlots)
    with pytest.raises(TypeError, match="registered twice"):
        p.record(p.WorkerInfo)
    with pytest.raises(TypeError, match="registered twice"):
        p.record(p.Ack)  # a message is not also a nested record
    with pytest.raises(TypeError, match="registered twice"):
        p.message("t_info")(p.WorkerInfo)
    assert set(p.records()) == set(NESTED)


def test_protocol_error_rejects_unknown_codes():
    with pytest.raises(ValueError, match="unknown protocol error code"):
        p.ProtocolError("nope", "x")


# --- docs/protocol.md agrees with the registry ------------------------------------------

DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"
_PIPE = re.compile(r"(?<!\\)\|")


def _type_name(annotation) -> str:
    """Written independently of the codec: the spelling the spec uses for a type."""
    if typing.get_origin(annotation) in (types.UnionType, typing.Union):
        [inner] = [a for a in typing.get_args(annotation) if a is not type(None)]
        return f"{_type_name(inner)} | None"
    if typing.get_origin(annotation) is list:
        return f"list[{_type_name(typing.get_args(annotation)[0])}]"
    if typing.get_origin(annotation) is tuple:
        item, dots = typing.get_args(annotation)
        assert dots is Ellipsis
        return f"tuple[{_type_name(item)}, ...]"
    return annotation.__name__


def _spec_from_code(catalog):
    spec = {}
    for name, cls in catalog.items():
        hints = typing.get_type_hints(cls)
        rows = []
        for f in dataclasses.fields(cls):
            required = (f.default is dataclasses.MISSING
                        and f.default_factory is dataclasses.MISSING)
            rows.append((f.name, _type_name(hints[f.name]), required))
        spec[name] = (cls.__name__, rows)
    return spec


def _spec_from_doc(section_name: str):
    """Messages: ``### `type_name` `` then "Record `Class`."; nested records:
    ``### `Class` ``. Then the field table."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split(f"\n## {section_name}\n", 1)[1].split("\n## ", 1)[0]
    spec = {}
    for chunk in re.split(r"^### ", section, flags=re.M)[1:]:
        heading, _, rest = chunk.partition("\n")
        name = re.fullmatch(r"`(\w+)`", heading.strip()).group(1)
        found = re.search(r"^Record `(\w+)`\.", rest, flags=re.M)
        record = found.group(1) if found else name
        lines = [ln for ln in rest.splitlines() if ln.startswith("|")]
        header = [c.strip() for c in _PIPE.split(lines[0])[1:-1]]
        assert header == ["field", "type", "required", "meaning"], name
        assert set(lines[1]) <= set("|- "), name
        rows = []
        for line in lines[2:]:
            cells = [c.strip().replace("\\|", "|") for c in _PIPE.split(line)[1:-1]]
            field_name, type_name, required, meaning = cells
            assert required in ("yes", "no"), (name, line)
            assert meaning, (name, line)
            rows.append((field_name.strip("`"), type_name.strip("`"), required == "yes"))
        assert name not in spec, f"{name} documented twice"
        spec[name] = (record, rows)
    return spec


@pytest.mark.parametrize("section, catalog", [("Messages", p.registry()),
                                               ("Nested records", p.records())])
def test_doc_agrees_with_registry(section, catalog):
    doc, code = _spec_from_doc(section), _spec_from_code(catalog)
    assert sorted(doc) == sorted(code)
    for name in code:
        assert doc[name] == code[name], name


def test_doc_lists_every_error_code():
    text = DOC.read_text(encoding="utf-8")
    errors = text.split("\n## Errors\n", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", errors, flags=re.M))
    assert documented >= p.ERROR_CODES
    assert "internal" in documented


def test_list_of_floats_takes_ints_as_floats_and_refuses_other_items():
    body = msgpack.unpackb(p.encode(SAMPLES["conductor_stats"])[0])["body"]
    got = p.decode([_frame0(type="conductor_stats", body={**body, "contention": [1, 2.5]})])
    assert got.record.contention == [1.0, 2.5] and type(got.record.contention[0]) is float
    with pytest.raises(p.ProtocolError) as info:
        p.decode([_frame0(type="conductor_stats", body={**body, "contention": [1.0, "2"]})])
    assert info.value.message == "conductor_stats.contention[1]: expected float, got str"
