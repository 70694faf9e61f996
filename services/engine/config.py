"""Engine settings: which model, on which device, in what precision, and how big a KV
cache."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from services.engine.model_config import preset

# Kept in sync with services.engine.weights.quantize.QUANTIZATIONS, which imports torch
# kernels this module does not need.
QUANTIZATIONS = ("none", "int8", "int4", "w8a16", "w4a16", "w8a8", "w4a8")

DTYPES = {"float32": torch.float32, "float64": torch.float64,
          "bfloat16": torch.bfloat16, "float16": torch.float16}
ATTENTION_BACKENDS = ("auto", "torch", "triton")
KV_CACHE_DTYPES = ("auto", "bfloat16", "int8")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def resolve_device(name: str) -> torch.device:
    """``auto``: the first CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> str:
    """``auto``: bfloat16 on a GPU (half the bytes, tensor cores), float32 on the CPU
    (where bfloat16 matmuls are slow and the reference results are float32)."""
    if name == "auto":
        return "bfloat16" if device.type == "cuda" else "float32"
    return name


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on the CPU; or a DTYPES name
    device: str = "auto"  # auto: cuda when present, else cpu; or cpu, cuda, cuda:N
    attention_backend: str = "auto"  # auto: triton on CUDA, torch elsewhere
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: as many as kv_cache_bytes holds
    kv_cache_bytes: int = 1 << 30
    max_model_len: int | None = None  # None: the model's context length
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    prefill_chunk_size: int | None = None  # cap on one sequence's tokens per step
    # Cap on a step's prompt tokens while any sequence decodes (scheduler.py); None: none.
    max_prefill_tokens_with_decode: int | None = None
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's choice
    quantization: str = "none"  # int8/int4/w8a16/w4a16/w8a8/w4a8 (CPU): weights/quantize
    # The KV cache's element type. auto: the model's dtype; bfloat16 with a float32 model
    # on the CPU: half the KV bytes (memory, and decode attention's reads), K/V rounded
    # as they are written and widened to float32 as attention reads them; int8: about a
    # quarter, each (token, KV head) row quantized with its own scale (kernels/kv_int8.py).
    kv_cache_dtype: str = "auto"
    # Ranks the model is split over (services/engine/tp.py); rank r > 0 on cuda:<index + r>.
    tensor_parallel_size: int = 1
    # Decode steps replayed from CUDA graphs (services/engine/cuda_graphs.py); None: on
    # for CUDA, off elsewhere.
    cuda_graphs: bool | None = None
    # A shape preset (model_config.PRESETS) built with random weights instead of loading
    # ``model``; ``seed`` draws them (weights/random_init.py).
    random_weights: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, "
                             f"got {self.dtype!r}")
        if not _DEVICE.fullmatch(self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_bytes < 1:
            raise ValueError("kv_cache_bytes must be positive")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.prefill_chunk_size is not None and self.prefill_chunk_size < 1:
            raise ValueError("prefill_chunk_size must be >= 1")
        if (self.max_prefill_tokens_with_decode is not None
                and self.max_prefill_tokens_with_decode < 0):
            raise ValueError("max_prefill_tokens_with_decode must be >= 0")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError("num_threads must be >= 1")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        if self.cuda_graphs and self.torch_device.type != "cuda":
            raise ValueError("cuda_graphs needs a CUDA device")
        if self.random_weights is not None:
            preset(self.random_weights)  # ValueError naming the known presets
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, "
                             f"got {self.quantization!r}")
        if self.quantization != "none" and (self.torch_device.type != "cpu"
                                            or self.dtype_name != "float32"):
            raise ValueError(f"quantization {self.quantization} runs on device cpu with dtype "
                             "float32 only")
        self._check_kv_cache_dtype()

    def _check_kv_cache_dtype(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_dtype_name == self.dtype_name:
            return  # the model's own dtype: what every path takes
        # A cache of another type than the model's: only the CPU torch path converts.
        if self.torch_device.type != "cpu" or self.dtype_name != "float32":
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype} with dtype "
                             f"{self.dtype_name} on {self.torch_device.type}: a KV cache "
                             "of another type than the model's runs on device cpu with "
                             "dtype float32 only (on CUDA, dtype auto is bfloat16 already)")
        if self.attention_backend == "triton" or self.tensor_parallel_size != 1:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype} with a float32 model "
                             "runs with the torch attention backend and "
                             "tensor_parallel_size 1 only")

    @property
    def precision(self) -> str:
        """The dtype, the quantization when there is one, and the KV cache's dtype when
        it is not the model's (each changes KV bytes)."""
        out = self.dtype_name
        if self.quantization != "none":
            out += f"+{self.quantization}"
        if self.kv_dtype_name != self.dtype_name:
            out += f"+kv-{self.kv_dtype_name}"
        return out

    @property
    def use_cuda_graphs(self) -> bool:
        return self.torch_device.type == "cuda" if self.cuda_graphs is None else self.cuda_graphs

    @property
    def torch_device(self) -> torch.device:
        return resolve_device(self.device)

    def rank_device(self, rank: int) -> torch.device:
        """The device of tensor-parallel rank ``rank``: the next GPUs after the first."""
        device = self.torch_device
        if device.type != "cuda":
            return device
        return torch.device("cuda", (device.index or 0) + rank)

    @property
    def dtype_name(self) -> str:
        """The dtype ``auto`` stands for on this config's device (the fingerprint's)."""
        return resolve_dtype(self.dtype, self.torch_device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]

    @property
    def kv_dtype_name(self) -> str:
        """The KV cache's dtype: ``kv_cache_dtype``, or the model's for ``auto``."""
        return self.dtype_name if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The cache tensors' element type (int8: rows of values then a scale's bytes)."""
        return torch.int8 if self.kv_dtype_name == "int8" else DTYPES[self.kv_dtype_name]
