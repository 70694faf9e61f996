"""Load a GGUF file: metadata becomes a ``ModelConfig``, tensors are dequantized to float.

Three things differ from a Hugging Face checkpoint and are undone here:

* names: ``blk.{i}.attn_q.weight`` becomes ``model.layers.{i}.self_attn.q_proj.weight``
  and so on (``_GLOBAL_NAMES``, ``_LAYER_NAMES``); an unknown tensor name is refused;
* shapes: GGUF lists dimensions innermost first, but the reader's arrays are already
  in row-major [out, in] order, which is the Hugging Face layout;
* Q/K row order: for llama and mistral, llama.cpp's converter permutes the rows of the
  Q and K projections so that RoPE rotates adjacent pairs; ``unpermute_rows`` restores
  the half-split order that Hugging Face (and this engine) use. Qwen2 is not permuted.

Llama 3 GGUFs carry RoPE scaling as a ``rope_freqs.weight`` tensor of per-frequency
divisors rather than as parameters. We rebuild the ``llama3`` ``RopeScaling`` from it
and refuse the file (``UnsupportedModelError``) if the rebuilt parameters do not
reproduce every stored divisor; the tensor itself is not returned.
"""

from __future__ import annotations

import hashlib
import math
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from services.engine.model_config import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    RopeScaling,
    UnsupportedModelError,
)
from services.engine.weights import CorruptWeightsError, LoadedWeights, check_tensors

_T = gguf.GGMLQuantizationType
# Types we dequantize: plain floats, the legacy block quants and the K-quants. The
# i-quants and ternary types also dequantize in gguf, but slowly and untested here.
ALLOWED_TYPES = frozenset({_T.F32, _T.F16, _T.BF16, _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1,
                           _T.Q8_0, _T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K})

_PERMUTED_ARCHITECTURES = frozenset({"llama", "mistral"})
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)")
_ROPE_FREQS = "rope_freqs.weight"
_SAMPLE_BYTES = 4096  # hashed from the start of each tensor, see _digest
_REQUIRED = object()


def load_gguf(path: Path, dtype: torch.dtype) -> LoadedWeights:
    """Read the GGUF at ``path`` into a ``LoadedWeights`` with tensors in ``dtype``.

    Raises ``CorruptWeightsError`` naming the file when it cannot be parsed or lacks a
    needed key or tensor, and ``UnsupportedModelError`` for an architecture, tensor
    name or tensor type the engine does not handle.
    """
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, KeyError, IndexError, OverflowError, UnicodeDecodeError) as exc:
        raise CorruptWeightsError(f"{path}: not a readable GGUF file ({exc})") from exc
    by_name = {t.name: t for t in reader.tensors}
    config = config_from_gguf(reader, path, by_name)
    permute_heads = {"self_attn.q_proj": config.num_heads, "self_attn.k_proj": config.num_kv_heads}
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name == _ROPE_FREQS:
            continue
        name, part = hf_name(t.name)
        if name is None:
            raise UnsupportedModelError(f"{path}: unexpected tensor {t.name!r} "
                                        f"in a {config.architecture} model")
        array = dequantize(t, path)
        if config.architecture in _PERMUTED_ARCHITECTURES and part in permute_heads:
            array = unpermute_rows(array, permute_heads[part], path, t.name)
        tensors[name] = torch.from_numpy(array).to(dtype)
    check_tensors(config, tensors, path)
    return LoadedWeights(config=config, tensors=tensors, digest=_digest(reader, path),
                         tokenizer_dir=str(path.parent), gguf_file=path.name)


def hf_name(gguf_name: str) -> tuple[str | None, str | None]:
    """``blk.3.attn_q.weight`` -> (``model.layers.3.self_attn.q_proj.weight``,
    ``self_attn.q_proj``); (None, None) for a name with no Hugging Face counterpart."""
    base, _, kind = gguf_name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None, None
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}", _GLOBAL_NAMES[base]
    match = _LAYER_RE.fullmatch(base)
    if match is None or match[2] not in _LAYER_NAMES:
        return None, None
    part = _LAYER_NAMES[match[2]]
    return f"model.layers.{match[1]}.{part}.{kind}", part


def dequantize(tensor: gguf.ReaderTensor, path: Path) -> np.ndarray:
    """A writable float32 array in [out, in] order (1-D for norms and biases)."""
    if tensor.tensor_type not in ALLOWED_TYPES:
        raise UnsupportedModelError(f"{path}: tensor {tensor.name} has type "
                                    f"{tensor.tensor_type.name}, which is not supported")
    try:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise UnsupportedModelError(f"{path}: cannot dequantize tensor {tensor.name} of type "
                                    f"{tensor.tensor_type.name}") from exc
    except ValueError as exc:
        raise CorruptWeightsError(f"{path}: tensor {tensor.name}: {exc}") from exc
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if array.size != math.prod(shape):
        raise CorruptWeightsError(f"{path}: tensor {tensor.name} holds {array.size} values, "
                                  f"its shape {shape} needs {math.prod(shape)}")
    # F32 comes back as a view of the read-only file mapping; torch needs its own copy.
    if not array.flags.writeable:
        array = np.array(array, dtype=np.float32)
    return array.reshape(shape)


def unpermute_rows(w: np.ndarray, n_head: int, path: Path, name: str) -> np.ndarray:
    """Undo llama.cpp's ``w.reshape(n_head, 2, d // 2, ...).swapaxes(1, 2)``.

    Within each head, GGUF stores the rows of rotary pair j at 2j and 2j + 1; Hugging
    Face stores them at j and j + d/2 (d = head_dim). Works for weights and biases.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise CorruptWeightsError(f"{path}: tensor {name} has {rows} rows, "
                                  f"not a multiple of 2 x {n_head} heads")
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def config_from_gguf(reader: gguf.GGUFReader, path: Path,
                     by_name: dict[str, gguf.ReaderTensor]) -> ModelConfig:
    """Build a ``ModelConfig`` from GGUF metadata (and, where metadata is silent, from
    which tensors are present: tied output, attention bias, rope_freqs, vocab size)."""
    def meta(key: str, default: Any = _REQUIRED) -> Any:
        field = reader.get_field(key)
        if field is None:
            if default is _REQUIRED:
                raise CorruptWeightsError(f"{path}: metadata key {key} is missing")
            return default
        try:
            return field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            raise CorruptWeightsError(f"{path}: metadata key {key} is malformed") from exc

    arch = meta("general.architecture")
    if not isinstance(arch, str) or arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(f"{path}: unsupported architecture {arch!r}; "
                                    f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
    hidden = int(meta(f"{arch}.embedding_length"))
    heads = int(meta(f"{arch}.attention.head_count"))
    kv_heads = _uniform(meta(f"{arch}.attention.head_count_kv", heads), "head_count_kv", path)
    head_dim = int(meta(f"{arch}.attention.key_length", 0)
                   or meta(f"{arch}.rope.dimension_count", 0) or hidden // max(heads, 1))
    for key in ("rope.dimension_count", "attention.value_length"):
        if int(meta(f"{arch}.{key}", head_dim)) != head_dim:
            raise UnsupportedModelError(f"{path}: {arch}.{key} differs from head_dim {head_dim}")
    rope_theta = _f32(meta(f"{arch}.rope.freq_base", 10000.0))
    scaling_type = meta(f"{arch}.rope.scaling.type", "none")
    if scaling_type != "none" and _f32(meta(f"{arch}.rope.scaling.factor", 1.0)) != 1.0:
        raise UnsupportedModelError(f"{path}: rope scaling type {scaling_type!r} is not supported")
    rope_scaling = None
    if _ROPE_FREQS in by_name:
        factors = dequantize(by_name[_ROPE_FREQS], path).astype(np.float64)
        rope_scaling = llama3_scaling(factors, rope_theta, head_dim,
                                      meta(f"{arch}.rope.scaling.original_context_length", None),
                                      path)
    vocab = meta(f"{arch}.vocab_size", None)
    tokens, embd = reader.get_field("tokenizer.ggml.tokens"), by_name.get("token_embd.weight")
    if vocab is None and tokens is not None:
        vocab = len(tokens.data)
    elif vocab is None and embd is not None:
        vocab = int(embd.shape[-1])  # GGUF dims run innermost first: [hidden, vocab]
    eos_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token = meta(f"tokenizer.ggml.{key}", None)
        if token is not None and int(token) not in eos_ids:
            eos_ids.append(int(token))
    bos = meta("tokenizer.ggml.bos_token_id", None)
    try:
        return ModelConfig(
            architecture=arch,
            vocab_size=int(vocab or 0),
            hidden_size=hidden,
            intermediate_size=_uniform(meta(f"{arch}.feed_forward_length"), "ffn length", path),
            num_layers=int(meta(f"{arch}.block_count")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_f32(meta(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(meta(f"{arch}.context_length", 2048)),
            tie_word_embeddings="output.weight" not in by_name,
            attention_bias="blk.0.attn_q.bias" in by_name,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(eos_ids),
        )
    except UnsupportedModelError:
        raise
    except (TypeError, ValueError) as exc:
        raise CorruptWeightsError(f"{path}: inconsistent model metadata ({exc})") from exc


def llama3_scaling(factors: np.ndarray, theta: float, head_dim: int,
                   original_ctx: int | None, path: Path) -> RopeScaling | None:
    """Rebuild ``llama3`` RoPE scaling from llama.cpp's per-frequency divisors.

    The llama3 rule divides frequency i by 1 below a short-wavelength threshold, by
    ``factor`` above a long one, and in between 1/divisor is linear in 1/wavelength.
    Only the two thresholds matter, so (original context, low factor, high factor) is
    known up to scale: we pin the context from metadata when present, otherwise
    low_freq_factor = 1 (as in every Llama 3.x). With fewer than two divisors between
    the thresholds there is nothing to fit, and Llama 3's published values are tried.
    Returns None when every divisor is 1; raises ``UnsupportedModelError`` when the
    rebuilt parameters do not reproduce ``factors``.
    """
    if factors.shape != (head_dim // 2,):
        raise CorruptWeightsError(f"{path}: {_ROPE_FREQS} has shape {factors.shape}, "
                                  f"expected ({head_dim // 2},)")
    if np.allclose(factors, 1.0, rtol=0, atol=1e-6):
        return None
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    factor = float(factors.max())
    tol = 1e-5 * factor
    between = (factors > 1 + tol) & (factors < factor - tol)
    ctx, low, high = float(original_ctx or 8192), 1.0, 4.0
    if between.sum() >= 2 and factor > 1:
        smooth = (1 / factors[between] - 1 / factor) / (1 - 1 / factor)
        # smooth = ctx / (high - low) / wavelen - low / (high - low)
        slope, intercept = np.polyfit(1 / wavelen[between], smooth, 1)
        if slope > 0 > intercept:
            if original_ctx:
                span = ctx / slope
                low = -intercept * span
            else:
                span = -1 / intercept
                ctx = slope * span
            high = low + span
    scaling = RopeScaling(factor=_round(factor), low_freq_factor=_round(low),
                          high_freq_factor=_round(high),
                          original_max_position_embeddings=round(ctx))
    if not np.allclose(llama3_divisors(scaling, wavelen), factors, rtol=1e-4, atol=0):
        raise UnsupportedModelError(f"{path}: {_ROPE_FREQS} does not follow llama3 rope scaling")
    return scaling


def llama3_divisors(scaling: RopeScaling, wavelen: np.ndarray) -> np.ndarray:
    """The per-frequency divisors that ``scaling`` applies, as llama.cpp stores them."""
    ctx = scaling.original_max_position_embeddings
    low, high, factor = scaling.low_freq_factor, scaling.high_freq_factor, scaling.factor
    smooth = (ctx / wavelen - low) / (high - low)
    between = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < ctx / high, 1.0, np.where(wavelen > ctx / low, factor, between))


def _uniform(value: Any, what: str, path: Path) -> int:
    """Per-layer metadata may be a list; this engine needs every layer alike."""
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise UnsupportedModelError(f"{path}: {what} varies by layer ({value})")
        value = value[0]
    return int(value)


def _f32(value: Any) -> float:
    """GGUF stores these as float32; the shortest float32 repr gives back 1e-05, not
    9.99999974e-06, so configs compare equal to their Hugging Face originals."""
    return float(str(np.float32(value)))


def _round(value: float) -> float:
    return float(f"{value:.5g}")


def _digest(reader: gguf.GGUFReader, path: Path) -> str:
    """Hash the file size, the whole header (metadata and tensor table), and the first
    bytes of every tensor: cheap, and different for two fine-tunes of one model."""
    h = hashlib.sha256()
    h.update(str(path.stat().st_size).encode())
    h.update(reader.data[: reader.data_offset].tobytes())
    for t in reader.tensors:
        end = t.data_offset + min(t.n_bytes, _SAMPLE_BYTES)
        h.update(reader.data[t.data_offset: end].tobytes())
    return h.hexdigest()[:32]
