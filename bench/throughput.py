"""Offline throughput of the engine against transformers on the same weights and prompts.

    python bench/throughput.py [--num-prompts 64] [--output-len 128] [--model NAME]

Each side runs in its own subprocess (so peak RSS is its own) on identical prompts:
``--num-prompts`` random prompts of 64–512 tokens, greedy, ``--output-len`` new tokens
each, EOS ignored. transformers runs them as one left-padded batch through
``generate``. Prefill is timed separately on one 1,024-token prompt (the engine's
``step`` against one transformers forward pass). Prints each figure, the ratios, and
writes JSON (and a PNG if matplotlib is installed) under ``bench/results/``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def make_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(64, 512))] for _ in range(n)]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_ours(args) -> dict:
    from common.sampling_params import SamplingParams
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine

    start = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.model, kv_cache_bytes=args.kv_cache_mib << 20,
                                    dtype=args.dtype,
                                    max_num_batched_tokens=args.max_batched_tokens,
                                    enable_prefix_caching=False))
    load_s = time.perf_counter() - start
    prompts = make_prompts(args.num_prompts, engine.model_config.vocab_size, args.seed)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    engine.generate([prompts[0][:32]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    start = time.perf_counter()
    done = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    outputs = [c.token_ids for c in done]

    long_prompt = make_prompts(1, engine.model_config.vocab_size, args.seed + 1)[0]
    long_prompt = (long_prompt * 8)[:1024]
    engine.add_request("prefill", long_prompt, SamplingParams(temperature=0, max_tokens=1))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    prefill_s = time.perf_counter() - start
    return {"generate_s": elapsed, "outputs": outputs, "prefill_s": prefill_s, "load_s": load_s,
            "preemptions": engine.scheduler.num_preemptions, "peak_rss_mib": peak_rss_mib()}


def run_transformers(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from services.engine.weights import resolve_model

    dtype = getattr(torch, args.dtype)
    start = time.perf_counter()
    path = Path(resolve_model(args.model))
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                     dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    load_s = time.perf_counter() - start
    prompts = make_prompts(args.num_prompts, model.config.vocab_size, args.seed)
    width = max(len(p) for p in prompts)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        model.generate(ids[:1, -32:], attention_mask=mask[:1, -32:], max_new_tokens=4,
                       do_sample=False)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=args.output_len,
                             min_new_tokens=args.output_len, do_sample=False,
                             pad_token_id=pad)
        elapsed = time.perf_counter() - start
        long_prompt = make_prompts(1, model.config.vocab_size, args.seed + 1)[0]
        long_prompt = (long_prompt * 8)[:1024]
        start = time.perf_counter()
        model(torch.tensor([long_prompt]))
        prefill_s = time.perf_counter() - start
    outputs = out[:, width:].tolist()
    return {"generate_s": elapsed, "outputs": outputs, "prefill_s": prefill_s, "load_s": load_s,
            "peak_rss_mib": peak_rss_mib()}


def run_side(side: str, args) -> dict:
    cmd = [sys.executable, __file__, "--side", side, "--num-prompts", str(args.num_prompts),
           "--output-len", str(args.output_len), "--model", args.model, "--seed", str(args.seed),
           "--kv-cache-mib", str(args.kv_cache_mib), "--dtype", args.dtype,
           "--max-batched-tokens", str(args.max_batched_tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        sys.exit(f"{side} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    names = ["transformers", "pdserve"]
    for ax, key, title in ((axes[0], "output_tok_s", "output tokens/s"),
                           (axes[1], "prefill_tok_s", "prefill tokens/s (1,024-token prompt)")):
        vals = [result["transformers"][key], result["pdserve"][key]]
        ax.bar(names, vals, color=["#999999", "#3070b0"])
        ax.set_title(title, fontsize=9)
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    fig.suptitle(f"{result['model']} ({result['dtype']}): {result['num_prompts']} prompts × "
                 f"{result['output_len']} tokens (ratio {result['output_ratio']:.2f}×)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-mib", type=int, default=3072)
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="compute precision of both sides")
    ap.add_argument("--side", choices=["ours", "transformers"])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    if args.side:
        fn = run_ours if args.side == "ours" else run_transformers
        print(json.dumps(fn(args)))
        return

    total_out = args.num_prompts * args.output_len
    result = {"model": args.model, "dtype": args.dtype, "num_prompts": args.num_prompts,
              "output_len": args.output_len}
    for name, side in (("pdserve", "ours"), ("transformers", "transformers")):
        r = run_side(side, args)
        result[name] = {"generate_s": r["generate_s"],
                        "output_tok_s": total_out / r["generate_s"],
                        "prefill_tok_s": 1024 / r["prefill_s"],
                        "load_s": r["load_s"], "peak_rss_mib": r["peak_rss_mib"]}
        result[name + "_outputs"] = r["outputs"]
        if "preemptions" in r:
            result[name]["preemptions"] = r["preemptions"]
    ours, theirs = result["pdserve"], result["transformers"]
    result["output_ratio"] = ours["output_tok_s"] / theirs["output_tok_s"]
    result["prefill_ratio"] = ours["prefill_tok_s"] / theirs["prefill_tok_s"]
    same = sum(a == b for a, b in zip(result.pop("pdserve_outputs"),
                                      result.pop("transformers_outputs"), strict=True))
    result["identical_outputs"] = f"{same}/{args.num_prompts}"

    for name in ("pdserve", "transformers"):
        r = result[name]
        print(f"{name:>13}: {r['output_tok_s']:8.1f} output tok/s  "
              f"{r['prefill_tok_s']:8.1f} prefill tok/s  load {r['load_s']:.1f} s  "
              f"peak RSS {r['peak_rss_mib']:.0f} MiB")
    print(f"output throughput ratio: {result['output_ratio']:.2f}x   "
          f"prefill ratio: {result['prefill_ratio']:.2f}x   "
          f"identical greedy outputs: {result['identical_outputs']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"throughput-{args.dtype}.json").write_text(json.dumps(result, indent=2))
    plot(result, out / f"throughput-{args.dtype}.png")


if __name__ == "__main__":
    main()
