"""A bfloat16 KV cache under a float32 model on the CPU (``kv_cache_dtype``): the
kernel's bfloat16 instantiation, the torch paths that read the cache, the engine's
tokens, the settings that refuse what is not supported, and the KV facts a worker
reports so that workers of different KV dtypes do not exchange bytes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.protocol import WorkerInfo
from common.sampling_params import SamplingParams
from services.conductor.compat import mismatch
from services.engine import attention_paged_cpu
from services.engine.attention import (
    AttentionMetadata,
    DecodeGroup,
    PrefillSegment,
    TorchAttention,
)
from services.engine.config import EngineConfig
from services.engine.kv_cache import KVCache
from services.worker.handshake import hash_and_version, kv_layout
from services.worker.settings import WorkerSettings
from tests.test_attention_paged_cpu import WRITE_CASES, _cache, _last_slots, _qkv_rows, _reference
from tests.test_attention_paged_cpu import needs_compiler as compiler

SHAPES = [
    ([1], 16, 1, 1, 16),                              # one token
    ([5, 16, 17, 1, 300, 33], 16, 3, 9, 64),          # ragged, block edges, GQA 3
    ([7, 2, 40, 9], 4, 2, 8, 32),                     # small blocks, GQA 4
    ([64, 63, 65], 32, 4, 4, 128),                    # no GQA, wide heads
    ([700, 20, 641], 16, 3, 9, 64),                   # many blocks
    ([50, 24, 23, 25], 24, 2, 12, 32),                # a full and a part tile
    ([30, 61], 8, 1, 7, 128),                         # MQA, passes of 4+3
    ([19, 40], 16, 2, 4, 48),                         # head_dim 48: the portable loop
]


def _rounded(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().float()


@compiler
@pytest.mark.parametrize("lens,block_size,kv_heads,heads,dim", SHAPES)
def test_bf16_kernel_is_the_float32_kernel_over_rounded_values(lens, block_size, kv_heads,
                                                               heads, dim):
    q, k_cache, v_cache, tables, ctx = _cache(lens, block_size, kv_heads, heads, dim, seed=3)
    kb, vb = k_cache.bfloat16(), v_cache.bfloat16()
    got = torch.full_like(q, float("nan"))
    attention_paged_cpu.paged_decode(q, kb, vb, tables, ctx, got, widen=True)
    # Widening is exact: the same arithmetic on the same values, bit for bit. (Without
    # widen, a CPU with AVX512_BF16 takes dot products: tests/test_paged_kernel_bf16_dot.py.)
    want = torch.full_like(q, float("nan"))
    attention_paged_cpu.paged_decode(q, kb.float(), vb.float(), tables, ctx, want)
    assert torch.equal(got, want)
    torch.testing.assert_close(got.double(), _reference(q, kb.float(), vb.float(), tables, ctx),
                               rtol=1e-5, atol=1e-5)
    # And not the unrounded cache's answer: the rounding is what the test sees.
    unrounded = torch.empty_like(q)
    attention_paged_cpu.paged_decode(q, k_cache, v_cache, tables, ctx, unrounded, widen=True)
    assert not torch.equal(got, unrounded)


@compiler
@pytest.mark.parametrize("bad", ["block", "length", "mixed", "half"])
def test_bf16_kernel_refuses_bad_tables_and_dtypes(bad):
    q, k_cache, v_cache, tables, ctx = _cache([20, 3], 16, 1, 2, 16)
    kb, vb = k_cache.bfloat16(), v_cache.bfloat16()
    match = "out of range"
    if bad == "block":
        tables[0, 1] = k_cache.shape[0]
    elif bad == "length":
        ctx[1] = tables.shape[1] * 16 + 1
    elif bad == "mixed":  # K bfloat16, V float32
        vb, match = v_cache, "float32 or bfloat16 cache"
    else:
        kb, vb, match = k_cache.half(), v_cache.half(), "float32 or bfloat16 cache"
    out = torch.zeros_like(q)
    with pytest.raises(RuntimeError, match=match):
        attention_paged_cpu.paged_decode(q, kb, vb, tables, ctx, out)
    assert not out.any()


def _write_decode(store, lens, block_size, kv_heads, heads, dim):
    """write_decode on a cache made by ``store`` (float32 rows -> the cache's rows), and
    torch's index_copy_ of the stored rows followed by paged_decode: (the caches it
    wrote, those torch wrote, its output, paged_decode's)."""
    _, k_cache, v_cache, tables, ctx = _cache(lens, block_size, kv_heads, heads, dim, seed=11)
    q, k, v = _qkv_rows(len(lens), heads, kv_heads, dim, seed=12)
    slots = _last_slots(tables, lens, block_size)
    kc, vc = store(k_cache), store(v_cache)
    kc.view(-1, kv_heads, kc.shape[-1]).index_copy_(0, slots, store(k))
    vc.view(-1, kv_heads, vc.shape[-1]).index_copy_(0, slots, store(v))
    want = torch.empty(q.shape)
    attention_paged_cpu.paged_decode(q, kc, vc, tables, ctx, want)
    kg, vg = store(k_cache), store(v_cache)
    got = attention_paged_cpu.write_decode(q, k, v, kg, vg, slots, tables, ctx)
    return (kg, vg), (kc, vc), got, want


def _write_decode_refuses_slot(store, bad_slot) -> None:
    """write_decode with one slot ``bad_slot(k_cache)`` refuses, the cache untouched."""
    _, k_cache, v_cache, tables, ctx = _cache([20, 3], 16, 1, 2, 16)
    q, k, v = _qkv_rows(2, 2, 1, 16, seed=1)
    slots = _last_slots(tables, [20, 3], 16)
    slots[1] = bad_slot(k_cache)
    kc, vc = store(k_cache), store(v_cache)
    with pytest.raises(RuntimeError, match="slot out of range"):
        attention_paged_cpu.write_decode(q, k, v, kc, vc, slots, tables, ctx)
    assert torch.equal(kc, store(k_cache)) and torch.equal(vc, store(v_cache))


@compiler
@WRITE_CASES
def test_bf16_write_decode_rounds_as_torch_and_attends(lens, block_size, kv_heads, heads,
                                                       dim):
    (kg, vg), (kc, vc), got, want = _write_decode(
        lambda t: t.to(torch.bfloat16), lens, block_size, kv_heads, heads, dim)
    assert torch.equal(kg.view(torch.int16), kc.view(torch.int16))  # the same bits
    assert torch.equal(vg.view(torch.int16), vc.view(torch.int16))
    assert torch.equal(got, want)


@compiler
def test_bf16_write_decode_refuses_a_bad_slot_before_writing():
    _write_decode_refuses_slot(torch.Tensor.bfloat16, lambda k_cache: -1)


def _widen(monkeypatch) -> None:
    """The paged kernel widens bfloat16 K/V (v8) and dequantizes int8 K/V in its portable
    loop even where it could take dot products (v9 on bfloat16, v10 on int8, which round
    q too): the path held to float32."""
    monkeypatch.setattr(attention_paged_cpu, "_dot", lambda mod, k_cache, widen: False)


def _step_on(path, monkeypatch, store, held):
    """Decodes and a prefill chunk with a cached prefix, in one step of the torch path
    ``path``, on a cache made by ``store`` and on a float32 cache fed ``held`` (the
    values that cache keeps): (q, the float32 K cache, {"cache": (out, K, V), "ref": ...})."""
    if path == "paged" and not attention_paged_cpu.available():
        pytest.skip("no compiled kernel")
    _widen(monkeypatch)
    lens = [9, 16, 17, 4]
    _, k_cache, v_cache, tables, ctx = _cache(lens, 4, 2, 6, 16, seed=5)
    q, k, v = _qkv_rows(7, 6, 2, 16, seed=6)
    slots = _last_slots(tables, lens, 4)
    spare = [b for b in range(k_cache.shape[0]) if b not in tables.flatten().tolist()][:2]
    # The prefill: 3 new tokens (positions 3-5) after 3 cached ones, blocks spare[0:2].
    pre_slots = torch.tensor([spare[0] * 4 + 3, spare[1] * 4, spare[1] * 4 + 1])
    table = torch.tensor(spare)
    groups = [DecodeGroup(0, 4, tables, ctx, 17)]
    runs = {}
    for name, kc, vc, kk, vv in (
            ("cache", store(k_cache), store(v_cache), k, v),
            ("ref", held(k_cache), held(v_cache), held(k), held(v))):
        meta = AttentionMetadata(torch.cat([slots, pre_slots]), groups,
                                 [PrefillSegment(4, 3, 6, table)])
        runs[name] = (TorchAttention(path).forward(q, kk, vv, kc, vc, meta), kc, vc)
    return q, k_cache, runs


@pytest.mark.parametrize("path", ["paged", "chunked", "gather"])
def test_backend_on_a_bf16_cache_equals_float32_over_rounded_kv(path, monkeypatch):
    # Each torch path on the bfloat16 cache equals itself on a float32 cache holding the
    # rounded values.
    q, k_cache, runs = _step_on(path, monkeypatch, torch.Tensor.bfloat16, _rounded)
    assert attention_paged_cpu.supports(q, k_cache.bfloat16())  # "auto" takes the kernel
    assert not attention_paged_cpu.supports(q, k_cache.half())
    (out, kc, vc), (ref, kr, vr) = runs["cache"], runs["ref"]
    assert kc.dtype == torch.bfloat16
    assert torch.equal(kc.float(), kr)
    assert torch.equal(vc.float(), vr)
    assert torch.equal(out, ref)


class _RoundingBackend(TorchAttention):
    """A float32 cache whose K/V are rounded to bfloat16 before they are written: the
    reference a bfloat16 cache is held to."""

    def forward(self, q, k, v, k_cache, v_cache, meta):
        return super().forward(q, _rounded(k), _rounded(v), k_cache, v_cache, meta)


def _engine_tokens_equal(tiny_dirs, make_engine, monkeypatch, kv, reference, atol, **kw):
    """An engine with ``kv_cache_dtype=kv`` and a float32-KV one whose backend is
    ``reference`` (it stores the values that cache keeps): the same greedy tokens and
    top-3 candidates, their log-probabilities within ``atol``. The engines, by kv."""
    prompts = [[1, 5, 9, 200, 17, 3, 3, 8, 40, 41, 42, 7, 6, 5, 4, 3, 2, 100, 101],
               [1, 77], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    runs, engines = {}, {}
    path = "paged" if attention_paged_cpu.available() else "chunked"
    _widen(monkeypatch)
    for name in (kv, "auto"):
        engine = make_engine(tiny_dirs["llama"], dtype="float32", block_size=4,
                             num_kv_blocks=64, kv_cache_dtype=name, **kw)
        engine.model.backend = (TorchAttention if name == kv else reference)(path)
        outs = engine.generate(prompts, params)
        runs[name] = ([o.token_ids for o in outs], [[lp.top for lp in o.logprobs] for o in outs])
        engines[name] = engine
    assert runs[kv][0] == runs["auto"][0]
    assert all(len(t) == 12 for t in runs[kv][0])
    for got, want in zip(runs[kv][1], runs["auto"][1], strict=True):
        for g, w in zip(got, want, strict=True):
            assert [t for t, _ in g] == [t for t, _ in w]
            assert [lp for _, lp in g] == pytest.approx([lp for _, lp in w], abs=atol)
    return engines


@pytest.mark.parametrize("quantization", ["none", "w4a16"])
def test_engine_bf16_kv_tokens_equal_float32_over_rounded_kv(tiny_dirs, make_engine,
                                                             quantization, monkeypatch):
    # w4a16 steps of <= 8 rows run the fused layers (kernels/cpu_layer.py) around attention.
    engines = _engine_tokens_equal(tiny_dirs, make_engine, monkeypatch, "bfloat16",
                                   _RoundingBackend, 1e-5, quantization=quantization)
    assert engines["bfloat16"].kv_store.k.dtype == torch.bfloat16
    assert engines["auto"].kv_store.k.dtype == torch.float32


def info(wid: str, engine) -> WorkerInfo:
    """What decode worker ``wid`` reports of ``engine``: its KV facts among them."""
    return WorkerInfo(wid, "decode", "m", f"tcp://{wid}:1", f"tcp://{wid}:2", "h", 4,
                      engine.kv_store.num_blocks, engine.fingerprint, *kv_layout(engine),
                      **hash_and_version())


def test_engine_bf16_kv_halves_block_bytes_and_changes_its_kv_facts(tiny_dirs, make_engine):
    f32 = make_engine(tiny_dirs["llama"], dtype="float32", kv_cache_bytes=1 << 20)
    bf16 = make_engine(tiny_dirs["llama"], dtype="float32", kv_cache_bytes=1 << 20,
                       kv_cache_dtype="bfloat16")
    assert bf16.kv_store.k.dtype == torch.bfloat16 and f32.kv_store.k.dtype == torch.float32
    assert bf16.kv_store.block_nbytes * 2 == f32.kv_store.block_nbytes
    assert bf16.kv_store.num_blocks == 2 * f32.kv_store.num_blocks  # same bytes, 2x blocks
    assert bf16.fingerprint != f32.fingerprint
    assert bf16.config.precision == "float32+kv-bfloat16"
    assert (kv_layout(f32).kv_dtype, kv_layout(bf16).kv_dtype) == ("float32", "bfloat16")

    # The conductor refuses the second worker on its KV dtype, before any bytes move.
    found = mismatch(info("d0", f32), info("d1", bf16))
    assert (found.field, found.expected, found.got) == ("kv_dtype", "float32", "bfloat16")
    assert mismatch(info("d0", bf16), dataclasses.replace(info("d1", bf16))) is None
    # And a float32 worker's bytes do not fit a bfloat16 cache's blocks.
    payload = f32.kv_store.export_block_bytes(0)
    with pytest.raises(ValueError, match="a block holds"):
        bf16.kv_store.import_block_bytes(0, payload)


def _blocks_exchanged(dtype, store):
    """Two caches of ``dtype`` (2 layers, 6 blocks of 4, 2 heads of 8), the source's K/V
    ``store(randn)``: whole blocks and one layer's block copied by their bytes land where
    asked. (source, destination)."""
    src = KVCache(2, 6, 4, 2, 8, dtype)
    src.k.copy_(store(torch.randn(2, 6, 4, 2, 8)))
    src.v.copy_(store(torch.randn(2, 6, 4, 2, 8)))
    dst = KVCache(2, 6, 4, 2, 8, dtype)
    dst.import_blocks_bytes([4, 1], [src.export_block_bytes(2), src.export_block_bytes(3)])
    dst.import_layer_bytes(1, [0], src.export_layer_bytes(1, [5]))
    assert torch.equal(dst.k[:, 4], src.k[:, 2]) and torch.equal(dst.v[:, 1], src.v[:, 3])
    assert torch.equal(dst.k[1, 0], src.k[1, 5]) and torch.equal(dst.v[1, 0], src.v[1, 5])
    return src, dst


def test_bf16_cache_exports_and_imports_its_own_bytes():
    src, _ = _blocks_exchanged(torch.bfloat16, torch.Tensor.bfloat16)
    assert src.block_nbytes == 2 * 2 * 4 * 2 * 8 * 2


def _settings_refuse(kv: str, unknown: str, cases) -> None:
    """EngineConfig(kv_cache_dtype=kv, **kw) refuses each case with its message; a
    worker's settings take ``kv`` and refuse ``unknown``."""
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            EngineConfig(**{"kv_cache_dtype": kv, **kw})
    assert WorkerSettings(kv_cache_dtype=kv).kv_cache_dtype == kv
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto, bfloat16 or int8"):
        WorkerSettings(kv_cache_dtype=unknown)


def test_settings_accept_bf16_kv_only_where_it_runs():
    assert EngineConfig(device="cpu").kv_torch_dtype == torch.float32  # auto: the model's
    assert EngineConfig(device="cpu", kv_cache_dtype="bfloat16").kv_dtype_name == "bfloat16"
    assert EngineConfig(device="cpu").precision == "float32"
    # On CUDA, auto is bfloat16 already: asking for it changes nothing.
    same = EngineConfig(device="cuda", kv_cache_dtype="bfloat16")
    assert same.precision == "bfloat16" and same.kv_dtype_name == "bfloat16"
    _settings_refuse("bfloat16", "float16", (
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype must be one of"),
        ({"device": "cuda", "dtype": "float32"}, "runs on device cpu with dtype float32 only"),
        ({"device": "cpu", "dtype": "float64"}, "runs on device cpu with dtype float32 only"),
        ({"device": "cpu", "attention_backend": "triton"}, "torch attention backend"),
        ({"device": "cpu", "tensor_parallel_size": 2}, "tensor_parallel_size 1")))


def _moves_and_continues(tiny_dirs, make_engine, kv, seed):
    """A prefills, each layer's K/V streamed into B's reserved blocks (as a prefill
    worker does); B decodes: the tokens of one engine of ``kv_cache_dtype=kv`` alone. B."""
    from tests.test_engine_kv_transfer import _continue_in_b
    from tests.tiny_models import random_prompts

    def engine(hooks=None):
        return make_engine(tiny_dirs["llama"], hooks, dtype="float32",
                           kv_cache_dtype=kv, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = random_prompts([37, 16, 5], seed=seed)
    want = [c.token_ids for c in engine().generate(prompts, params)]
    b = engine()
    got = [_continue_in_b(None, b, p, params, lambda _dir, hooks: engine(hooks))
           for p in prompts]
    assert got == want and all(len(t) == 20 for t in got)
    return b


def test_bf16_kv_moves_between_bf16_engines_and_continues_as_one(tiny_dirs, make_engine):
    _moves_and_continues(tiny_dirs, make_engine, "bfloat16", seed=8)
