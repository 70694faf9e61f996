"""Offline throughput of the engine against transformers on the same weights and prompts.

    python bench/throughput.py [--num-prompts 64] [--output-len 128] [--model NAME]
                               [--dtype float32] [--threads N] [--repeats 3] [--quick]

Each run of a side is a fresh subprocess (so peak RSS is its own) on identical prompts:
``--num-prompts`` random prompts of 64–512 tokens, greedy, ``--output-len`` new tokens
each, EOS ignored. transformers runs them as one left-padded batch through
``generate``. Prefill is timed separately on one 1,024-token prompt: the engine's
``step`` against one transformers forward pass with ``logits_to_keep=1`` (the LM head
on the last position only, as the engine does). Both sides use the same dtype and the
same number of torch threads (``--threads``, default: the usable cores).

The sides run interleaved through bench/harness.py (pdserve, transformers, pdserve, ...;
one warm-up round, then ``--repeats``), each round on fresh prompts from its own seed;
the ratios are per round, reported as median [min, max]. ``--quick`` is the small
profile ``make bench`` uses (16 prompts of 32 new tokens). Prints the settings beside
the figures and writes ``bench/results/throughput-<dtype>.json`` (and a PNG if
matplotlib is installed).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import (  # noqa: E402
    Metric,
    RunContext,
    Session,
    print_summary,
    settings_line,
    write,
)


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
                                    dtype=args.dtype, num_threads=args.threads,
                                    max_num_batched_tokens=args.max_batched_tokens,
                                    enable_prefix_caching=False,
                                    quantization=args.quantization))
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

    torch.set_num_threads(args.threads)
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
        # The LM head on the last position only, as the engine computes it: a baseline
        # that projects all 1,024 positions onto the vocabulary does work nobody uses.
        model(torch.tensor([long_prompt]), logits_to_keep=1)
        prefill_s = time.perf_counter() - start
    outputs = out[:, width:].tolist()
    return {"generate_s": elapsed, "outputs": outputs, "prefill_s": prefill_s, "load_s": load_s,
            "peak_rss_mib": peak_rss_mib()}


METRICS = [Metric("output_tok_s", "output", "tok/s"),
           Metric("prefill_tok_s", "prefill, 1,024 tokens", "tok/s"),
           Metric("load_s", "load", "s", higher_is_better=False)]
QUICK = {"num_prompts": 16, "output_len": 32}


def child_cmd(side: str, args, seed: int) -> list[str]:
    return [sys.executable, __file__, "--side", side, "--num-prompts", str(args.num_prompts),
            "--output-len", str(args.output_len), "--model", args.model, "--seed", str(seed),
            "--kv-cache-mib", str(args.kv_cache_mib), "--dtype", args.dtype,
            "--max-batched-tokens", str(args.max_batched_tokens),
            "--threads", str(args.threads), "--quantization", args.quantization]


def side_runner(side: str, args, outputs: dict):
    """A harness side: one fresh subprocess; its greedy outputs kept per round."""
    def run(ctx: RunContext) -> dict:
        proc = subprocess.run(child_cmd(side, args, ctx.seed), capture_output=True, text=True,
                              cwd=ROOT, env={**os.environ, "TMPDIR": str(ctx.tmp)})
        if proc.returncode:
            sys.exit(f"{side} failed:\n{proc.stderr[-4000:]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        if not ctx.warmup:
            outputs.setdefault(ctx.round, {})[side] = r.pop("outputs")
        total_out = args.num_prompts * args.output_len
        return {"output_tok_s": total_out / r["generate_s"], "prefill_tok_s": 1024 / r["prefill_s"],
                "load_s": r["load_s"], "generate_s": r["generate_s"],
                "peak_rss_mib": r["peak_rss_mib"], "preemptions": r.get("preemptions", 0)}
    return run


def plot(report: dict, path: Path) -> None:
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
        stats = [report["sides"][n][key] for n in names]
        vals = [s["median"] for s in stats]
        err = [[v - s["min"] for v, s in zip(vals, stats, strict=True)],
               [s["max"] - v for v, s in zip(vals, stats, strict=True)]]
        ax.bar(names, vals, yerr=err, capsize=4, color=["#999999", "#3070b0"])
        ax.set_title(title, fontsize=9)
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    st, ratio = report["settings"], report["ratios"]["pdserve/transformers"]["output_tok_s"]
    fig.suptitle(f"{st['model']} ({st['dtype']}, {st['threads']} threads): "
                 f"{st['num_prompts']} prompts × {st['output_len']} tokens "
                 f"(ratio {ratio['median']:.2f}× [{ratio['min']:.2f}, {ratio['max']:.2f}])",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=None,
                    help="first round's prompt seed (default: drawn at random)")
    ap.add_argument("--kv-cache-mib", type=int, default=3072)
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="compute precision of both sides")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="torch threads of both sides")
    ap.add_argument("--repeats", type=int, default=3, help="measured rounds")
    ap.add_argument("--warmup", type=int, default=1, help="rounds run first and dropped")
    ap.add_argument("--quick", action="store_true",
                    help="small profile: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    ap.add_argument("--quantization", default="none",
                    help="pdserve's weights (none, int8, int4, w8a16, w4a16, w8a8, w4a8); "
                         "transformers stays in --dtype")
    ap.add_argument("--side", choices=["ours", "transformers"])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    if args.side:
        fn = run_ours if args.side == "ours" else run_transformers
        print(json.dumps(fn(args)))
        return
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)

    settings = {"model": args.model, "dtype": args.dtype, "threads": args.threads,
                "quantization": args.quantization,
                "num_prompts": args.num_prompts, "output_len": args.output_len,
                "max_batched_tokens": args.max_batched_tokens,
                "transformers": "one left-padded generate batch; prefill logits_to_keep=1"}
    name = f"throughput-{args.dtype}" + ("" if args.quantization == "none"
                                         else f"-{args.quantization}")
    session = Session(name, settings, seed=args.seed)
    print(settings_line(settings), flush=True)
    outputs: dict[int, dict] = {}
    runs = session.run({"pdserve": side_runner("ours", args, outputs),
                        "transformers": side_runner("transformers", args, outputs)},
                       repeats=args.repeats, warmup=args.warmup)
    identical = [sum(a == b for a, b in zip(o["ours"], o["transformers"], strict=True))
                 for _, o in sorted(outputs.items())]
    report = session.finish(METRICS, runs, extra={
        "identical_outputs": f"{min(identical)}/{args.num_prompts} (worst round)"})
    print_summary(report)
    print(f"identical greedy outputs: {report['identical_outputs']}")
    out = Path(args.out)
    path = write(report, out / f"{name}.json")
    plot(report, out / f"{name}.png")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
