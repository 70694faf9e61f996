"""The test-only fault hook ``PDSERVE_TEST_CORRUPT_KV`` (common/transfer/fault_hook.py)
spoils KV on its way out, and the data plane's checksum catches it: a spoiled first
attempt is asked for again and arrives intact, a chunk spoiled on every attempt fails
its transfer with "checksum mismatch"; nothing spoiled ever reaches the sink, and the
caller's payload is left as it was. Without the variable, nothing is spoiled."""

from __future__ import annotations

import random
import secrets

import pytest

from common.transfer import TransferError, make_receiver, make_sender
from common.transfer.fault_hook import ENV
from tests.kv_sink import Sink

TOKEN = secrets.token_bytes(16)



async def _transfer(backend: str, tmp_path, mode: str | None, monkeypatch):
    """Three chunks of one request under ``mode`` (None: the variable unset); returns
    (sink chunks, the payloads, receiver.retried, the error or None, spoiled count)."""
    mode_file = tmp_path / "corrupt-kv"
    if mode is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        mode_file.write_text(mode)
        monkeypatch.setenv(ENV, str(mode_file))
    sink = Sink()
    rx = make_receiver(backend, sink=sink)
    await rx.start()
    tx = make_sender(backend)
    rng = random.Random(3)
    payloads = [bytearray(rng.randbytes(4096)) for _ in range(3)]
    originals = [bytes(p) for p in payloads]
    error = None
    try:
        transfer = rx.expect("r1", 10.0, TOKEN)
        for layer, p in enumerate(payloads):
            await tx.send(rx.address, "r1", layer, [layer], p, token=TOKEN)
        try:
            await tx.finish(rx.address, "r1", len(payloads), token=TOKEN)
            await transfer.wait()
        except TransferError as exc:
            error = exc.reason
        spoiled = tx._corrupt.spoiled if tx._corrupt is not None else 0
        assert [bytes(p) for p in payloads] == originals  # the caller's bytes untouched
        return sink.chunks, originals, rx.retried, error, spoiled
    finally:
        await tx.close()
        await rx.close()


@pytest.mark.parametrize("backend", ["tcp", "shm"])
async def test_first_attempts_spoiled_are_resent_and_arrive_intact(backend, tmp_path,
                                                                   monkeypatch):
    chunks, originals, retried, error, spoiled = await _transfer(backend, tmp_path, "first",
                                                                 monkeypatch)
    assert error is None
    assert spoiled == 3 and retried == 3
    assert sorted((c[1], c[3]) for c in chunks) == list(enumerate(originals))


@pytest.mark.parametrize("backend", ["tcp", "shm"])
async def test_every_attempt_spoiled_fails_the_transfer_on_its_checksum(backend, tmp_path,
                                                                       monkeypatch):
    chunks, _, retried, error, spoiled = await _transfer(backend, tmp_path, "all",
                                                         monkeypatch)
    assert error is not None and "checksum mismatch" in error, error
    assert chunks == []  # nothing spoiled was handed over
    assert retried >= 1 and spoiled >= 2


async def test_unset_or_off_spoils_nothing(tmp_path, monkeypatch):
    for mode in (None, "off"):
        chunks, originals, retried, error, spoiled = await _transfer("tcp", tmp_path, mode,
                                                                     monkeypatch)
        assert (error, retried, spoiled) == (None, 0, 0)
        assert sorted((c[1], c[3]) for c in chunks) == list(enumerate(originals))
