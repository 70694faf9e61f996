"""The engine keeps one copy of its weights: the model's."""

from __future__ import annotations

import torch

from common.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.weights import load_weights


def test_engine_holds_no_second_copy_of_the_weights(tiny_dirs):
    weights = load_weights(tiny_dirs["llama"])
    tensors = dict(weights.tensors)
    engine = LLMEngine(EngineConfig(model=str(tiny_dirs["llama"]), dtype="float32",
                                    num_kv_blocks=16), weights)
    assert engine.weights.tensors == {}
    assert engine.weights.digest == weights.digest
    layer = engine.model.layers[0]
    # Layouts the model keeps as given are the loader's own tensors, not copies.
    for name, param in (("model.layers.0.self_attn.o_proj.weight", layer.self_attn.o_proj.weight),
                        ("model.layers.0.mlp.down_proj.weight", layer.mlp.down_proj.weight),
                        ("model.norm.weight", engine.model.norm.weight)):
        assert param.data_ptr() == tensors[name].data_ptr(), name
    # A caller's dict is left as it was; fused and transposed weights hold its values.
    assert weights.tensors.keys() == tensors.keys()
    q, k, v = (tensors[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(layer.self_attn.qkv_proj.weight_t, torch.cat([q, k, v]).t())
    assert not any(p.is_meta for p in engine.model.parameters())
    assert not any(b.is_meta for b in engine.model.buffers())


def test_engine_that_loads_its_own_weights_frees_them(tiny_dirs):
    engine = LLMEngine(EngineConfig(model=str(tiny_dirs["llama"]), dtype="float64",
                                    num_kv_blocks=16))
    assert engine.weights.tensors == {}
    rotary = engine.model.rotary
    assert rotary.cos.shape[0] == engine.model_config.max_position_embeddings
    assert torch.equal(rotary.cos[0], torch.ones_like(rotary.cos[0]))
    out = engine.generate([[1, 5, 9, 7]], SamplingParams(max_tokens=4, temperature=0.0,
                                                          ignore_eos=True))
    assert len(out[0].token_ids) == 4
