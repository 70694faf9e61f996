"""The cache pool's path on a device, for bench/gpu_check.py.

- Round trip: a batch of blocks exported as the pool stores them (``start_block_export``,
  gathered on the compute stream and copied to pinned memory on the side stream) must be
  the blocks' bytes, and imported into other blocks (``import_blocks``: staged, copied
  and scattered on the side stream) must be visible to the next kernel on the compute
  stream with no host sync in between.
- Stall (CUDA only): a Llama-3-8B-shaped bf16 decode step, alone and with one pool
  write-back batch and one pool fetch batch issued before each step, as a worker between
  steps does; beside it the same work waited for at once (the synchronous path).
On the CPU (``--dry-run``) the round trip runs on tiny shapes through the zero-copy path.
"""

from __future__ import annotations

import time

import torch

BLOCKS = 16  # one write-back batch (services/worker/pool_link.py EXPORT_BATCH)


def _cache(dev: str, tiny: bool, num_blocks: int):
    from services.engine.kv_cache import KVCache

    layers, kvh, d = (2, 2, 16) if tiny else (32, 8, 128)
    dtype = torch.float32 if tiny else torch.bfloat16
    cache = KVCache(layers, num_blocks, 16, kvh, d, dtype, device=dev)
    cache.k.normal_()
    cache.v.normal_()
    return cache


def pool_round_trip(dev: str, tiny: bool) -> bool:
    from services.engine.kv_store import import_blocks, start_block_export

    n = 4 if tiny else BLOCKS
    cache = _cache(dev, tiny, 4 * n)
    src = list(range(n - 1, -1, -1))
    dst = list(range(2 * n, 3 * n))
    started = start_block_export(cache, src)
    blocks = [bytes(b) for b in started.wait()]
    want = torch.stack([cache.k[:, src], cache.v[:, src]], dim=2).transpose(0, 1).cpu()
    same_out = b"".join(blocks) == want.contiguous().view(torch.uint8).numpy().tobytes()
    import_blocks(cache, dst, blocks)
    # No synchronize: the compute stream's next kernel must see the imported blocks.
    same_in = bool(torch.equal(cache.k[:, dst], cache.k[:, src])
                   and torch.equal(cache.v[:, dst], cache.v[:, src]))
    ok = same_out and same_in
    print(f"pool blocks out and in ({n} blocks of {cache.block_nbytes // 1024} KiB, {dev}): "
          f"export {'same' if same_out else 'DIFFERS'}, import "
          f"{'same' if same_in else 'DIFFERS'}  {'pass' if ok else 'FAIL'}")
    cache.close()
    return ok


def pool_stall(build, batch: int = 8, ctx: int = 2048, steps: int = 20) -> None:
    """Decode step time alone and with a pool batch out and in before each step.
    ``build`` is gpu_check's ``llama8b_random``."""
    from services.engine.kv_store import import_blocks, start_block_export

    cfg, model, kv, meta, _ = build(ctx, batch)
    cache = _cache("cuda", False, 4 * BLOCKS)
    fetched = [bytes(b) for b in start_block_export(cache, range(BLOCKS)).wait()]
    ids = torch.randint(0, cfg.vocab_size, (batch,), device="cuda")
    pos = torch.full((batch,), ctx - 1, device="cuda")
    rows = torch.arange(batch, device="cuda")

    def run(pool: str) -> tuple[float, float]:
        """(seconds a step, seconds of it the host spent issuing pool work)."""
        issue = 0.0
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            t1 = time.perf_counter()
            pending = None
            if pool != "none":
                pending = start_block_export(cache, range(BLOCKS, 2 * BLOCKS))
                import_blocks(cache, range(2 * BLOCKS, 3 * BLOCKS), fetched)
                if pool == "waited":
                    pending.wait()
            issue += time.perf_counter() - t1
            model(ids, pos, kv, meta(), rows).argmax(-1).tolist()  # the step's one sync
            if pending is not None:
                pending.wait()  # done by now: the worker waits on another thread
        return (time.perf_counter() - t0) / steps, issue / steps

    run("none")  # warm up
    alone, _ = run("none")
    overlapped, issue = run("async")
    waited, _ = run("waited")
    mib = BLOCKS * cache.block_nbytes / 2 ** 20
    print(f"decode step (8B bf16, batch {batch}, ctx {ctx}) {alone * 1e3:.2f} ms; with "
          f"{mib:.0f} MiB pool out + {mib:.0f} MiB in per step: {overlapped * 1e3:.2f} ms "
          f"(+{overlapped / alone - 1:.1%}, host issue {issue * 1e3:.2f} ms), "
          f"waited at once {waited * 1e3:.2f} ms (+{waited / alone - 1:.1%})")
    cache.close()
