"""Tiny random-weight Llama-family models written to disk, and a plain greedy reference."""

from __future__ import annotations

from pathlib import Path

import torch

ARCHS = ("llama", "qwen2", "llama3")


def make_tiny_model(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a small random model in Hugging Face format; returns its directory."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, initializer_range=0.15, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
    common.update(overrides)
    if arch == "qwen2":
        config, cls = Qwen2Config(**common), Qwen2ForCausalLM
    elif arch == "llama3":
        common.setdefault("rope_theta", 500000.0)
        config = LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        cls = LlamaForCausalLM
    else:
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    torch.manual_seed(seed)
    model = cls(config)
    if arch == "qwen2":  # give the q/k/v biases real values, not zeros
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(path)
    return path


def load_reference(path: Path, dtype=torch.float64):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding by full recomputation each step: no cache, nothing clever."""
    ids = list(prompt)
    out = []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1]
        token = int(logits.argmax())
        out.append(token)
        ids.append(token)
    return out


def random_prompts(lengths, vocab: int = 256, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
