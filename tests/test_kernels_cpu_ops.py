"""The fused CPU RMSNorm and rotary (kernels/cpu_norm_rope.py) against their torch
definitions, the ops' choice of them, and the engine's greedy tokens with and without."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from common.sampling_params import SamplingParams
from kernels import cpu_norm_rope
from services.engine.attention_ops import REFERENCE_OPS, TORCH_OPS
from tests.tiny_models import random_prompts

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                                reason="no C++ compiler: the torch path runs")


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_norm_rope.available()  # with a compiler at hand, the kernel must build


# The default model's hidden size at decode and prefill row counts, and odd widths
# (a tail past the 16-lane loop, a width under it).
@pytest.mark.parametrize("rows,width", [(1, 576), (7, 576), (64, 576), (1024, 576),
                                        (3, 17), (2, 5), (5, 2048)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_equals_reference(rows, width, with_residual):
    g = torch.Generator().manual_seed(rows * 31 + width)
    x = torch.randn(rows, width, generator=g) * 3
    w = torch.randn(width, generator=g)
    res = torch.randn(rows, width, generator=g) if with_residual else None
    want_res = None if res is None else res.clone()
    want = cpu_norm_rope.rms_norm_reference(x, w, 1e-5, want_res)
    got_res = None if res is None else res.clone()
    got = cpu_norm_rope.rms_norm(x, w, 1e-5, got_res)
    assert got.shape == (rows, width) and got.dtype == torch.float32
    if res is not None:
        assert torch.equal(got_res, want_res)  # the stream: the same float32 sums, in place
        assert torch.equal(got_res, res + x)
    # Only the sum of squares adds in another order: float32 rounding apart.
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    exact = cpu_norm_rope.rms_norm_reference(x.double(), w.double(), 1e-5,
                                             None if res is None else res.double())
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)


def test_norm_reads_strided_rows():
    base = torch.randn(4, 700)
    x, res = base[:, :576], torch.randn(4, 900)[:, 100:676]
    want_res = res.clone()
    want = cpu_norm_rope.rms_norm_reference(x, torch.ones(576), 1e-6, want_res)
    got = cpu_norm_rope.rms_norm(x, torch.ones(576), 1e-6, res)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    assert torch.equal(res, want_res)


def _qkv(rows, heads, kv_heads, dim, seed):
    """q and k as the model has them: views into one fused projection output."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g)
    q = qkv[:, :heads * dim].view(rows, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(rows, kv_heads, dim)
    return qkv, q, k


@pytest.mark.parametrize("rows", [1, 5, 64, 1024])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 1, 128), (2, 2, 2)])
def test_rotary_equals_reference_exactly(rows, heads, kv_heads, dim):
    from services.engine.model import Rotary
    from services.engine.model_config import ModelConfig
    cfg = ModelConfig(architecture="llama", vocab_size=16, hidden_size=heads * dim,
                      intermediate_size=32, num_layers=1, num_heads=heads,
                      num_kv_heads=kv_heads, head_dim=dim, max_position_embeddings=2048)
    cos, sin = Rotary(cfg).tables(torch.device("cpu"))
    qkv, q, k = _qkv(rows, heads, kv_heads, dim, seed=rows + dim)
    v_before = qkv[:, (heads + kv_heads) * dim:].clone()
    pos = torch.randint(0, 2048, (rows,), generator=torch.Generator().manual_seed(rows))
    want_q, want_k = cpu_norm_rope.rotary_reference(pos, q, k, cos, sin)
    cpu_norm_rope.rotary_(pos, q, k, cos, sin)
    # The same products and sums, rounded one at a time: bit for bit.
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], v_before)  # v untouched


def test_rotary_refuses_a_position_past_the_table_and_changes_nothing():
    cos, sin = torch.randn(8, 64), torch.randn(8, 64)
    qkv, q, k = _qkv(3, 9, 3, 64, seed=1)
    before = qkv.clone()
    with pytest.raises(RuntimeError, match="position 8 outside"):
        cpu_norm_rope.rotary_(torch.tensor([0, 8, 1]), q, k, cos, sin)
    assert torch.equal(qkv, before)
    with pytest.raises(RuntimeError, match="q:"):
        cpu_norm_rope.rotary_(torch.tensor([0, 1, 2]), q.double(), k, cos, sin)
    with pytest.raises(RuntimeError, match="x:"):
        cpu_norm_rope.rms_norm(torch.randn(2, 8).double(), torch.ones(8), 1e-5)


def test_ops_take_the_kernel_for_float32_cpu_only(monkeypatch):
    calls = []
    for name in ("rms_norm", "rotary_"):
        real = getattr(cpu_norm_rope, name)
        monkeypatch.setattr(cpu_norm_rope, name,
                            lambda *a, _r=real, _n=name, **kw: calls.append(_n) or _r(*a, **kw))
    cos, sin = torch.randn(16, 8), torch.randn(16, 8)
    for dtype in (torch.float64, torch.bfloat16):  # torch keeps other dtypes
        x = torch.randn(2, 8, dtype=dtype)
        TORCH_OPS.rms_norm(x, torch.ones(8, dtype=dtype), 1e-5, torch.randn(2, 8, dtype=dtype))
        TORCH_OPS.rotary(torch.tensor([1, 2]), torch.randn(2, 2, 8, dtype=dtype),
                         torch.randn(2, 1, 8, dtype=dtype), cos, sin)
    assert calls == []
    x, res, w = torch.randn(2, 8), torch.randn(2, 8), torch.randn(8)
    ref_res = res.clone()
    got, got_res = TORCH_OPS.rms_norm(x, w, 1e-5, res)
    want, want_res = REFERENCE_OPS.rms_norm(x, w, 1e-5, ref_res)
    assert got_res is res and torch.equal(res, want_res)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    want_q, want_k = REFERENCE_OPS.rotary(torch.tensor([3, 4]), q, k, cos, sin)
    got_q, got_k = TORCH_OPS.rotary(torch.tensor([3, 4]), q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert calls == ["rms_norm", "rotary_"]


def test_engine_greedy_tokens_unchanged(tiny_dirs, make_engine, monkeypatch):
    calls = []
    real = cpu_norm_rope.rotary_
    monkeypatch.setattr(cpu_norm_rope, "rotary_", lambda *a: calls.append(1) or real(*a))
    prompts = random_prompts([5, 17, 33, 2], seed=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    fused = [c.token_ids for c in make_engine(tiny_dirs["llama"], dtype="float32")
             .generate(prompts, greedy)]
    assert calls  # the float32 CPU engine ran the kernel
    monkeypatch.setattr(TORCH_OPS, "fused", False)
    n = len(calls)
    plain = [c.token_ids for c in make_engine(tiny_dirs["llama"], dtype="float32")
             .generate(prompts, greedy)]
    assert len(calls) == n
    assert fused == plain and all(len(t) == 24 for t in fused)
