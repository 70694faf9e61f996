"""Device, dtype and attention-backend settings, and the engine on the Triton backend.

Without CUDA the Triton backend runs in Triton's interpreter (TRITON_INTERPRET=1, set
here before any kernel is defined).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from common.sampling_params import SamplingParams
from services.engine.attention import TorchAttention
from services.engine.attention_backends import resolve_attention_backend
from services.engine.config import EngineConfig
from services.worker.settings import WorkerSettings

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.parametrize("name,device,has,interp,want", [
    ("auto", "cuda", True, False, "triton"),
    ("auto", "cuda", False, False, "torch"),   # no triton: the torch path still serves
    ("auto", "cpu", True, True, "torch"),      # the interpreter is never picked by itself
    ("torch", "cuda", True, False, "torch"),
    ("triton", "cuda", True, False, "triton"),
    ("triton", "cpu", True, True, "triton"),
])
def test_backend_selection(name, device, has, interp, want):
    assert resolve_attention_backend(name, device, has_triton=has, interpret=interp) == want


@pytest.mark.parametrize("name,device,has,interp,match", [
    ("triton", "cuda", False, False, "triton package"),
    ("triton", "cpu", True, False, "TRITON_INTERPRET"),
    ("flash", "cuda", True, False, "auto, torch or triton"),
])
def test_backend_selection_refuses_what_cannot_run(name, device, has, interp, match):
    with pytest.raises(ValueError, match=match):
        resolve_attention_backend(name, device, has_triton=has, interpret=interp)


def test_device_and_dtype_settings():
    cpu = EngineConfig(device="cpu")
    assert cpu.torch_device == torch.device("cpu") and cpu.torch_dtype == torch.float32
    assert cpu.dtype_name == "float32"  # the fingerprint is the same as before "auto"
    gpu = EngineConfig(device="cuda:1")
    assert gpu.torch_device == torch.device("cuda:1") and gpu.torch_dtype == torch.bfloat16
    assert EngineConfig(device="cuda", dtype="float16").torch_dtype == torch.float16
    assert EngineConfig(dtype="float64").torch_dtype == torch.float64
    auto = EngineConfig()
    assert auto.torch_device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    for bad in ({"device": "gpu"}, {"device": "cuda:x"}, {"dtype": "int8"},
                {"attention_backend": "flash"}):
        with pytest.raises(ValueError):
            EngineConfig(**bad)
    with pytest.raises(ValueError, match="attention_backend"):
        WorkerSettings(attention_backend="flash")
    assert WorkerSettings().device == "auto"


def test_cpu_engine_defaults_to_torch_attention(tiny_dirs, make_engine):
    engine = make_engine(tiny_dirs["llama"], num_kv_blocks=16)
    if not torch.cuda.is_available():
        assert isinstance(engine.model.backend, TorchAttention)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("arch", ["llama", "llama3"])
def test_triton_backend_gives_the_torch_backends_greedy_tokens(arch, tiny_dirs, make_engine):
    from services.engine.attention_triton import TritonAttention

    prompts = [[1, 5, 9, 200, 17, 3, 3, 8, 40, 41, 42, 7, 6, 5, 4, 3, 2, 100, 101],
               [1, 5, 9, 200, 17, 3, 3, 8, 40, 41, 42, 7, 6, 5, 4, 3, 2, 100, 9, 9],  # shares
               [1, 77]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        # Small chunks: later chunks attend to a cached prefix across block boundaries.
        engine = make_engine(tiny_dirs[arch], dtype="float32", block_size=4,
                             num_kv_blocks=64, prefill_chunk_size=7,
                             attention_backend=backend)
        if backend == "triton":
            assert isinstance(engine.model.backend, TritonAttention)
        tokens[backend] = [c.token_ids for c in engine.generate(prompts, params)]
    assert tokens["triton"] == tokens["torch"]


@pytest.mark.parametrize("q_len,heads,kv_heads", [(129, 9, 3), (200, 4, 4), (320, 8, 2)])
def test_banded_causal_prefill_equals_one_causal_call(q_len, heads, kv_heads):
    """A fresh prompt longer than two bands attends band by band (attention.CAUSAL_BAND):
    the same outputs as one causal call over the whole prompt, to float32 rounding."""
    from services.engine import attention

    torch.manual_seed(q_len)
    q = torch.randn(q_len, heads, 64)
    k, v = torch.randn(q_len, kv_heads, 64), torch.randn(q_len, kv_heads, 64)
    got = attention._prefill_attention(q, k, v, q_len)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        is_causal=True, enable_gqa=heads != kv_heads)[0].transpose(0, 1)
    assert q_len > 2 * attention.CAUSAL_BAND
    assert got.shape == (q_len, heads, 64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Each query sees only keys up to itself: changing the last key moves only the last row.
    k2 = k.clone()
    k2[-1] += 1.0
    moved = (attention._prefill_attention(q, k2, v, q_len) - got).abs().amax(dim=(1, 2))
    assert torch.all(moved[:-1] == 0) and moved[-1] > 0
