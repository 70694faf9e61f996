"""The shm sender's one-pass copy and checksum (kernels/cpu_copysum.py): the same
XXH3-64 digest as the xxhash package for every length and every way of cutting a payload
into chunks, the bytes copied exactly, and, end to end, a transfer staged by it verified
by a receiver that hashes with xxhash, a byte spoiled after staging asked for again."""

from __future__ import annotations

import os
import random
import secrets
import sys

import pytest
import xxhash

from common.transfer import make_receiver, make_sender, shm_sender
from kernels import cpu_copysum

pytestmark = pytest.mark.timeout(300)  # a cold extension cache builds the kernel first
TOKEN = secrets.token_bytes(16)


@pytest.fixture(scope="module")
def mod():
    pytest.importorskip("torch")
    # The module as built, vectorized or not: both folds must equal xxh3.
    built = cpu_copysum._KERNEL.module()
    if built is None:
        pytest.skip("no C++ compiler: the shm sender keeps its xxhash path")
    return built


def cut(payload: bytes, sizes: list[int]) -> list[memoryview]:
    view, out, at = memoryview(payload), [], 0
    for size in sizes:
        out.append(view[at : at + size])
        at += size
    return out


@pytest.mark.parametrize("sizes", [
    [241], [255], [256], [1023], [1024], [1025], [1024 * 16], [1024 * 16 + 1],
    [64, 64, 64, 64], [100, 141], [1, 2000, 3], [960, 64, 1], [1024, 1024],
    [24576] * 30, [0, 5000, 0, 77], [4 << 20, 1], [63, 65, 127, 129, 1000],
])
def test_the_digest_is_xxh3_of_the_payload_and_the_bytes_are_copied(mod, sizes):
    payload = os.urandom(sum(sizes))
    destination = bytearray(len(payload) + 100)
    digest = cpu_copysum.copy_sum(mod, memoryview(destination), cut(payload, sizes))
    assert digest == xxhash.xxh3_64_intdigest(payload)
    assert bytes(destination[: len(payload)]) == payload
    assert destination[len(payload) :] == bytes(100)  # nothing written past the payload


def test_random_cuts_match_xxh3(mod):
    rng = random.Random(7)
    for _ in range(200):
        sizes = [rng.choice([rng.randint(0, 200), rng.randint(0, 5000), 64 * rng.randint(1, 40)])
                 for _ in range(rng.randint(1, 6))]
        sizes.append(241 + rng.randint(0, 3000))
        rng.shuffle(sizes)
        payload = rng.randbytes(sum(sizes))
        destination = memoryview(bytearray(len(payload)))
        assert cpu_copysum.copy_sum(mod, destination, cut(payload, sizes)) \
            == xxhash.xxh3_64_intdigest(payload), sizes
        assert destination == payload


def test_any_spoiled_byte_changes_the_digest(mod):
    payload = bytearray(os.urandom(3 * 1024 + 100))  # cut in three below
    sizes = [1000, 1024, 1148]
    assert sum(sizes) == len(payload)
    good = cpu_copysum.copy_sum(mod, memoryview(bytearray(len(payload))), cut(payload, sizes))
    for at in [0, 63, 64, 1023, 1024, 2047, len(payload) - 65, len(payload) - 64,
               len(payload) - 1]:
        payload[at] ^= 0x01
        spoiled = cpu_copysum.copy_sum(mod, memoryview(bytearray(len(payload))),
                                       cut(bytes(payload), sizes))
        payload[at] ^= 0x01
        assert spoiled != good, at


def test_a_batch_that_does_not_fit_copies_nothing(mod):
    # One call per batch: every source's length is summed before the first byte moves.
    destination = bytearray(b"\x07" * 1000)
    sources = [memoryview(b"\x01" * 600), memoryview(b"\x02" * 600)]
    with pytest.raises(ValueError, match="1200 bytes for a 1000-byte destination"):
        mod.copy_all(memoryview(destination), sources)
    assert destination == b"\x07" * 1000
    with pytest.raises(ValueError, match="more than 240"):  # XXH3's short paths are not here
        mod.copy_all(memoryview(destination), [memoryview(b"\x01" * 240)])
    assert destination == b"\x07" * 1000
    with pytest.raises(TypeError):
        mod.copy_all(memoryview(destination), [memoryview(b"\x01" * 300), 5])
    assert destination == b"\x07" * 1000


def test_the_kernel_is_left_alone_where_torch_is_not_imported(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert cpu_copysum.kernel() is None and cpu_copysum.kernel(wait=True) is None


def test_staging_gives_the_same_checksum_with_and_without_the_kernel(mod, monkeypatch):
    sources = cut(os.urandom(30 * 24576 + 5), [24576] * 30 + [5])
    with_kernel = bytearray(30 * 24576 + 5)
    assert shm_sender.stage_many(memoryview(with_kernel), sources) \
        == xxhash.xxh3_64_intdigest(with_kernel)
    monkeypatch.setattr(cpu_copysum, "kernel", lambda wait=False: None)
    without = bytearray(len(with_kernel))
    assert shm_sender.stage_many(memoryview(without), sources) \
        == xxhash.xxh3_64_intdigest(with_kernel) and without == with_kernel


async def test_a_transfer_staged_by_the_kernel_is_verified_and_a_spoiled_byte_resent(
        mod, monkeypatch):
    got = []
    rx = make_receiver("shm", sink=lambda r, layer, b, p: got.append((r, layer, bytes(p))))
    await rx.start()
    tx = make_sender("shm")
    used, real = [], cpu_copysum.copy_sum

    def copy_sum(module, destination, sources):  # the kernel's digest, one byte spoiled after
        digest = real(module, destination, sources)
        used.append(digest)
        if len(used) == 2:
            destination[5000] ^= 0x40
        return digest

    monkeypatch.setattr(cpu_copysum, "copy_sum", copy_sum)
    chunks = [(layer, [1, 2], os.urandom(24576 + layer)) for layer in range(30)]
    try:
        for rid in ("clean", "spoiled"):
            transfer = rx.expect(rid, lease_s=30, token=TOKEN)
            await tx.send_many(rx.address, rid, chunks, token=TOKEN)
            await tx.finish(rx.address, rid, len(chunks), token=TOKEN)
            await transfer.wait()
            assert transfer.chunks_received == 30
        assert len(used) == 3 and used[1] == used[2]  # staged once, then once more
        assert (tx.resent, rx.retried) == (1, 1)
        for rid in ("clean", "spoiled"):
            assert [(c[1], c[2]) for c in got if c[0] == rid] == [(c[0], c[2]) for c in chunks]
    finally:
        await tx.close()
        await rx.close()
