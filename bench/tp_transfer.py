"""KV streamed from a tensor-parallel engine into a TP=1 engine, against TP=1 -> TP=1.

A ``--prompt-len`` prefill (2,048 with ``--prompt-len 2048``) whose KV streams layer by
layer into a TP=1 engine's reserved blocks, as a prefill worker's hook does (export, then
import: the data plane between them is left out), from a TP=``--tp`` engine against from
a TP=1 engine. Reported per source: bytes moved, seconds rank 0 spends handing the KV
over (export plus import, and for TP the gathers of every rank's slices, which run
before the hook: ``ShardedKVStore.handoff_seconds``), and the whole prefill; and the
ratio of the two per round (median [min, max]). The default model's 9 query and 3 KV
heads split 3 ways, so ``--tp`` defaults to 3.

    nice -n 10 python -m bench.tp_transfer --prompt-len 2048 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time

from common.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine


def transfer_round(src: LLMEngine, dst: LLMEngine, prompt: list[int],
                   moved: dict) -> tuple[int, float, float]:
    """One prefill in ``src`` streamed into ``dst``: (bytes, export+import s, total s)."""
    slots = dst.reserve_remote_prefill("d", prompt, SamplingParams(max_tokens=1))
    moved.update(bytes=0, seconds=0.0, blocks=slots.block_ids)
    gathered = getattr(src.kv_store, "handoff_seconds", 0.0)
    start = time.perf_counter()
    rid = src.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=1),
                          hold_blocks=True)
    while src.has_unfinished_requests():
        src.step()
    total = time.perf_counter() - start
    # A TP engine's gathers of each layer's slices run before its hook: they count too.
    moved["seconds"] += getattr(src.kv_store, "handoff_seconds", 0.0) - gathered
    src.release(rid)
    dst.abort("d")
    return moved["bytes"], moved["seconds"], total


def transfer(args, base: dict) -> None:
    from services.engine.core import EngineHooks

    moved: dict = {}
    dst = LLMEngine(EngineConfig(**base))

    def hook_for(get_src):
        def on_layer(layer, seqs):
            start = time.perf_counter()
            src = get_src()
            payload = src.kv_store.export_layer_bytes(
                layer, seqs[0].block_table[:len(moved["blocks"])])
            dst.kv_store.import_layer_bytes(layer, moved["blocks"], payload)
            moved["seconds"] += time.perf_counter() - start
            moved["bytes"] += payload.nbytes
        return on_layer

    one = LLMEngine(EngineConfig(**base), hooks=EngineHooks(on_layer=hook_for(lambda: one)))
    tp = LLMEngine(EngineConfig(**base, tensor_parallel_size=args.tp),
                   hooks=EngineHooks(on_layer=hook_for(lambda: tp)))
    try:
        results: dict[str, list] = {"tp1": [], f"tp{args.tp}": []}
        for r in range(args.rounds):
            prompt = [(13 * r + 7 * j) % 1000 + 10 for j in range(args.prompt_len)]
            for name, src in (("tp1", one), (f"tp{args.tp}", tp)):
                results[name].append(transfer_round(src, dst, prompt, moved))
        for name, rows in results.items():
            print(f"{name} -> tp1: {rows[0][0]} bytes, export+import "
                  f"{1e3 * statistics.median(r[1] for r in rows):.1f} ms, prefill total "
                  f"{1e3 * statistics.median(r[2] for r in rows):.1f} ms")
        one_rows, tp_rows = results.values()
        ratios = sorted(t[1] / o[1] for o, t in zip(one_rows, tp_rows, strict=True))
        print(f"tp{args.tp}->tp1 / tp1->tp1 transfer time, per round: "
              f"{statistics.median(ratios):.2f}x [{ratios[0]:.2f}, {ratios[-1]:.2f}] "
              f"over {len(ratios)} interleaved rounds")
    finally:
        tp.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tp", type=int, default=3)
    args = ap.parse_args()
    base = dict(model=args.model, dtype="float32", max_num_seqs=1, kv_cache_bytes=256 << 20,
                max_num_batched_tokens=max(2048, args.prompt_len))
    transfer(args, base)


if __name__ == "__main__":
    main()
