"""The engine's GPU checks: kernels against their references, then end-to-end figures.

    python bench/gpu_check.py --dry-run     # tiny shapes on the CPU (Triton interpreter)
    python bench/gpu_check.py               # on CUDA: kernels at real shapes + the checks

Kernels: each Triton kernel against its torch reference (max abs error, pass/fail).
On CUDA, then:
- the default model's greedy tokens from the engine against transformers (float32);
- a Llama-3-8B-shaped random bfloat16 decode step against the HBM roofline
  (weights + KV read once, at ``--hbm-gbs``);
- batch-64 decode throughput against transformers ``generate``;
- a 4,096-token prefill against the measured bfloat16 matmul peak.
- decode steps replayed from CUDA graphs give the eager steps' tokens;
- the cache pool's blocks out and in (bench/gpu_pool_check.py): the same bytes, and the
  decode step time added by a pool batch each step.
``--dry-run`` also runs a tiny random model through the engine's padded decode path
(the graphs' inputs, run eagerly) against the torch backend.
Exits non-zero if any kernel check fails or the tokens differ.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_pool_check import pool_round_trip, pool_stall  # noqa: E402


def kernel_checks(dev: str, tiny: bool) -> list[tuple[str, float, bool]]:
    from kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref
    from kernels.kv_pack import kv_pack, kv_pack_ref
    from kernels.kv_write import write_kv, write_kv_ref
    from kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
    from kernels.rms_norm import rms_norm, rms_norm_ref
    from kernels.rotary import rotary_embedding, rotary_embedding_ref

    # bfloat16 on CUDA as served; float32 in the interpreter (its bfloat16 is wrong).
    dtype, tol = (torch.float32, 1e-4) if tiny else (torch.bfloat16, 3e-2)
    heads, kvh, d, bs = (8, 2, 64, 16) if tiny else (32, 8, 128, 16)
    lens = [1, 17, 70] if tiny else [1, 300, 4096, 16000]
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dev, dtype)

    nblk = sum(-(-n // bs) for n in lens) + 1
    kc, vc = rnd(nblk, bs, kvh, d), rnd(nblk, bs, kvh, d)
    perm, rows = torch.randperm(nblk, generator=g).tolist(), []
    width = max(-(-n // bs) for n in lens)
    for n in lens:
        need = -(-n // bs)
        rows.append(perm[:need] + [0] * (width - need))
        perm = perm[need:]
    tables = torch.tensor(rows, device=dev)
    ctx = torch.tensor(lens, device=dev)
    out = []

    def check(name, got, want):
        err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
        out.append((name, err, err <= tol))

    q = rnd(len(lens), heads, d)
    args = (q, kc, vc, tables, ctx, d ** -0.5)
    check("paged decode attention", paged_decode_attention(*args),
          paged_decode_attention_ref(*args))
    qlens = [min(n, 40 if tiny else 2048) for n in lens]
    qs = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), device=dev)
    args = (rnd(sum(qlens), heads, d), kc, vc, tables, qs, ctx, max(qlens), d ** -0.5)
    check("paged prefill attention", paged_prefill_attention(*args),
          paged_prefill_attention_ref(*args))
    k, v = rnd(5, kvh, d), rnd(5, kvh, d)
    slots = torch.tensor([0, 3, -1, 2 * bs + 1, bs], device=dev)
    kw, vw, kr, vr = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    write_kv(k, v, kw, vw, slots)
    write_kv_ref(k, v, kr, vr, slots)
    check("kv write", torch.stack([kw, vw]), torch.stack([kr, vr]))
    ids = torch.tensor([3, 0, 2], device=dev)
    check("kv pack", kv_pack(kc, vc, ids), kv_pack_ref(kc, vc, ids))
    x, w, r = rnd(7, 96 if tiny else 4096), rnd(96 if tiny else 4096), rnd(7, 96 if tiny else 4096)
    check("rms norm + residual", rms_norm(x, w, 1e-5, r)[0], rms_norm_ref(x, w, 1e-5, r)[0])
    freqs = torch.outer(torch.arange(512.0), 1.0 / 500000 ** (torch.arange(0, d, 2) / d))
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(dev), emb.sin().to(dev)
    pos = torch.tensor([0, 5, 511], device=dev)
    qr, kr_ = rnd(3, heads, d), rnd(3, kvh, d)
    got, want = rotary_embedding(pos, qr, kr_, cos, sin), rotary_embedding_ref(pos, qr, kr_,
                                                                                cos, sin)
    check("rotary", torch.cat([got[0], got[1]], 1), torch.cat([want[0], want[1]], 1))
    return out


def timed(fn, repeat: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeat


def token_exactness(model: str, n_new: int) -> bool:
    from transformers import AutoModelForCausalLM

    from common.sampling_params import SamplingParams
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=model, device="cuda", dtype="float32"))
    prompts = [[1] + list(range(100, 100 + n)) for n in (5, 37, 200)]
    ours = [c.token_ids for c in engine.generate(
        prompts, SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True))]
    hf = AutoModelForCausalLM.from_pretrained(engine.weights.tokenizer_dir,
                                              dtype=torch.float32).cuda().eval()
    theirs = [hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=n_new,
                          min_new_tokens=n_new, do_sample=False)[0, len(p):].tolist()
              for p in prompts]
    print(f"default model greedy tokens vs transformers: {'same' if ours == theirs else 'DIFFER'}")
    return ours == theirs


def graph_tokens(device: str, tiny_model: str | None) -> bool:
    """Greedy tokens with decode graphs (CUDA: captured and replayed; CPU: the padded
    path run eagerly) against the eager engine on the same weights."""
    from common.sampling_params import SamplingParams
    from services.engine.config import EngineConfig
    from services.engine.cuda_graphs import DecodeGraphs
    from services.engine.engine import LLMEngine

    cuda = device == "cuda"
    model = tiny_model or "smollm2-135m-instruct"
    kw = dict(model=model, device=device, dtype="float32", max_num_seqs=8,
              max_model_len=64 if tiny_model else 1024, attention_backend="triton")
    prompts = [[1] + [100 + (i * 13 + j) % 90 for j in range(3 + 5 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    eager = LLMEngine(EngineConfig(**kw, **({"cuda_graphs": False} if cuda else {})))
    want = [c.token_ids for c in eager.generate(prompts, params)]
    graphed = LLMEngine(EngineConfig(**kw))
    runner = graphed.executor.runner
    if not cuda:
        runner.graphs = DecodeGraphs(runner.model, runner.kv_cache, torch.device("cpu"), 8,
                                     kw["max_model_len"], capture=False)
    got = [c.token_ids for c in graphed.generate(prompts, params)]
    steps = runner.graphs.replays if cuda else runner.graphs.eager_steps
    ok = got == want and steps > 0
    print(f"decode {'graph replay' if cuda else 'padded path (eager)'} vs eager tokens: "
          f"{'same' if got == want else 'DIFFER'} over {steps} steps")
    return ok


def tiny_random_model(root: Path) -> str:
    """A small Llama 3 model saved with transformers (random weights, no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rope_theta=500000.0, initializer_range=0.15, bos_token_id=1, eos_token_id=2,
    )).save_pretrained(root)
    return str(root)


def llama8b_random(ctx: int, batch: int, preset: str = "llama-3-8b", device: str = "cuda"):
    """A random bfloat16 model of ``preset``'s shape (built on the device, no host copy),
    a KV cache and one batch's metadata."""
    from services.engine.attention import AttentionMetadata, DecodeGroup, PrefillSegment
    from services.engine.attention_backends import make_attention_backend
    from services.engine.model import LlamaModel
    from services.engine.weights.random_init import random_weights

    weights = random_weights(preset, 0, dtype=torch.bfloat16, device=device)
    cfg = weights.config
    model = LlamaModel.from_hf_weights(
        cfg, make_attention_backend("triton" if device == "cuda" else "torch",
                                    torch.device(device)),
        weights.tensors, consume=True).eval()
    bs, per_seq = 16, -(-ctx // 16)
    shape = (cfg.num_layers, batch * per_seq, bs, cfg.num_kv_heads, cfg.head_dim)
    kv = (torch.randn(shape, device=device, dtype=torch.bfloat16),
          torch.randn(shape, device=device, dtype=torch.bfloat16))
    tables = torch.arange(batch * per_seq, device=device).view(batch, per_seq)

    def decode_meta():
        lens = torch.full((batch,), ctx, device=device)
        slots = tables[:, -1] * bs + (ctx - 1) % bs
        return AttentionMetadata(slots, [DecodeGroup(0, batch, tables, lens, ctx)], [])

    def prefill_meta():
        pos = torch.arange(ctx, device=device)
        return AttentionMetadata(tables[0][pos // bs] * bs + pos % bs, [],
                                 [PrefillSegment(0, ctx, ctx, tables[0])])
    return cfg, model, kv, decode_meta, prefill_meta


def decode_roofline(hbm_gbs: float, batch: int = 1, ctx: int = 4096) -> None:
    cfg, model, kv, meta, _ = llama8b_random(ctx, batch)
    ids = torch.randint(0, cfg.vocab_size, (batch,), device="cuda")
    pos = torch.full((batch,), ctx - 1, device="cuda")
    rows = torch.arange(batch, device="cuda")
    t = timed(lambda: model(ids, pos, kv, meta(), rows))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes = 2 * cfg.num_layers * batch * ctx * cfg.num_kv_heads * cfg.head_dim * 2
    floor = (weight_bytes + kv_bytes) / (hbm_gbs * 1e9)
    print(f"8B-shaped bf16 decode step (batch {batch}, ctx {ctx}): {t * 1e3:.2f} ms, "
          f"roofline {floor * 1e3:.2f} ms ({floor / t:.0%} of HBM bandwidth)")


def prefill_vs_peak(tokens: int = 4096) -> None:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    peak = 2 * 8192 ** 3 / timed(lambda: a @ a)
    cfg, model, kv, _, meta = llama8b_random(tokens, 1)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), device="cuda")
    pos = torch.arange(tokens, device="cuda")
    last = torch.tensor([tokens - 1], device="cuda")
    t = timed(lambda: model(ids, pos, kv, meta(), last), repeat=3)
    params = sum(p.numel() for p in model.parameters()) - cfg.vocab_size * cfg.hidden_size
    flops = 2 * params * tokens + 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens ** 2
    print(f"8B-shaped bf16 prefill of {tokens} tokens: {t * 1e3:.1f} ms, "
          f"{flops / t / 1e12:.0f} TFLOP/s = {flops / t / peak:.0%} of the measured bf16 "
          f"matmul peak ({peak / 1e12:.0f} TFLOP/s)")


def batch_throughput(model: str, batch: int = 64, n_new: int = 128) -> None:
    from transformers import AutoModelForCausalLM

    from common.sampling_params import SamplingParams
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=model, device="cuda"))
    prompts = [[1] + [100 + (i * 7 + j) % 1000 for j in range(128)] for i in range(batch)]
    params = SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    ours = batch * n_new / (time.perf_counter() - t0)
    hf = AutoModelForCausalLM.from_pretrained(engine.weights.tokenizer_dir,
                                              dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor(prompts, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    hf.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False)
    torch.cuda.synchronize()
    theirs = batch * n_new / (time.perf_counter() - t0)
    print(f"batch-{batch} decode: {ours:.0f} tok/s, transformers generate {theirs:.0f} tok/s "
          f"({ours / theirs:.2f}x)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny kernel checks on the CPU")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--hbm-gbs", type=float, default=4800.0, help="HBM bandwidth (H200)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is defined
    dev = "cuda" if cuda else "cpu"
    ok = True
    for name, err, passed in kernel_checks(dev, tiny=not cuda):
        print(f"{name:26s} max abs err {err:.2e}  {'pass' if passed else 'FAIL'}")
        ok &= passed
    if not cuda:
        if not args.dry_run:
            print("no CUDA device: end-to-end checks skipped")
            return 0 if ok else 1
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            ok &= graph_tokens("cpu", tiny_random_model(Path(tmp)))
        ok &= pool_round_trip("cpu", tiny=True)
        return 0 if ok else 1
    ok &= token_exactness(args.model, 32)
    ok &= graph_tokens("cuda", None)
    ok &= pool_round_trip("cuda", tiny=False)
    pool_stall(llama8b_random)
    decode_roofline(args.hbm_gbs)
    batch_throughput(args.model)
    prefill_vs_peak()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
