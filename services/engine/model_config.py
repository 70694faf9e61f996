"""The shape of a Llama-family model, read from a Hugging Face config or GGUF metadata."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

# Architectures the engine's one model class covers. Qwen2 is Llama plus q/k/v bias;
# Mistral is Llama with (optionally) a sliding window we do not use at these lengths.
SUPPORTED_ARCHITECTURES = frozenset({"llama", "mistral", "qwen2"})
RANDOM_PREFIX = "random-"  # of the digest and fingerprint of randomly initialised weights


class UnsupportedModelError(ValueError):
    """The weights describe a model this engine cannot run."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3 frequency-dependent RoPE scaling (``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("model config: num_heads must be a multiple of num_kv_heads")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x keys)."""
        arch = cfg.get("model_type", "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {arch!r}; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        # transformers 5 folds rope_theta and rope_scaling into rope_parameters.
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        elif rope_type not in ("default", None):
            raise UnsupportedModelError(f"unsupported rope_type {rope_type!r}")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def fingerprint(self, weights_digest: str, dtype: str, block_size: int) -> str:
        """Everything that changes KV bytes: a block is never shared across fingerprints.

        Random weights (a digest starting ``random-``) give a fingerprint that starts
        ``random-`` too, so logs and the conductor's refusals say what a worker holds.
        """
        h = hashlib.sha256()
        for part in (self.to_json(), weights_digest, dtype, str(block_size)):
            h.update(part.encode())
            h.update(b"\0")
        prefix = RANDOM_PREFIX if weights_digest.startswith(RANDOM_PREFIX) else ""
        return prefix + h.hexdigest()[:32]


# Llama 3.1's long-context RoPE scaling, as its public config.json states it.
LLAMA31_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=8192)
_LLAMA3_8B = dict(architecture="llama", vocab_size=128256, hidden_size=4096,
                  intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                  head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                  bos_token_id=128000, eos_token_ids=(128001,))

# Shapes a model can be built in with random weights (``weights/random_init.py``), for
# benchmarks that need no download and tests that need no files.
PRESETS: dict[str, ModelConfig] = {
    # Meta-Llama-3-8B: 8k context, plain RoPE.
    "llama-3-8b": ModelConfig(**_LLAMA3_8B, max_position_embeddings=8192),
    # Llama-3.1-8B: the same weights' shape, 128k context with Llama 3 RoPE scaling.
    "llama-3.1-8b": ModelConfig(**_LLAMA3_8B, max_position_embeddings=131072,
                                rope_scaling=LLAMA31_SCALING),
    # A few hundred thousand parameters in the Llama 3.1 layout (GQA 2, scaled RoPE):
    # what the CPU tests build.
    "tiny": ModelConfig(architecture="llama", vocab_size=512, hidden_size=64,
                        intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=16, rope_theta=500000.0, max_position_embeddings=512,
                        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64),
                        bos_token_id=256, eos_token_ids=(257,)),
}


def preset(name: str) -> ModelConfig:
    """The shape preset ``name``; ``ValueError`` naming the known ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: "
                         f"{', '.join(sorted(PRESETS))}") from None
