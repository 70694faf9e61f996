"""The fused decoder layer (kernels/cpu_layer.py) against the per-op path it replaces,
and the engine's tokens and log-probabilities with it on and off."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from common.sampling_params import SamplingParams
from kernels import cpu_layer, cpu_norm_rope, cpu_qmatmul_a8
from services.engine import attention_paged_cpu
from services.engine.model_runner import FusedLayers
from services.engine.weights.quantize import A8Linear
from tests.tiny_models import random_prompts

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                                reason="no C++ compiler: the per-op path runs")


@pytest.fixture(scope="module", autouse=True)
def built():
    # With a compiler at hand every kernel must build; the per-op path then takes the
    # compiled norm, rotary and attention too, so both paths round alike.
    for kernel in (cpu_layer, cpu_norm_rope, cpu_qmatmul_a8, attention_paged_cpu):
        assert kernel.available()


def _proj(p: A8Linear) -> tuple:
    return (p.packed, p.scale, p.offset, p.bits, p.out_features, p.bias)


def _weights(bits, heads, kv_heads, dim, hidden, inter, bias, seed):
    g = torch.Generator().manual_seed(seed)

    def lin(n, k, with_bias=False):
        b = torch.randn(n, generator=g) if with_bias else None
        return A8Linear(torch.randn(n, k, generator=g) / k ** 0.5, b, bits)
    return dict(qkv=lin((heads + 2 * kv_heads) * dim, hidden, bias),
                o=lin(hidden, heads * dim), gate_up=lin(2 * inter, hidden),
                down=lin(hidden, inter), ln1=torch.rand(hidden, generator=g) + 0.5,
                ln2=torch.rand(hidden, generator=g) + 0.5)


# The default model's shapes (9/3 heads of 64, width 576, 1,536 inside), and a narrow
# one with a q/k/v bias, a q/k/v width off the 16-row blocks (120) and 8-bit codes.
@pytest.mark.parametrize("bits,heads,kv_heads,dim,hidden,inter,bias", [
    (4, 9, 3, 64, 576, 1536, False), (8, 8, 1, 12, 64, 32, True)])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("first", [False, True])
def test_layer_equals_the_per_op_path_bit_for_bit(bits, heads, kv_heads, dim, hidden,
                                                   inter, bias, rows, first):
    w = _weights(bits, heads, kv_heads, dim, hidden, inter, bias, seed=rows + bits)
    g = torch.Generator().manual_seed(rows)
    cos, sin = torch.randn(64, dim, generator=g), torch.randn(64, dim, generator=g)
    layer = cpu_layer.make_layer(w["ln1"], 1e-5, _proj(w["qkv"]), _proj(w["o"]), w["ln2"],
                                 1e-6, _proj(w["gate_up"]), _proj(w["down"]), cos, sin,
                                 heads, kv_heads, dim, inter)
    x, res = torch.randn(rows, hidden, generator=g), torch.randn(rows, hidden, generator=g)
    pos = torch.randint(0, 64, (rows,), generator=g)
    attn = torch.randn(rows, heads, dim, generator=g)
    res_ref = x.clone() if first else res.clone()
    with torch.inference_mode():
        # The per-op path (services/engine/model.py with TORCH_OPS and A8Linear).
        h = cpu_norm_rope.rms_norm(x, w["ln1"], 1e-5, None if first else res_ref)
        q, k, v = w["qkv"](h).split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q, k = q.view(rows, heads, dim), k.view(rows, kv_heads, dim)
        cpu_norm_rope.rotary_(pos, q, k, cos, sin)
        a = w["o"](attn.reshape(rows, -1))
        h2 = cpu_norm_rope.rms_norm(a, w["ln2"], 1e-6, res_ref)
        gate, up = w["gate_up"](h2).split(inter, dim=-1)
        want = w["down"](F.silu(gate).mul_(up))

        got_q, got_k, got_v = layer.pre(x, None if first else res, pos)
        res_got = x if first else res
        got = layer.post(attn, res_got)
    assert torch.equal(got_q, q) and torch.equal(got_k, k)
    assert torch.equal(got_v, v.reshape(rows, kv_heads, dim))
    assert torch.equal(res_got, res_ref)  # the residual stream, updated in place alike
    assert torch.equal(got, want)


def test_layer_refuses_mismatched_weights():
    w = _weights(4, 2, 1, 32, 64, 64, False, seed=0)
    with pytest.raises(RuntimeError, match="qkv"):
        cpu_layer.make_layer(w["ln1"], 1e-5, _proj(w["o"]), _proj(w["o"]), w["ln2"], 1e-5,
                             _proj(w["gate_up"]), _proj(w["down"]), torch.ones(8, 32),
                             torch.ones(8, 32), 2, 1, 32, 32)


def _run(engine, prompts, **kw):
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=3, **kw)
    outs = engine.generate(prompts, greedy)
    return ([o.token_ids for o in outs],
            [[lp.top for lp in o.logprobs] for o in outs] if outs[0].logprobs else None)


@pytest.mark.parametrize("arch,method", [("llama", "w4a16"), ("qwen2", "w4a16"),
                                         ("llama", "w4a8")])
def test_engine_tokens_and_logprobs_equal_with_and_without(arch, method, tiny_dirs,
                                                            make_engine, monkeypatch):
    calls = []
    real = FusedLayers.__call__

    def counted(self, *a, **kw):
        out = real(self, *a, **kw)
        calls.append(out is not None)
        return out
    monkeypatch.setattr(FusedLayers, "__call__", counted)
    prompts = random_prompts([5, 17, 33, 2], seed=7)  # 4 decodes a step: fused
    fused = make_engine(tiny_dirs[arch], dtype="float32", quantization=method)
    assert isinstance(fused.model.fused_layers, FusedLayers)
    got = _run(fused, prompts)
    assert True in calls and False in calls  # decode steps fused, prefill (>8 rows) not
    monkeypatch.setenv(cpu_layer.ENV, "0")
    plain = make_engine(tiny_dirs[arch], dtype="float32", quantization=method)
    assert plain.model.fused_layers is None
    want = _run(plain, prompts)
    assert got[0] == want[0]
    # Same arithmetic in the same order: the log-probabilities agree to the bit.
    assert got[1] == want[1]


@pytest.mark.parametrize("kw,why", [({"quantization": "none"}, "not quantized"),
                                    ({"quantization": "w8a16", "env": "0"}, "turned off")])
def test_models_the_fused_path_does_not_take(kw, why, tiny_dirs, make_engine, monkeypatch,
                                             caplog):
    if "env" in kw:
        monkeypatch.setenv(cpu_layer.ENV, kw.pop("env"))
    with caplog.at_level(logging.INFO, logger="services.engine.model_runner"):
        engine = make_engine(tiny_dirs["llama"], dtype="float32", **kw)
    assert engine.model.fused_layers is None
    assert any(why in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_default_model_answers_equal_with_and_without(monkeypatch):
    """The five chat prompts of tests/test_default_model.py, w4a16, batched (5 rows a
    decode step: fused): the same tokens and log-probabilities as the op-by-op path."""
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine
    from services.engine.weights import DEFAULT_MODEL
    from tests.test_default_model import CHAT_PROMPTS, _chat_params

    def answers():
        engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL, kv_cache_bytes=64 << 20,
                                        quantization="w4a16"))
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}])
                   for p in CHAT_PROMPTS]
        outs = engine.generate(prompts, _chat_params())
        return (engine.model.fused_layers,
                [o.token_ids for o in outs], [[lp.top for lp in o.logprobs] for o in outs])
    fused, tokens, logprobs = answers()
    assert isinstance(fused, FusedLayers) and fused._layers is not None  # it ran
    monkeypatch.setenv(cpu_layer.ENV, "0")
    plain, want_tokens, want_logprobs = answers()
    assert plain is None
    assert tokens == want_tokens and logprobs == want_logprobs
