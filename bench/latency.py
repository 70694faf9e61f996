"""Single-request latency of the engine on the CPU, against transformers and llama.cpp.

    python bench/latency.py [--model smollm2-135m-instruct] [--runs 3] [--threads 2]
                            [--decode-tokens 64] [--llama-bench PATH [--llama-f32-gguf PATH]]
                            [--quantization none|int8|int4|w8a16|w4a16|w8a8|w4a8]
                            [--out latency.json]

Three figures per side, all batch 1 and greedy:

* ``decode_tok_s``: tokens per second of the steps after the first (prompt of 16 tokens);
* ``ttft_s``: seconds from a 100-token prompt to its first token;
* ``prefill_tok_s``: 1,024 prompt tokens over the seconds to their first token;

and each Python side's peak RSS (``rss_mib``, in the JSON). ``--quantization int8``
(or ``int4``) runs pdserve with quantized weights (services/engine/weights/quantize.py).

Sides: ``pdserve`` (LLMEngine), ``transformers`` (the same weights in float32, prefill
with ``logits_to_keep=1`` so neither side computes logits it throws away) and, when
``--llama-bench`` names the binary, ``llama.cpp`` on the same GGUF (its ``pp100`` gives
TTFT, ``pp1024`` prefill, ``tg`` decode), and ``llama.cpp-f32`` on ``--llama-f32-gguf``
(the same weights as F32, made with ``llama-quantize --allow-requantize IN OUT F32``).
Every run is a fresh process; the sides
alternate (A, B, C, A, B, C, ...; bench/harness.py, ``--warmup`` rounds first and
dropped) so that a noisy neighbour hits all of them alike; the ratios are taken per
round and reported as median [min, max]. The JSON at ``--out`` is the harness's report
(machine, load, settings, spreads) with the summary below as ``summary``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import Metric, Session, print_summary, write  # noqa: E402

HARNESS_METRICS = [Metric("decode_tok_s", "decode", "tok/s"),
                   Metric("ttft_s", "TTFT, 100-token prompt", "s", higher_is_better=False),
                   Metric("prefill_tok_s", "prefill, 1,024 tokens", "tok/s")]
METRICS = ("decode_tok_s", "ttft_s", "prefill_tok_s")
TTFT_LEN, PREFILL_LEN, DECODE_PROMPT_LEN = 100, 1024, 16


def _prompts(seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]
    return {"warm": draw(8), "ttft": draw(TTFT_LEN), "prefill": draw(PREFILL_LEN),
            "decode": draw(DECODE_PROMPT_LEN)}


def _rss_mib() -> float:
    """This process's peak resident memory (VmHWM), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child_pdserve(model: str, threads: int, n: int, seed: int, quantization: str) -> dict:
    from common.sampling_params import SamplingParams
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=model, num_threads=threads, quantization=quantization,
                                    kv_cache_bytes=256 << 20, max_num_seqs=4))
    p = _prompts(seed)

    def first_token(prompt: list[int], max_tokens: int) -> float:
        engine.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                        ignore_eos=True))
        t0 = time.perf_counter()
        engine.step()
        return time.perf_counter() - t0

    first_token(p["warm"], 1)
    ttft = first_token(p["ttft"], 1)
    prefill = first_token(p["prefill"], 1)
    first_token(p["decode"], n + 1)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    decode = time.perf_counter() - t0
    return {"decode_tok_s": n / decode, "ttft_s": ttft, "prefill_tok_s": PREFILL_LEN / prefill,
            "rss_mib": _rss_mib()}


def child_transformers(model: str, threads: int, n: int, seed: int, quantization: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from services.engine.weights import resolve_model

    torch.set_num_threads(threads)
    path = Path(resolve_model(model))
    kw = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    hf = AutoModelForCausalLM.from_pretrained(path.parent if kw else path, dtype=torch.float32,
                                              **kw).eval()
    p = _prompts(seed)
    # transformers 5 renamed past_key_values to cache.
    cache_arg = "cache" if "cache" in inspect.signature(hf.forward).parameters \
        else "past_key_values"

    @torch.inference_mode()
    def first_token(prompt: list[int]):
        t0 = time.perf_counter()
        out = hf(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
        token = int(out.logits[0, -1].argmax())
        return time.perf_counter() - t0, _cache_of(out), token

    first_token(p["warm"])
    ttft = first_token(p["ttft"])[0]
    prefill = first_token(p["prefill"])[0]
    _, cache, token = first_token(p["decode"])
    t0 = time.perf_counter()
    with torch.inference_mode():
        for _ in range(n):
            out = hf(torch.tensor([[token]]), use_cache=True, **{cache_arg: cache})
            cache, token = _cache_of(out), int(out.logits[0, -1].argmax())
    decode = time.perf_counter() - t0
    return {"decode_tok_s": n / decode, "ttft_s": ttft, "prefill_tok_s": PREFILL_LEN / prefill,
            "rss_mib": _rss_mib()}


def _cache_of(out):
    return out.cache if hasattr(out, "cache") else out.past_key_values


def run_llama_bench(binary: str, gguf: str, threads: int, n: int) -> dict:
    out = subprocess.run([binary, "-m", gguf, "-t", str(threads), "-r", "1",
                          "-p", f"{TTFT_LEN},{PREFILL_LEN}", "-n", str(n), "-o", "json"],
                         check=True, capture_output=True, text=True).stdout
    rows = json.loads(out)
    speed = {(r["n_prompt"], r["n_gen"]): r["avg_ts"] for r in rows}
    return {"decode_tok_s": speed[(0, n)], "ttft_s": TTFT_LEN / speed[(TTFT_LEN, 0)],
            "prefill_tok_s": speed[(PREFILL_LEN, 0)]}


def run_side(side: str, args: argparse.Namespace, seed: int) -> dict:
    if side.startswith("llama.cpp"):
        from services.engine.weights import resolve_model

        gguf = args.llama_f32_gguf if side == "llama.cpp-f32" else resolve_model(args.model)
        return run_llama_bench(args.llama_bench, gguf, args.threads, args.decode_tokens)
    cmd = [sys.executable, __file__, "--child", side, "--model", args.model,
           "--threads", str(args.threads), "--decode-tokens", str(args.decode_tokens),
           "--seed", str(seed), "--quantization", args.quantization]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def summarize(runs: dict[str, list[dict]]) -> dict:
    summary: dict = {}
    for side, rows in runs.items():
        summary[side] = {m: {"median": statistics.median(r[m] for r in rows),
                             "min": min(r[m] for r in rows), "max": max(r[m] for r in rows)}
                         for m in METRICS}
    for other in (s for s in runs if s != "pdserve"):
        ratios = {}
        for m in METRICS:
            # Per round, pdserve over the other side (ttft: other over pdserve), so > 1
            # always means pdserve is faster.
            per = [(a[m] / b[m]) if m != "ttft_s" else (b[m] / a[m])
                   for a, b in zip(runs["pdserve"], runs[other], strict=True)]
            ratios[m] = {"median": statistics.median(per), "min": min(per), "max": max(per)}
        summary[f"pdserve_vs_{other}"] = ratios
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--llama-bench", default=None, help="path of llama.cpp's llama-bench")
    ap.add_argument("--llama-f32-gguf", default=None,
                    help="the model as an F32 GGUF: a llama.cpp-f32 side (needs --llama-bench)")
    ap.add_argument("--out", default="latency.json")
    ap.add_argument("--seed", type=int, default=None, help="default: drawn at random")
    ap.add_argument("--warmup", type=int, default=1, help="rounds run first and dropped")
    ap.add_argument("--quantization", default="none",
                    help="pdserve's weights: none, int8, int4, w8a16, w4a16, w8a8 or w4a8")
    ap.add_argument("--child", choices=("pdserve", "transformers"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        fn = child_pdserve if args.child == "pdserve" else child_transformers
        print(json.dumps(fn(args.model, args.threads, args.decode_tokens, args.seed,
                             args.quantization)))
        return
    if args.runs < 3:
        raise SystemExit("--runs must be at least 3: one run says nothing about the spread")
    sides = ["pdserve", "transformers"] + (["llama.cpp"] if args.llama_bench else [])
    if args.llama_f32_gguf:
        if not args.llama_bench:
            raise SystemExit("--llama-f32-gguf needs --llama-bench")
        sides.append("llama.cpp-f32")
    settings = {"model": args.model, "threads": args.threads, "dtype": "float32",
                "quantization": args.quantization, "decode_tokens": args.decode_tokens,
                "batch": 1, "transformers": "prefill logits_to_keep=1"}
    session = Session("latency", settings, seed=args.seed)

    def side(name: str):
        return lambda ctx: run_side(name, args, ctx.seed)
    runs = session.run({s: side(s) for s in sides}, repeats=args.runs, warmup=args.warmup)
    summary = summarize(runs)
    report = session.finish(HARNESS_METRICS, runs, extra={"summary": summary})
    print_summary(report)
    write(report, Path(args.out))


if __name__ == "__main__":
    main()
