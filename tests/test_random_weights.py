"""A named shape with random weights: built on the device and dtype asked for, the same
weights and fingerprint from the same seed, a fingerprint that says it is random, and a
byte-level tokenizer that carries text in and out."""

from __future__ import annotations

import pytest
import torch

from common.sampling_params import SamplingParams
from common.tokenizer import TextTokenizer
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.model_config import PRESETS, preset
from services.engine.weights import expected_shapes
from services.engine.weights.random_init import random_weights
from services.engine.weights.source import weights_for
from services.worker.settings import WorkerSettings


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))


def test_llama3_8b_preset_has_the_public_shape():
    cfg = preset("llama-3-8b")
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.intermediate_size, cfg.vocab_size, cfg.head_dim) == (
        4096, 32, 32, 8, 14336, 128256, 128)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling is None
    long = preset("llama-3.1-8b")
    assert long.rope_scaling is not None and long.rope_scaling.factor == 8.0
    assert long.max_position_embeddings == 131072
    params = sum(torch.Size(s).numel() for s in expected_shapes(cfg).values())
    assert 8.0e9 < params < 8.1e9  # 8.03 B, as published
    with pytest.raises(ValueError, match="known: llama-3-8b"):
        preset("llama-9b")
    with pytest.raises(ValueError, match="unknown model preset"):
        EngineConfig(random_weights="nope")
    with pytest.raises(ValueError, match="unknown model preset"):
        WorkerSettings(random_weights="nope")


def test_same_seed_same_weights_other_seed_other_weights():
    a = random_weights("tiny", 7, dtype=torch.bfloat16)
    b = random_weights("tiny", 7, dtype=torch.bfloat16)
    c = random_weights("tiny", 8, dtype=torch.bfloat16)
    assert a.tensors.keys() == expected_shapes(PRESETS["tiny"]).keys()
    name = "model.layers.1.self_attn.q_proj.weight"
    assert a.tensors[name].dtype == torch.bfloat16 and a.tensors[name].device.type == "cpu"
    assert all(torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors)
    assert not torch.equal(a.tensors[name], c.tensors[name])
    assert torch.equal(a.tensors["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    assert a.digest == "random-tiny-seed7-cpu" and c.digest != a.digest


def test_meta_device_build_allocates_nothing():
    w = random_weights("llama-3-8b", 0, dtype=torch.bfloat16, device="meta")
    assert all(t.is_meta for t in w.tensors.values())
    assert w.tensors["lm_head.weight"].shape == (128256, 4096)


def _engine(seed: int, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(random_weights="tiny", seed=seed, device="cpu",
                                  dtype="float32", num_kv_blocks=32, **kw))


def test_two_engines_with_one_seed_agree_token_for_token():
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[256, 72, 101, 108, 108, 111], [256] + list(range(300, 340))]
    a, b, c = _engine(3), _engine(3), _engine(4)
    assert a.fingerprint == b.fingerprint != c.fingerprint
    assert a.fingerprint.startswith("random-") and len(a.fingerprint) == 39
    out_a = [x.token_ids for x in a.generate(prompts, params)]
    assert out_a == [x.token_ids for x in b.generate(prompts, params)]
    assert out_a != [x.token_ids for x in c.generate(prompts, params)]
    assert all(len(t) == 12 for t in out_a)
    assert len(set(out_a[0])) > 1  # not a degenerate model: tokens vary
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters(),
                                                 strict=True))
    # The weights are the random ones, in the engine's layout: no second copy kept.
    assert a.weights.tensors == {} and a.weights.digest == "random-tiny-seed3-cpu"


def test_random_engine_serves_text_through_the_byte_tokenizer():
    engine = _engine(0)
    [out] = engine.generate(["héllo ✓"], SamplingParams(max_tokens=4, temperature=0.0,
                                                         ignore_eos=True))
    assert out.prompt_token_ids == [256, *"héllo ✓".encode()]
    assert isinstance(out.text, str)
    gateway = TextTokenizer.from_dir(engine.weights.tokenizer_dir)  # what the gateway loads
    assert gateway.encode("héllo ✓") == out.prompt_token_ids
    assert gateway.vocab_size == 512 and gateway.eos_token_id == 257
    assert gateway.decode([104, 300, 257, 105]) == "h<|t300|>i"
    chat = gateway.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|begin_of_text|><|user|>\nhi\n<|assistant|>\n"


def test_weights_for_follows_the_config():
    cfg = EngineConfig(random_weights="tiny", seed=1, device="cpu", dtype="bfloat16")
    w = weights_for(cfg)
    assert w.tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert w.digest == "random-tiny-seed1-cpu"


def test_worker_settings_reach_the_engine_config():
    from services.worker.server import build_engine

    s = WorkerSettings(random_weights="tiny", random_seed=5, device="cpu", dtype="float32",
                       cuda_graphs="off", kv_cache_mib=1, max_model_len=64)
    engine = build_engine(s)
    assert engine.config.random_weights == "tiny" and engine.config.seed == 5
    assert engine.config.cuda_graphs is False and engine.executor.runner.graphs is None
    assert engine.fingerprint == _engine(5).fingerprint
    assert WorkerSettings().use_cuda_graphs is None
    assert WorkerSettings(cuda_graphs="on").use_cuda_graphs is True
    with pytest.raises(ValueError, match="cuda_graphs on needs a CUDA device"):
        WorkerSettings(cuda_graphs="on", device="cpu")
    with pytest.raises(ValueError, match="cuda_graphs must be"):
        WorkerSettings(cuda_graphs="yes")
