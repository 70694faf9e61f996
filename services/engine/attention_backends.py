"""The attention backend registry: which ``AttentionBackend`` an engine runs.

``torch`` (``TorchAttention``) runs anywhere; ``triton`` (``TritonAttention``, the
kernels in ``kernels/``) on CUDA. ``auto`` takes triton on CUDA when it is installed.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from services.engine.attention import AttentionBackend, TorchAttention


def resolve_attention_backend(name: str, device_type: str, *, has_triton: bool,
                              interpret: bool) -> str:
    """Which backend ``name`` (auto, torch or triton) means on ``device_type``.

    ``auto`` is triton on CUDA when triton is installed, torch otherwise. Asking for
    triton without the package, or on the CPU outside Triton's interpreter
    (``TRITON_INTERPRET=1``), is a ``ValueError``: the kernels could not run.
    """
    if name == "auto":
        return "triton" if device_type == "cuda" and has_triton else "torch"
    if name == "torch":
        return "torch"
    if name != "triton":
        raise ValueError(f"attention backend must be auto, torch or triton, got {name!r}")
    if not has_triton:
        raise ValueError("attention_backend=triton needs the triton package "
                         "(pip install 'pdserve[gpu]')")
    if device_type != "cuda" and not interpret:
        raise ValueError("attention_backend=triton runs on CUDA, or on the CPU only in "
                         "Triton's interpreter (TRITON_INTERPRET=1)")
    return "triton"


def make_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend :func:`resolve_attention_backend` picks here; the Triton one is
    imported only when picked, so the engine runs without triton installed."""
    chosen = resolve_attention_backend(
        name, device.type, has_triton=importlib.util.find_spec("triton") is not None,
        interpret=os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))
    if chosen == "torch":
        return TorchAttention()
    from services.engine.attention_triton import TritonAttention

    return TritonAttention()
