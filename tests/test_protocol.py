"""The message codec: round trips, every rejection code, and the spec in docs/protocol.md."""

from __future__ import annotations

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

SAMPLES = {
    "error": p.Error(code="internal", message="boom"),
    "ack": p.Ack(detail="queued"),
    "hello": p.Hello(
        worker_id="decode-0", role="decode", model="smollm2", control_addr="tcp://10.0.0.2:5000",
        kv_addr="tcp://10.0.0.2:5001", host_id="host-a", block_size=16, num_blocks=4096,
        fingerprint="f" * 16,
    ),
    "welcome": p.Welcome(conductor_id="cond-1", heartbeat_interval_s=0.5),
    "heartbeat": p.Heartbeat(
        worker_id="prefill-3", role="prefill", seq=12, waiting=2, running=7,
        queued_prefill_tokens=4096, free_blocks=100, total_blocks=512, step_time_ms=12.5,
        control_addr="tcp://10.0.0.3:5000",
    ),
    "route": p.Route(model="m", prompt_len=40, block_hashes=[0, 2**64 - 1, 12345],
                     exclude=["decode-1"]),
    "route_reply": p.RouteReply(decode_id="d0", decode_addr="tcp://d0:1", prefill_id=None,
                                prefill_addr=None, reason="short_prompt"),
    "generate": p.Generate(
        prompt_token_ids=[1, 2, 3], sampling={"temperature": 0.7, "top_p": 0.9, "seed": None,
                                              "stop_ids": [2], "nested": {"a": b"\x00"}},
        stream_addr="tcp://gw:7000", prefill_id="p0", prefill_addr="tcp://p0:1",
        cache_salt="tenant-a", start_position=5,
    ),
    "prefill": p.Prefill(
        prompt_token_ids=list(range(100)), sampling={"temperature": 0.0},
        stream_addr="tcp://gw:7000", kv_addr="tcp://d0:2", block_ids=[7, 8, 9], skip_blocks=3,
        lease_s=2.0, decode_id="d0", cache_salt=None,
    ),
    "prefill_done": p.PrefillDone(first_token=42, num_chunks=6, cached_tokens=48),
    "abort": p.Abort(reason="timeout"),
    "tokens": p.Tokens(
        position=3, token_ids=[5, 6], finished=True, finish_reason="stop", prompt_tokens=10,
        cached_tokens=4, source="decode", error=None, logprobs=[{"5": -0.1}, {"6": -2.5}],
    ),
    "get_stats": p.GetStats(),
    "stats": p.Stats(values={"running": 3, "kv_usage": 0.25, "names": ["a", "b"]}),
    "client_request": p.ClientRequest(
        model="m", sampling={"max_tokens": 8}, prompt=None, prompt_token_ids=None,
        messages=[{"role": "user", "content": "hi"}], stop=["\n\n"], stream=False,
        cache_salt="s", timeout_s=30.0,
    ),
    "client_chunk": p.ClientChunk(
        text="Hello", token_ids=[9906], position=0, finished=True, finish_reason="length",
        usage={"prompt_tokens": 3, "completion_tokens": 1}, error=None,
    ),
    "pool_put": p.PoolPut(keys=[0, 2**64 - 1], depths=[0, 1], block_bytes=4096,
                          transfer_id="t1", lease_s=2.0),
    "pool_ready": p.PoolReady(kv_advert={"host_id": "h", "endpoints": {"tcp": "tcp://h:1"}}),
    "pool_commit": p.PoolCommit(transfer_id="t1", abort="checksum mismatch"),
    "pool_get": p.PoolGet(keys=[5, 6, 7], transfer_id="t2",
                          kv_advert={"host_id": "h", "endpoints": {"shm": "shm://h:2"}},
                          lease_s=2.0),
    "pool_blocks": p.PoolBlocks(found=2),
    "pool_exists": p.PoolExists(keys=[2**63, 1]),
    "pool_found": p.PoolFound(found=2, tiers=["dram", "ssd"]),
    "pool_remove": p.PoolRemove(keys=[]),
    "kv_event": p.KVEvent(source="pool:a", kind="stored", hashes=[1, 2**64 - 1], tier="dram"),
    "resync": p.Resync(),
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
    ("stats", {"values": {1: "int key"}}),
    ("stats", {"values": [["a", 1]]}),
    ("stats", {"values": {"t": msgpack.Timestamp(1)}}),
    ("client_request", {"model": "m", "sampling": {}, "prompt_token_ids": [0.5]}),
    ("route", {"model": "m", "prompt_len": 1, "exclude": [1]}),
])
def test_wrong_type(type_name, body):
    assert _code([_frame0(type=type_name, body=body)]) == "wrong_type"


def test_oversized_envelope_and_bulk():
    frame = p.encode(p.Stats(values={"blob": "x" * 1000}))[0]
    assert _code([frame], max_frame_bytes=999) == "oversized"
    assert _code([b"\xc1" * 1001], max_frame_bytes=1000) == "oversized"  # before unpacking
    big = p.encode(p.Stats(values={"blob": "x" * 1000}), msg_id="big", request_id="r")
    with pytest.raises(p.ProtocolError) as info:
        p.decode(big, max_frame_bytes=999)
    assert info.value.envelope == p.Envelope("stats", "big", None, "r", p.PROTOCOL_VERSION)
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
        p.encode(p.Stats(values={"x": [1, Opaque()]}))
    with pytest.raises(p.ProtocolError, match="too big|cannot encode"):
        p.encode(p.Stats(values={"x": 2**70}))


@pytest.mark.parametrize("record", [
    p.PrefillDone(first_token=True, num_chunks=1),
    p.Tokens(position=0, token_ids=(1, 2)),
    p.Route(model="m", prompt_len=1, block_hashes=[1, None]),
    p.Stats(values={3: "int key"}),
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
    return annotation.__name__


def _spec_from_code():
    spec = {}
    for name, cls in p.registry().items():
        hints = typing.get_type_hints(cls)
        rows = []
        for f in dataclasses.fields(cls):
            required = (f.default is dataclasses.MISSING
                        and f.default_factory is dataclasses.MISSING)
            rows.append((f.name, _type_name(hints[f.name]), required))
        spec[name] = (cls.__name__, rows)
    return spec


def _spec_from_doc():
    text = DOC.read_text(encoding="utf-8")
    section = text.split("\n## Messages\n", 1)[1].split("\n## ", 1)[0]
    spec = {}
    for chunk in re.split(r"^### ", section, flags=re.M)[1:]:
        heading, _, rest = chunk.partition("\n")
        name = re.fullmatch(r"`([a-z_]+)`", heading.strip()).group(1)
        record = re.search(r"^Record `(\w+)`\.", rest, flags=re.M).group(1)
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


def test_doc_agrees_with_registry():
    doc, code = _spec_from_doc(), _spec_from_code()
    assert sorted(doc) == sorted(code)
    for name in code:
        assert doc[name] == code[name], name


def test_doc_lists_every_error_code():
    text = DOC.read_text(encoding="utf-8")
    errors = text.split("\n## Errors\n", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", errors, flags=re.M))
    assert documented >= p.ERROR_CODES
    assert "internal" in documented
