"""KV streamed over the data plane from a tensor-parallel engine into a TP=1 engine,
against TP=1 -> TP=1.

A ``--prompt-len`` prefill (2,048 with ``--prompt-len 2048``) whose KV streams layer by
layer over a real data-plane connection (``--backend`` tcp, shm or ucx, on loopback) into a
TP=1 engine's reserved blocks, as a prefill worker sends it, from three sources:

    tp1       a TP=1 engine: rank 0 sends all heads
    tpN       a TP=``--tp`` engine on the direct path: every rank sends its own KV
              heads' slice (``services/engine/tp_direct.py``)
    tpN-gath  the same engine on the gather path: rank 0 gathers every rank's slice and
              sends all heads (what a TP decode worker or the pool gets)

Per source: bytes received, the transfer time (what rank 0's engine thread spends
handing the KV over inside the step, its gathers included, plus the tail from the
step's end until the receiver has every head of every layer), and the whole prefill;
then the ratio to tp1 per round (median [min, max]); sources alternate within a round,
after ``--warmup`` rounds that are not counted (connections, first-step costs).
The default model's 9 query and 3 KV heads split 3 ways, so ``--tp`` defaults to 3.

    nice -n 10 python -m bench.tp_transfer --prompt-len 2048 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import threading
import time

from common.sampling_params import SamplingParams
from common.transfer import MultiSender
from common.transfer.backends import backend_receiver
from common.transfer.table import TransferTable
from common.transfer.wire import WHOLE
from services.engine.config import EngineConfig
from services.engine.core import EngineHooks
from services.engine.engine import LLMEngine
from services.engine.tp_direct import Route


class Plane:
    """A receiver feeding ``dst``'s KV and a sender, on an event loop thread."""

    def __init__(self, kind: str, dst: LLMEngine) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        store = dst.kv_store
        table = TransferTable(
            lambda rid, layer, ids, payload: store.import_layer_bytes(layer, ids, payload),
            lambda rid, layer, ids, heads, payload: store.import_layer_slice_bytes(
                layer, ids, heads, payload))
        self.rx = backend_receiver(kind, "127.0.0.1", 0, table=table)
        self.run(self.rx.start())
        self.sender = self.run(self._sender())

    async def _sender(self) -> MultiSender:
        return MultiSender()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def post(self, coro) -> None:
        asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def expect(self, rid: str, token: bytes):
        return self.rx.expect(rid, 60, token)


def transfer_round(name: str, src: LLMEngine, dst: LLMEngine, plane: Plane,
                   prompt: list[int], moved: dict, direct: bool) -> tuple[int, float, float]:
    """One prefill in ``src`` streamed into ``dst``: (bytes, transfer s, total s)."""
    rid = f"{name}-{len(moved.setdefault('rounds', []))}"
    moved["rounds"].append(rid)
    slots = dst.reserve_remote_prefill(rid, prompt, SamplingParams(max_tokens=1))
    token = secrets.token_bytes(16)
    transfer = plane.run(plane.expect(rid, token))
    store = src.kv_store
    ranks = store.sending_ranks if direct else 1
    moved.update(rid=rid, token=token, seconds=0.0, blocks=slots.block_ids, direct=direct)
    if direct:
        store.route(rid, Route(plane.rx.address, token, 0, tuple(slots.block_ids)))
    gathered = getattr(store, "handoff_seconds", 0.0)
    start = time.perf_counter()
    src.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=1),
                    hold_blocks=True)
    while src.has_unfinished_requests():
        src.step()
    stepped = time.perf_counter()
    plane.run(plane.sender.finish(plane.rx.address, rid, src.model_config.num_layers * ranks,
                                  token=token))
    plane.run(transfer.wait())
    done = time.perf_counter()
    # A TP engine's gathers of each layer's slices run before its hook: they count too.
    inside = moved["seconds"] + getattr(store, "handoff_seconds", 0.0) - gathered
    if direct:
        store.unroute(rid)
    src.release(rid)
    dst.abort(rid)
    return transfer.bytes_received, inside + done - stepped, done - start


def transfer(args, base: dict) -> None:
    moved: dict = {}
    dst = LLMEngine(EngineConfig(**base))
    plane = Plane(args.backend, dst)

    def hook_for(get_src):
        def on_layer(layer, seqs):
            start = time.perf_counter()
            store = get_src().kv_store
            blocks = seqs[0].block_table[:len(moved["blocks"])]
            if moved["direct"]:
                payload, heads = store.export_local_layer(layer, blocks), \
                    tuple(store.heads_by_rank[0])
            else:
                payload, heads = store.export_layer_bytes(layer, blocks), WHOLE
            plane.post(plane.sender.send(plane.rx.address, moved["rid"], layer,
                                         moved["blocks"], payload, token=moved["token"],
                                         heads=heads))
            moved["seconds"] += time.perf_counter() - start
        return on_layer

    one = LLMEngine(EngineConfig(**base), hooks=EngineHooks(on_layer=hook_for(lambda: one)))
    tp = LLMEngine(EngineConfig(**base, tensor_parallel_size=args.tp),
                   hooks=EngineHooks(on_layer=hook_for(lambda: tp)))
    sources = (("tp1", one, False), (f"tp{args.tp}", tp, True),
               (f"tp{args.tp}-gath", tp, False))
    try:
        results: dict[str, list] = {name: [] for name, _, _ in sources}
        for r in range(-args.warmup, args.rounds):  # warm-up rounds (r < 0) not counted
            prompt = [(13 * r + 7 * j) % 1000 + 10 for j in range(args.prompt_len)]
            for name, src, direct in sources:
                row = transfer_round(name, src, dst, plane, prompt, moved, direct)
                if r >= 0:
                    results[name].append(row)
        for name, rows in results.items():
            print(f"{name} -> tp1 over {args.backend}: {rows[0][0]} bytes, transfer "
                  f"{1e3 * statistics.median(r[1] for r in rows):.1f} ms, prefill total "
                  f"{1e3 * statistics.median(r[2] for r in rows):.1f} ms")
        base_rows = results["tp1"]
        for name, rows in list(results.items())[1:]:
            ratios = sorted(t[1] / o[1] for o, t in zip(base_rows, rows, strict=True))
            print(f"{name}->tp1 / tp1->tp1 transfer time, per round: "
                  f"{statistics.median(ratios):.2f}x [{ratios[0]:.2f}, {ratios[-1]:.2f}] "
                  f"over {len(ratios)} interleaved rounds")
    finally:
        tp.close()
        plane.run(plane.sender.close())
        plane.run(plane.rx.close())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="rounds run first, not counted")
    ap.add_argument("--backend", choices=("tcp", "shm", "ucx"), default="tcp")
    args = ap.parse_args()
    # No prefix caching: every source computes the round's prompt in full.
    base = dict(model=args.model, dtype="float32", max_num_seqs=1, kv_cache_bytes=256 << 20,
                max_num_batched_tokens=max(2048, args.prompt_len), enable_prefix_caching=False)
    transfer(args, base)


if __name__ == "__main__":
    main()
