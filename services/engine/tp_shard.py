"""One rank's slice of a model's Hugging Face-named tensors (see services/engine/tp.py).

The slices keep Hugging Face names and layouts, only fewer rows or columns, so the
model's own loader (``LlamaModel.load_hf_weights``) fuses and copies them unchanged.
Every slice is a copy: the full tensors can be dropped once a rank has its shard.
"""

from __future__ import annotations

import torch

from services.engine.model_config import ModelConfig
from services.engine.tp import shard_shape


def _rows(t: torch.Tensor, start: int, n: int) -> torch.Tensor:
    return t[start:start + n].clone()


def _cols(t: torch.Tensor, start: int, n: int) -> torch.Tensor:
    return t[:, start:start + n].clone()


def _vocab_rows(t: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """Rows ``[start, start + n)``, zero-padded past the vocabulary's end."""
    out = t.new_zeros((n, *t.shape[1:]))
    part = t[start:start + n]
    out[:part.shape[0]] = part
    return out


def shard_hf_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig, rank: int,
                     world_size: int) -> dict[str, torch.Tensor]:
    """The tensors rank ``rank`` of ``world_size`` holds, under the same names."""
    s = shard_shape(cfg, rank, world_size)
    hd = cfg.head_dim
    q = (s.head_start * hd, s.num_heads * hd)
    kv = (s.kv_head_start * hd, s.num_kv_heads * hd)
    inter = (s.inter_start, s.intermediate)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        leaf = name.rsplit(".", 2)[-2:]
        proj = leaf[0]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = _vocab_rows(t, s.vocab_start, s.vocab)
        elif proj == "q_proj":
            out[name] = _rows(t, *q)
        elif proj in ("k_proj", "v_proj"):
            out[name] = _rows(t, *kv)
        elif proj == "o_proj":
            out[name] = _cols(t, *q)
        elif proj in ("gate_proj", "up_proj"):
            out[name] = _rows(t, *inter)
        elif proj == "down_proj":
            out[name] = _cols(t, *inter)
        else:  # norms: every rank holds them whole
            out[name] = t
    return out
