"""The model's weight layout: wide projections transposed, a tied embedding stored once."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from services.engine.attention import TorchAttention
from services.engine.model import LlamaModel, WideLinear
from services.engine.model_config import ModelConfig

CFG = dict(architecture="llama", vocab_size=64, hidden_size=16, intermediate_size=40,
           num_layers=1, num_heads=4, num_kv_heads=2, head_dim=4)


def test_wide_linear_matches_linear():
    torch.manual_seed(0)
    ref = torch.nn.Linear(8, 24)
    wide = WideLinear(8, 24, bias=True)
    with torch.no_grad():
        wide.weight_t.copy_(ref.weight.t())
        wide.bias.copy_(ref.bias)
    x = torch.randn(5, 8)
    torch.testing.assert_close(wide(x), ref(x))


def test_tied_embedding_is_the_transposed_head():
    model = LlamaModel(ModelConfig(**CFG, tie_word_embeddings=True), TorchAttention())
    assert model.embed_tokens is None
    names = set(model.state_dict())
    assert "lm_head.weight_t" in names and not any(n.startswith("embed_tokens") for n in names)
    table = torch.randn(64, 16)
    with torch.no_grad():
        model.lm_head.weight_t.copy_(table.t())
    ids = torch.tensor([3, 0, 63, 3])
    torch.testing.assert_close(model._embed(ids), table[ids])
    assert model._embed(ids).is_contiguous()


def test_untied_model_keeps_both():
    model = LlamaModel(ModelConfig(**CFG, tie_word_embeddings=False), TorchAttention())
    assert model.embed_tokens is not None
    assert tuple(model.lm_head.weight_t.shape) == (16, 64)


def _latency():
    spec = importlib.util.spec_from_file_location(
        "bench_latency", Path(__file__).resolve().parents[1] / "bench" / "latency.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_latency_ratios_are_per_round_and_oriented():
    lat = _latency()
    runs = {"pdserve": [{"decode_tok_s": 20, "ttft_s": 0.1, "prefill_tok_s": 100},
                        {"decode_tok_s": 30, "ttft_s": 0.2, "prefill_tok_s": 300},
                        {"decode_tok_s": 10, "ttft_s": 0.4, "prefill_tok_s": 200}],
            "transformers": [{"decode_tok_s": 10, "ttft_s": 0.2, "prefill_tok_s": 100},
                             {"decode_tok_s": 10, "ttft_s": 0.2, "prefill_tok_s": 100},
                             {"decode_tok_s": 10, "ttft_s": 0.2, "prefill_tok_s": 100}]}
    s = lat.summarize(runs)
    assert s["pdserve"]["decode_tok_s"] == {"median": 20, "min": 10, "max": 30}
    r = s["pdserve_vs_transformers"]
    assert r["decode_tok_s"] == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert r["ttft_s"] == {"median": 1.0, "min": 0.5, "max": 2.0}  # > 1: pdserve faster
