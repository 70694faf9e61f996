"""The Llama family in torch, on a flat token batch and a paged KV cache.

Covers Llama 2/3, SmolLM2, Mistral and Qwen2 from one config: RMSNorm, rotary
embeddings (with Llama 3 frequency scaling), grouped-query attention with optional q/k/v
bias, SwiGLU MLP, and tied or separate output embeddings. Weights use Hugging Face
names; q/k/v and gate/up are fused into one matmul each at load.

The wide projections (q/k/v, gate/up and the output head, whose outputs outnumber their
inputs) keep their weights transposed, ``[in, out]``: a batch-1 decode step is a
matrix-vector product, and the CPU BLAS streams an ``[in, out]`` matrix about twice as
fast as the ``[out, in]`` one ``nn.Linear`` holds (docs/benchmarks.md). A tied
embedding is looked up in that transposed head, so it is stored once.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.attention import AttentionBackend, AttentionMetadata
from services.engine.attention_ops import TORCH_OPS, LayerOps
from services.engine.model_config import ModelConfig, RopeScaling
from services.engine.tp import SINGLE, ParallelContext, ShardShape, shard_shape


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: LayerOps = TORCH_OPS,
                residual: torch.Tensor | None = None):
        """``(norm(x + residual), x + residual)``, or ``(norm(x), None)`` (``LayerOps``)."""
        return ops.rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, the band
    # between them interpolated smoothly.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    return torch.where(mid, blended, scaled)


class Rotary(nn.Module):
    """Rotary position embedding in the half-split layout Hugging Face weights expect.

    The cos/sin tables stay float32 whatever the model's dtype (bfloat16 tables lose
    the angle at long positions), so they are plain attributes, not buffers that
    ``model.to(dtype)`` would round; they follow the queries' device on first use.
    Built on the CPU, as Hugging Face builds them (float32 angles), even when the model
    is built on the meta device.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        with torch.device("cpu"):  # real tables even inside a meta-device build
            inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).float()
            pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
            freqs = torch.outer(pos, inv_freq)
            emb = torch.cat([freqs, freqs], dim=-1)
            self.cos, self.sin = emb.cos(), emb.sin()

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cos.device != device:
            self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        return self.cos, self.sin

    def forward(self, positions, q, k, ops: LayerOps = TORCH_OPS):
        cos, sin = self.tables(q.device)
        return ops.rotary(positions, q, k, cos, sin)


class WideLinear(nn.Module):
    """``y = x @ weight_t (+ bias)`` with the weight held ``[in, out]`` (see above)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return torch.matmul(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)


class Attention(nn.Module):
    """This rank's heads (all of them on one rank); see services/engine/tp.py."""

    def __init__(self, cfg: ModelConfig, shard: ShardShape, tp: ParallelContext) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = (
            shard.num_heads, shard.num_kv_heads, cfg.head_dim)
        self.q_size = shard.num_heads * cfg.head_dim
        self.kv_size = shard.num_kv_heads * cfg.head_dim
        self.qkv_proj = WideLinear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                   bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)

    def forward(self, x, positions, rotary, backend, k_cache, v_cache, meta):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k, backend.ops)
        out = backend.forward(q, k, v, k_cache, v_cache, meta)
        return self.tp.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: ShardShape, tp: ParallelContext) -> None:
        super().__init__()
        self.tp = tp
        self.inter = shard.intermediate
        self.gate_up_proj = WideLinear(cfg.hidden_size, 2 * shard.intermediate, bias=False)
        self.down_proj = nn.Linear(shard.intermediate, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.tp.all_reduce(self.down_proj(F.silu(gate).mul_(up)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: ShardShape, tp: ParallelContext) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, shard, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, shard, tp)

    def forward(self, x, residual, positions, rotary, backend, k_cache, v_cache, meta):
        """``x`` is the previous layer's MLP output and ``residual`` the stream before it
        (None on the first layer, where ``x`` is the stream): each norm adds the two
        first, in one kernel on the Triton backend. Returns the next ``(x, residual)``."""
        ops = backend.ops
        if residual is None:
            h, residual = self.input_layernorm(x, ops)[0], x
        else:
            h, residual = self.input_layernorm(x, ops, residual)
        h = self.self_attn(h, positions, rotary, backend, k_cache, v_cache, meta)
        h, residual = self.post_attention_layernorm(h, ops, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend,
                 tp: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.backend = backend
        self.tp = tp
        self.shard = shard = shard_shape(cfg, tp.rank, tp.world_size)
        # Tied: the transposed head doubles as the embedding table (``_embed``).
        # An empty table, not a random one: the weights are loaded next, and the random
        # init (normal_) would import torch._dynamo, seconds at every worker's start.
        self.embed_tokens = None if cfg.tie_word_embeddings else nn.Embedding(
            shard.vocab, cfg.hidden_size, _weight=torch.empty(shard.vocab, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, shard, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)
        self.lm_head = WideLinear(cfg.hidden_size, shard.vocab, bias=False)
        # A callable running all layers for small steps in fewer native calls, or None:
        # set by ModelRunner where kernels/cpu_layer.py takes the model; it answers None
        # for a step it does not take, which then runs layer by layer here.
        self.fused_layers = None

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        inside = None
        if self.tp.world_size > 1:  # vocab-parallel: this rank looks up its rows only
            local = input_ids - self.shard.vocab_start
            inside = (local >= 0) & (local < self.shard.vocab)
            input_ids = torch.where(inside, local, torch.zeros_like(local))
        if self.embed_tokens is not None:
            x = self.embed_tokens(input_ids)
        else:
            x = self.lm_head.weight_t.index_select(1, input_ids).t().contiguous()
        if inside is not None:
            x.masked_fill_(~inside.unsqueeze(1), 0)
            self.tp.all_reduce(x)
        return x

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        layer_hook: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Run T tokens; return float32 logits ``[len(logits_indices), vocab]``.

        ``kv_cache`` is (K, V), each ``[layers, blocks, block_size, kv_heads, head_dim]``.
        ``layer_hook(i)``, if given, runs once layer i's K/V for this step are in the
        cache (the prefill worker ships each layer while the next one computes).
        """
        k_all, v_all = kv_cache
        x, residual = self._embed(input_ids), None
        fused = None if self.fused_layers is None else self.fused_layers(
            x, positions, k_all, v_all, meta, layer_hook)
        if fused is not None:
            x, residual = fused
        else:
            for i, layer in enumerate(self.layers):
                x, residual = layer(x, residual, positions, self.rotary, self.backend,
                                    k_all[i], v_all[i], meta)
                if layer_hook is not None:
                    layer_hook(i)
        x, _ = self.norm(x.index_select(0, logits_indices), self.backend.ops,
                         residual.index_select(0, logits_indices))
        logits = self.tp.gather_last_dim(self.lm_head(x).float())
        return logits if self.tp.world_size == 1 else logits[:, :self.cfg.vocab_size]

    @classmethod
    def from_hf_weights(cls, cfg: ModelConfig, backend: AttentionBackend,
                        tensors: dict[str, torch.Tensor], *, tp: ParallelContext = SINGLE,
                        consume: bool = False) -> LlamaModel:
        """A model holding ``tensors`` themselves where the layout allows, no second copy.

        Built on the meta device (no memory, no random init), then each parameter is the
        given tensor (o/down projections, norms, an untied embedding) or the one fused or
        transposed from it. ``consume`` empties ``tensors`` as it goes, so an engine that
        loaded them for itself never holds two copies of a projection at once.
        """
        with torch.device("meta"):
            model = cls(cfg, backend, tp)
        model.rotary = Rotary(cfg)  # computed tables, not weights: build them for real
        model.load_hf_weights(tensors, assign=True, consume=consume)
        return model

    def load_hf_weights(self, tensors: dict[str, torch.Tensor], *, assign: bool = False,
                        consume: bool = False) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up; with ``assign``
        the parameters become those tensors (see ``from_hf_weights``)."""
        own = self.state_dict()
        loaded: dict[str, torch.Tensor] = {}

        def put(name: str, value: torch.Tensor) -> None:
            if name.endswith(".weight_t"):
                value = value.t()
            if own[name].shape != value.shape:
                raise ValueError(f"weight {name}: expected shape {tuple(own[name].shape)}, "
                                 f"got {tuple(value.shape)}")
            if assign:
                loaded[name] = value.contiguous()
            else:
                own[name].copy_(value)
                loaded[name] = own[name]

        def take(name: str) -> torch.Tensor:
            if name not in tensors:
                raise ValueError(f"missing weight {name}")
            return tensors.pop(name) if consume else tensors[name]

        with torch.no_grad():
            put("norm.weight", take("model.norm.weight"))
            if self.embed_tokens is None:
                put("lm_head.weight_t", take("model.embed_tokens.weight"))
            else:
                put("embed_tokens.weight", take("model.embed_tokens.weight"))
                put("lm_head.weight_t", take("lm_head.weight"))
            for i in range(self.cfg.num_layers):
                src, dst = f"model.layers.{i}.", f"layers.{i}."
                attn = src + "self_attn."
                put(dst + "self_attn.qkv_proj.weight_t", torch.cat(
                    [take(attn + f"{p}_proj.weight") for p in "qkv"]))
                if self.cfg.attention_bias:
                    put(dst + "self_attn.qkv_proj.bias", torch.cat(
                        [take(attn + f"{p}_proj.bias") for p in "qkv"]))
                put(dst + "self_attn.o_proj.weight", take(attn + "o_proj.weight"))
                put(dst + "mlp.gate_up_proj.weight_t", torch.cat(
                    [take(src + "mlp.gate_proj.weight"), take(src + "mlp.up_proj.weight")]))
                put(dst + "mlp.down_proj.weight", take(src + "mlp.down_proj.weight"))
                put(dst + "input_layernorm.weight", take(src + "input_layernorm.weight"))
                put(dst + "post_attention_layernorm.weight",
                    take(src + "post_attention_layernorm.weight"))
        missing = set(own) - loaded.keys()
        if missing:
            raise ValueError(f"weights not provided for: {sorted(missing)[:5]}")
        if assign:
            self.load_state_dict(loaded, assign=True)
        if consume:
            tensors.clear()
