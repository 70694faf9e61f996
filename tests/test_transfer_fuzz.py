"""Whatever a peer puts on a data-plane connection: seeded random mutations of valid
messages, and valid message maps with fields of every wrong type, reach each decoder and a
live tcp receiver. A decoder refuses them with its own error type (WireError,
ControlError) and nothing else; the receiver's callbacks never raise into the event loop,
and a valid transfer on a new connection still lands exact."""

from __future__ import annotations

import asyncio
import random
import struct

import msgpack
import pytest

from common.transfer import batch, control, make_receiver, shm, wire

pytestmark = pytest.mark.timeout(120)
TOKEN = b"k" * 16
ODD_VALUES = (None, True, -1, -(2**63), 2**64 - 1, 1.5, "", "x" * 300, b"x", [1], {"a": 1}, [[]])


def mutated(raw: bytes, rng: random.Random) -> bytes:
    """``raw`` with one to four random edits: a byte changed, a cut, bytes inserted, or a
    u64 of an edge value written over (lengths, counts)."""
    out = bytearray(raw)
    for _ in range(rng.randint(1, 4)):
        op, at = rng.random(), rng.randrange(len(out) + 1)
        if op < 0.5 and at < len(out):
            out[at] = rng.randrange(256)
        elif op < 0.65:
            del out[at:]
        elif op < 0.85:
            out[at:at] = rng.randbytes(rng.randint(1, 8))
        else:
            out[at : at + 8] = struct.pack("<Q", rng.choice([0, 1, 2**32, 2**63, 2**64 - 1]))
    return bytes(out)


def odd_maps(cls, rng: random.Random, count: int):
    """Maps with exactly ``cls``'s fields, each set to a value of a wrong type (or a right
    one) at random: what a msgpack header can hold but the spec does not allow."""
    for _ in range(count):
        yield {name: rng.choice(ODD_VALUES) for name in cls._fields}


def prefixed(kind: wire.Kind, header: bytes, payload_len: int = 0) -> bytes:
    return wire.PREFIX.pack(wire.MAGIC, wire.VERSION, kind, 0, len(header), payload_len) + header


def test_wire_decoders_refuse_mutations_and_odd_fields_with_wire_errors():
    rng = random.Random(1)
    chunk = wire.encode_chunk(wire.Chunk("req-1", 3, [1, 2, 3], 0, 0, TOKEN), 77)
    head = batch.encode(batch.Batch("r", [0, 1, 2], [[1, 2], [3], [4, 5]], 0, [10, 11, 12],
                                    1, TOKEN), 5, 33)
    ends = [wire.encode(wire.Finish("r", 3, TOKEN)), wire.encode(wire.Abort("r", "x", TOKEN))]
    verdicts = [wire.encode_verdict(wire.OK),
                wire.encode_verdict(wire.Verdict(wire.Status.FAILED, "why"))]
    refused = accepted = 0

    def attempt(decode, *args) -> None:
        nonlocal refused, accepted
        try:
            decode(*args)
            accepted += 1
        except wire.WireError:
            refused += 1

    for _ in range(3000):
        attempt(wire.decode_chunk, mutated(chunk, rng))
        attempt(batch.decode, mutated(head, rng), rng.choice([33, 0, 2**40]))
        raw = mutated(rng.choice(ends), rng)
        attempt(lambda r: wire.decode_header(*wire.decode_prefix(r[:wire.PREFIX.size])[:1],
                                             r[wire.PREFIX.size:]), raw)
        attempt(wire.decode_prefix, raw[: wire.PREFIX.size])
        attempt(wire.split_verdicts, bytearray(mutated(b"".join(verdicts), rng)))
    for cls, kind in ((wire.Verdict, wire.Kind.VERDICT), (wire.Finish, wire.Kind.FINISH),
                      (wire.Abort, wire.Kind.ABORT)):
        for fields in odd_maps(cls, rng, 300):
            raw = prefixed(kind, msgpack.packb(fields))
            decode = wire.split_verdicts if kind is wire.Kind.VERDICT else (
                lambda r, k=kind: wire.decode_header(k, r[wire.PREFIX.size:]))
            attempt(decode, bytearray(raw))
    # Both outcomes happen: the mutations reach past the first check.
    assert refused > 10_000 and accepted > 100


def test_shm_control_frames_refuse_mutations_and_odd_fields_with_control_errors():
    rng = random.Random(2)
    frames = [
        shm.chunk_frame(wire.Chunk("req", 3, [1, 2], 0, 0, TOKEN), 2, 5, 100, 64, 99),
        shm.chunk_frame(batch.Batch("r", [0, 1], [[1], [2, 3]], 0, [10, 20], 0, TOKEN),
                        1, 2, 0, 30, 7),
    ]
    maps = [control.pack("finish", request_id="r", num_chunks=3, token=TOKEN),
            control.pack("abort", request_id="r", reason="x", token=TOKEN),
            shm.verdict_frame(3, wire.Verdict(wire.Status.RESEND, "again"))]
    refused = accepted = 0

    def read(fields) -> None:
        if isinstance(fields, tuple):  # a known OK verdict, read already
            return
        if isinstance(fields, bytes):
            shm.read_chunk(fields)
        elif fields.get("t") == "finish":
            control.finish(fields)
        elif fields.get("t") == "abort":
            control.message(fields, wire.Abort)
        else:
            shm.read_verdict(fields)

    def attempt(frames_of) -> None:
        nonlocal refused, accepted
        try:
            for fields in frames_of():
                read(fields)
            accepted += 1
        except control.ControlError:
            refused += 1

    for _ in range(3000):
        raw = mutated(rng.choice(frames + maps), rng)
        attempt(lambda r=raw: control.FrameParser(shm.KNOWN_VERDICTS).feed(r))
    odd = ({"t": "finish", **f} for f in odd_maps(wire.Finish, rng, 300))
    odd = [*odd, *({"t": "abort", **f} for f in odd_maps(wire.Abort, rng, 300)),
           *({"t": "verdict", "slot": rng.choice(ODD_VALUES), **f}
             for f in odd_maps(wire.Verdict, rng, 300))]
    for fields in odd:
        attempt(lambda f=fields: [f])
    assert refused > 1500 and accepted > 100


@pytest.mark.parametrize("lands", [False, True], ids=["sink-call", "sink-names-places"])
async def test_mutated_streams_never_raise_into_the_loop_and_the_receiver_serves_on(lands):
    rng = random.Random(3)
    landed: list = []

    class Landing:
        def __call__(self, rid, layer, blocks, payload):
            landed.append((rid, layer, bytes(payload)))

        def landing_many(self, rid, layers, blocks, sizes):
            places = [memoryview(bytearray(n)) for n in sizes]
            landed.append((rid, places))
            return places

        def landed_many(self, rid, layers, blocks, sizes):
            pass

    loop_errors: list = []
    asyncio.get_running_loop().set_exception_handler(lambda _, ctx: loop_errors.append(ctx))
    rx = make_receiver("tcp", sink=Landing() if lands else Landing().__call__)
    await rx.start()
    host, port = rx.address.removeprefix("tcp://").rsplit(":", 1)

    def layers(count: int, size: int):
        return [(layer, [layer + 7, 3 * layer + 1], rng.randbytes(size + layer))
                for layer in range(count)]

    def batch_message(rid: str, chunks) -> bytes:
        message = batch.Batch(rid, [c[0] for c in chunks], [c[1] for c in chunks], 0,
                              [len(c[2]) for c in chunks], 0, TOKEN)
        payload = b"".join(c[2] for c in chunks)
        head = batch.encode(message, wire.checksum(payload), len(payload))
        return prefixed(wire.Kind.BATCH, head, len(payload)) + payload

    def chunk_message(rid: str, layer: int, blocks: list[int], data: bytes) -> bytes:
        chunk = wire.Chunk(rid, layer, blocks, 0, 0, TOKEN)
        return wire.encode_chunk_message(chunk, wire.checksum(data), len(data)) + data

    try:
        failed = 0
        for n in range(24):
            rid = f"r{n}"
            transfer = rx.expect(rid, lease_s=0.2, token=TOKEN)
            chunks = layers(rng.randint(1, 4), rng.choice([10, 300, 70_000]))
            parts = ([batch_message(rid, chunks)] if n % 2 else
                     [chunk_message(rid, *c) for c in chunks])
            parts.append(wire.encode(wire.Finish(rid, len(chunks), TOKEN)))
            spoiled = rng.randrange(len(parts))
            parts[spoiled] = mutated(parts[spoiled], rng)
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"".join(parts))
            try:
                await writer.drain()
                await asyncio.wait_for(reader.read(1 << 16), 0.05)
            except (TimeoutError, ConnectionError):
                pass
            writer.close()
            try:
                await asyncio.wait_for(transfer.wait(), 2)
            except Exception:  # noqa: BLE001  failed or expired: what a spoiled one may do
                failed += 1
        assert failed >= 12  # most spoiled transfers fail; a few edits land harmlessly
        assert loop_errors == []
        assert rx.live() == 0
        # A valid transfer on a new connection lands byte for byte.
        landed.clear()
        transfer = rx.expect("final", lease_s=5, token=TOKEN)
        chunks = layers(3, 100)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(batch_message("final", chunks) + wire.encode(wire.Finish("final", 3, TOKEN)))
        await transfer.wait()
        writer.close()
        if lands:
            [(rid, places)] = landed
            assert rid == "final" and [bytes(p) for p in places] == [c[2] for c in chunks]
        else:
            assert landed == [("final", c[0], c[2]) for c in chunks]
    finally:
        await rx.close()
