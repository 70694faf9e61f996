"""The backend's receiving process of bench/transfer.py (``--serve backend KIND ...``):
a receiver of that backend landing every transfer in one destination buffer, as a decode
worker lands KV in its cache, and saying on stdout once a round that all of it landed.
"""

from __future__ import annotations

import contextlib
import secrets
import time

LAYERS = 30  # the default model's


class Landing:
    """The receiving side's sink: each layer's bytes land at ``layer x size`` of one
    destination buffer (pre-faulted, as a worker's KV cache is), where a backend that copies
    them out of somewhere (shm) puts them, a batch's at once (one view a layer), or, called
    with them, it copies them there; tcp's read out of the socket is its landing."""

    def __init__(self, land: bool) -> None:
        self.land, self.buffer = land, memoryview(bytearray())

    def __call__(self, rid: str, layer: int, blocks: list[int], payload: memoryview) -> None:
        if self.land:
            self.landing_many(rid, [layer], [blocks], [payload.nbytes])[0][:] = payload

    def landing_many(self, rid: str, layers: list[int], blocks: list[list[int]],
                     sizes: list[int]) -> list | None:
        if not self.land:
            return None
        if (max(layers) + 1) * max(sizes) > len(self.buffer):  # in the warm-up: zeroed,
            self.buffer = memoryview(bytearray(max(max(layers) + 1, LAYERS) * max(sizes)))
        buf = self.buffer  # so faulted in
        return [buf[at * n : (at + 1) * n] for at, n in zip(layers, sizes, strict=True)]

    def landed_many(self, rid: str, layers: list[int], blocks: list[list[int]],
                    sizes: list[int]) -> None:
        pass


async def serve_backend(kind: str, count: str, per_round: str = "1") -> None:
    from common.transfer import make_receiver

    with contextlib.suppress(ImportError):  # a receiver is a model worker, torch loaded:
        import torch  # noqa: F401  the shm receiver lands and checks with its kernel

        from kernels import cpu_copysum
        cpu_copysum.kernel(wait=True)
    rx = make_receiver(kind, sink=Landing(kind == "shm"))
    await rx.start()
    # One token a transfer, drawn here and told to the sender, as a decode worker does.
    tokens = [secrets.token_bytes(16) for _ in range(int(count))]
    transfers = [rx.expect(f"r{i}", lease_s=600, token=t) for i, t in enumerate(tokens)]
    print(f"addr {rx.address}", flush=True)
    print("tokens " + ",".join(t.hex() for t in tokens), flush=True)
    # A line a round, not a transfer (a write here, a wake-up and a read there): the
    # backend's word that a transfer landed is its verdict; the limit's line is its only one.
    every = int(per_round)
    for i, transfer in enumerate(transfers):
        await transfer.wait()
        if (i + 1) % every == 0 or i + 1 == len(transfers):
            print(f"done r{i} {time.process_time()}", flush=True)
    await rx.close()
