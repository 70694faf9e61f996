"""The model's norm and rotary go through its backend's ops (Triton kernels on the
Triton backend, torch elsewhere), and rotary tables stay float32 in a bfloat16 model."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from common.sampling_params import SamplingParams
from services.engine.model import Rotary, rope_inv_freq
from services.engine.model_config import ModelConfig

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _rotate64(x, pos, inv_freq):
    ang = torch.outer(pos.double(), inv_freq)
    ang = torch.cat([ang, ang], -1).unsqueeze(1)
    x = x.double()
    half = x.shape[-1] // 2
    return x * ang.cos() + torch.cat([-x[..., half:], x[..., :half]], -1) * ang.sin()


def test_bfloat16_rotary_keeps_float32_tables_at_long_positions():
    cfg = ModelConfig(architecture="llama", vocab_size=16, hidden_size=128,
                      intermediate_size=32, num_layers=1, num_heads=4, num_kv_heads=1,
                      head_dim=128, rope_theta=500000.0, max_position_embeddings=8192)
    rotary = Rotary(cfg).to(torch.bfloat16)  # as the engine casts the whole model
    assert rotary.cos.dtype == rotary.sin.dtype == torch.float32
    gen = torch.Generator().manual_seed(0)
    pos = torch.arange(8000, 8192)
    q = torch.randn(len(pos), 4, 128, generator=gen).to(torch.bfloat16)
    k = torch.randn(len(pos), 1, 128, generator=gen).to(torch.bfloat16)
    got_q, got_k = rotary(pos, q, k)
    inv = rope_inv_freq(128, 500000.0, None)
    want_q = _rotate64(q, pos, inv).to(torch.bfloat16)  # float64, rounded once

    def exact(x):  # the share of values equal to the correctly rounded float64 result
        return (x == want_q).float().mean().item()

    assert exact(got_q) >= 0.97
    assert (got_k == _rotate64(k, pos, inv).to(torch.bfloat16)).float().mean() >= 0.97
    # What bfloat16 tables (and bfloat16 arithmetic) gave: far off the same mark.
    c = rotary.cos.to(torch.bfloat16)[pos].unsqueeze(1)
    s = rotary.sin.to(torch.bfloat16)[pos].unsqueeze(1)
    old_q = q * c + torch.cat([-q[..., 64:], q[..., :64]], -1) * s
    assert exact(old_q) < 0.9


def test_float_model_rotary_is_unchanged():
    """float32 and float64 models rotate with the same (float32-built) tables as before."""
    cfg = ModelConfig(architecture="llama", vocab_size=16, hidden_size=64,
                      intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=32, max_position_embeddings=64)
    rotary = Rotary(cfg).to(torch.float64)
    q, k = torch.randn(3, 2, 32, dtype=torch.float64), torch.randn(3, 1, 32, dtype=torch.float64)
    pos = torch.tensor([0, 5, 63])
    c = rotary.cos.double()[pos].unsqueeze(1)
    s = rotary.sin.double()[pos].unsqueeze(1)
    want = q * c + torch.cat([-q[..., 16:], q[..., :16]], -1) * s
    assert torch.equal(rotary(pos, q, k)[0], want)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_backend_runs_the_norm_and_rotary_kernels(tiny_dirs, make_engine, monkeypatch):
    from services.engine import attention_triton

    calls = {"rms_norm": 0, "rotary": 0, "residual": 0}

    def counted(name, fn):
        def wrapper(*args):
            calls[name] += 1
            if name == "rms_norm" and args[3] is not None:
                calls["residual"] += 1
            return fn(*args)
        return wrapper

    monkeypatch.setattr(attention_triton, "rms_norm",
                        counted("rms_norm", attention_triton.rms_norm))
    monkeypatch.setattr(attention_triton, "rotary_embedding",
                        counted("rotary", attention_triton.rotary_embedding))
    prompts = [[1, 5, 9, 200, 17, 3, 3, 8, 40, 41], [1, 77, 78]]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        engine = make_engine(tiny_dirs["llama3"], dtype="float32", block_size=4,
                             num_kv_blocks=32, attention_backend=backend)
        tokens[backend] = [c.token_ids for c in engine.generate(prompts, params)]
        if backend == "torch":
            assert calls == {"rms_norm": 0, "rotary": 0, "residual": 0}
    layers = 2
    steps = 3  # one prefill step for both prompts, then two decode steps
    assert calls["rotary"] == steps * layers
    assert calls["rms_norm"] == steps * (2 * layers + 1)
    assert calls["residual"] == steps * 2 * layers  # all but the first layer's input norm
    assert tokens["triton"] == tokens["torch"]
