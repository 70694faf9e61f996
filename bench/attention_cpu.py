"""Attention's share of a batched CPU decode step: chunked decode against the gather path.

    python bench/attention_cpu.py [--model smollm2-135m-instruct] [--batch 64]
                                  [--prompt-min 64] [--prompt-max 512] [--pairs 10]
                                  [--threads 1] [--paths gather,chunked]
                                  [--quantization none|int8|w8a16|...]
                                  [--kv-cache-dtype auto|bfloat16|int8]
    python bench/attention_cpu.py --kernel-only [--batch 64] [--threads 1]
                                  [--kv-cache-dtype auto,bfloat16,bfloat16-widen,int8]

One engine, ``--batch`` random prompts prefilled once; then decode steps alternate
between ``TorchAttention("gather")`` (each decode group's context copied out of the
paged cache, the earlier path) and ``TorchAttention("chunked")`` (the cache walked a
chunk of blocks at a time, services/engine/attention_decode.py), old and new in turn
with the order swapped every pair, so a noisy neighbour hits both alike. Per step:
wall time of ``engine.step()``, of the attention calls in it (all layers), the
process's CPU time and the attention calls' CPU time (``cpu_share``: attention's share
of the step's CPU time, the figure a loaded machine leaves readable; at one thread).
Reported: each path's median [min, max] and the new/old ratio per pair, median
[min, max]. Both paths write the same K/V, so the batch's context grows
by one token per step whichever path runs it.

``--kernel-only`` times the compiled paged kernel alone (no model): one layer of the
default model's shape (9 query heads over 3 KV heads of 64) for ``--batch`` random
contexts, over 12 layers' caches so K/V comes from memory, against ``torch.sum`` over
the same bytes (the streaming floor); thread CPU time at one thread, wall time above.

``--kv-cache-dtype`` (EngineConfig.kv_cache_dtype): ``bfloat16`` runs the engine with a
bfloat16 KV cache (half the bytes attention reads), ``int8`` with int8 rows and a scale
each (a bit over a quarter). With ``--kernel-only`` it takes a comma-separated list,
timed in turn round by round (``auto``: float32), each with its own floor over its own
bytes and the float32 floor for comparison; ``bfloat16`` and ``int8`` are the kernel's
default on that cache (bf16 dot products where the CPU has AVX512_BF16, int8 ones where
it has AVX512_VNNI), ``bfloat16-widen`` and ``int8-widen`` its widening (dequantizing)
paths on the same bytes.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.sampling_params import SamplingParams  # noqa: E402
from services.engine.attention import AttentionBackend, TorchAttention  # noqa: E402
from services.engine.config import EngineConfig  # noqa: E402
from services.engine.engine import LLMEngine  # noqa: E402


class Timed(AttentionBackend):
    """Wraps a backend and adds each call's wall time to ``seconds`` and the calling
    thread's CPU time to ``cpu`` (all of the call's CPU time at one torch thread)."""

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner
        self.seconds = 0.0
        self.cpu = 0.0

    def forward(self, q, k, v, k_cache, v_cache, meta):
        c0, t0 = time.thread_time(), time.perf_counter()
        out = self.inner.forward(q, k, v, k_cache, v_cache, meta)
        self.seconds += time.perf_counter() - t0
        self.cpu += time.thread_time() - c0
        return out


def _stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def kernel_only(batch: int, lo: int, hi: int, threads: int, seed: int,
                kv_dtypes: tuple[str, ...] = ("auto",)) -> None:
    from kernels.kv_int8 import quantize_rows, row_width
    from services.engine import attention_paged_cpu

    torch.set_num_threads(threads)
    clock = time.thread_time if threads == 1 else time.perf_counter
    rng = random.Random(seed)
    lens = [rng.randint(lo, hi) for _ in range(batch)]
    bs, kv, heads, dim, layers = 16, 3, 9, 64, 12
    need = [-(-n // bs) for n in lens]
    tables = torch.zeros(batch, max(need), dtype=torch.long)
    first = 0
    for i, k in enumerate(need):
        tables[i, :k] = torch.arange(first, first + k)
        first += k
    f32 = [(torch.randn(first, bs, kv, dim), torch.randn(first, bs, kv, dim))
           for _ in range(layers)]
    names = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16,
             "bfloat16-widen": torch.bfloat16, "int8": torch.int8, "int8-widen": torch.int8}
    made = {torch.float32: lambda: f32,
            torch.bfloat16: lambda: [(k.bfloat16(), v.bfloat16()) for k, v in f32],
            torch.int8: lambda: [(quantize_rows(k), quantize_rows(v)) for k, v in f32]}
    kinds = {t: made[t]() for t in {names[d] for d in kv_dtypes}}
    caches = {d: kinds[names[d]] for d in kv_dtypes}
    ctx = torch.tensor(lens)
    q = torch.randn(batch, heads, dim)
    out = torch.empty_like(q)

    def timed(layer_caches, fn) -> float:
        t0 = clock()
        for kc, vc in layer_caches:
            fn(kc, vc)
        return (clock() - t0) / layers * 1e3

    def kernel(kc, vc, widen=False):
        attention_paged_cpu.paged_decode(q, kc, vc, tables, ctx, out, widen=widen)

    def widened(kc, vc):
        kernel(kc, vc, widen=True)

    def floor(kc, vc):  # int8 rows summed as float32 words: int8 sums widen to int64
        if kc.dtype == torch.int8:
            kc, vc = kc.view(torch.float32), vc.view(torch.float32)
        return kc.sum(), vc.sum()

    for d in kv_dtypes:
        kernel(*caches[d][0])  # build, warm
    best: dict = {}
    for _ in range(5):  # round by round, so a noisy neighbour hits every dtype alike
        for d in kv_dtypes:
            for name, fn in (("kernel", widened if d.endswith("-widen") else kernel),
                             ("floor", floor)):
                t = timed(caches[d], fn)
                best[d, name] = min(best.get((d, name), t), t)
        best["f32", "floor"] = min(best.get(("f32", "floor"), 1e9), timed(f32, floor))
    for d in kv_dtypes:
        mb = 2 * sum(lens) * kv * row_width(dim, names[d]) * torch.empty(
            (), dtype=names[d]).element_size() / 1e6
        print(f"one layer, batch {batch}, K/V {d} ({mb:.1f} MB), {threads} thread(s): "
              f"kernel {best[d, 'kernel']:.2f} ms, torch.sum over the same K/V "
              f"{best[d, 'floor']:.2f} ms, over float32 K/V {best['f32', 'floor']:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-min", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=512)
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quantization", default="none",
                    help="weights as EngineConfig.quantization (attention computes in float32)")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="EngineConfig.kv_cache_dtype (auto, bfloat16, int8); --kernel-only: "
                         "a comma-separated list")
    ap.add_argument("--paths", default="gather,chunked",
                    help="old,new TorchAttention decode paths (gather, chunked, paged)")
    ap.add_argument("--out", default="attention_cpu.json")
    ap.add_argument("--kernel-only", action="store_true",
                    help="time the compiled kernel alone against a streaming floor")
    args = ap.parse_args()
    if args.kernel_only:
        kernel_only(args.batch, args.prompt_min, args.prompt_max, args.threads, args.seed,
                    tuple(args.kv_cache_dtype.split(",")))
        return
    paths = tuple(args.paths.split(","))
    if len(paths) != 2:
        raise SystemExit("--paths takes two paths: old,new")
    if args.pairs < 3:
        raise SystemExit("--pairs must be at least 3: one pair says nothing about the spread")
    rng = random.Random(args.seed)
    lens = [rng.randint(args.prompt_min, args.prompt_max) for _ in range(args.batch)]
    steps = 2 * args.pairs + 2
    block = 16
    engine = LLMEngine(EngineConfig(
        model=args.model, num_threads=args.threads, max_num_seqs=args.batch,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        block_size=block, max_num_batched_tokens=4096,
        num_kv_blocks=sum(-(-(n + steps + 1) // block) for n in lens) + 1))
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for n in lens:
        engine.add_request(None, [rng.randrange(100, 40000) for _ in range(n)], params)
    t0 = time.perf_counter()
    while not all(s.output_token_ids for s in engine.requests.values()):
        engine.step()
    print(f"prefilled {sum(lens)} tokens in {time.perf_counter() - t0:.1f} s", flush=True)
    engine.model.backend = Timed(TorchAttention(paths[1]))
    engine.step()  # warm: the first decode-only step pays one-time costs

    rows: dict[str, list[dict]] = {p: [] for p in paths}
    for i in range(args.pairs):
        for path in (paths if i % 2 == 0 else paths[::-1]):
            timed = engine.model.backend = Timed(TorchAttention(path))
            c0, t0 = time.process_time(), time.perf_counter()
            engine.step()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            rows[path].append({"step_ms": wall * 1e3, "attention_ms": timed.seconds * 1e3,
                               "share": timed.seconds / wall, "cpu_ms": cpu * 1e3,
                               "attention_cpu_ms": timed.cpu * 1e3,
                               "cpu_share": timed.cpu / cpu})
        print(f"pair {i}: " + ", ".join(
            f"{p} step {rows[p][-1]['step_ms']:.0f} ms attention {rows[p][-1]['share']:.0%}"
            f" (of CPU time {rows[p][-1]['cpu_share']:.0%})"
            for p in paths), flush=True)
    summary = {p: {m: _stats([r[m] for r in rows[p]]) for m in rows[p][0]} for p in paths}
    summary[f"{paths[1]}_over_{paths[0]}"] = {
        m: _stats([n[m] / o[m] for o, n in zip(rows[paths[0]], rows[paths[1]], strict=True)])
        for m in ("step_ms", "attention_ms", "cpu_ms", "attention_cpu_ms")}
    for key, table in summary.items():
        print(f"{key}: " + ", ".join(f"{m} {v['median']:.3g} [{v['min']:.3g}, {v['max']:.3g}]"
                                     for m, v in table.items()))
    contexts = [s.num_computed_tokens for s in engine.requests.values()]
    Path(args.out).write_text(json.dumps({
        "args": vars(args), "mean_context": statistics.mean(contexts), "runs": rows,
        "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
