"""A sharded bfloat16 checkpoint loads tensor by tensor: the values are the files', and
the host's memory grows by about the model's size, never by a second copy of it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services.engine.model_config import ModelConfig
from services.engine.weights import expected_shapes, load_weights

# ~40 MB of bfloat16 in four shards: large enough that the interpreter's own noise
# (a few MB) does not decide the bound.
CFG = ModelConfig(architecture="llama", vocab_size=8192, hidden_size=512,
                  intermediate_size=1536, num_layers=4, num_heads=8, num_kv_heads=2,
                  head_dim=64, max_position_embeddings=256)
HF_CONFIG = {"model_type": "llama", "vocab_size": 8192, "hidden_size": 512,
             "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 8,
             "num_key_value_heads": 2, "max_position_embeddings": 256,
             "tie_word_embeddings": False}


def _write_sharded(root: Path, shards: int = 4) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=gen).to(torch.bfloat16)
               for name, shape in expected_shapes(CFG).items()}
    names = sorted(tensors)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(shards):
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(root / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"))
    (root / "config.json").write_text(json.dumps(HF_CONFIG))
    return tensors


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    return root, _write_sharded(root)


def test_sharded_bf16_loads_the_files_values(sharded):
    root, tensors = sharded
    loaded = load_weights(root, torch.bfloat16)
    assert loaded.tensors.keys() == tensors.keys()
    for name, t in tensors.items():
        assert loaded.tensors[name].dtype == torch.bfloat16
        assert torch.equal(loaded.tensors[name], t), name
    as_f32 = load_weights(root, torch.float32)  # cast as before: bf16 -> f32 is exact
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(as_f32.tensors[name], tensors[name].float())
    assert as_f32.digest == loaded.digest  # the digest is the files', not the dtype's


# VmHWM is this process's own peak: ru_maxrss would carry the parent's across exec.
_MEASURE = """
import sys, torch
from services.engine.weights import load_weights

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

before = status("VmRSS:")
loaded = load_weights(sys.argv[1], getattr(torch, sys.argv[2]))
for t in loaded.tensors.values():  # fault every page in: CPU tensors may map the file
    t.view(-1).view(torch.uint8)[::4096].sum()
size = sum(t.numel() * t.element_size() for t in loaded.tensors.values())
print(size, status("VmHWM:") - before, status("VmRSS:") - before)
"""


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_peak_host_memory_stays_near_the_model_size(sharded, dtype):
    """As loaded (bfloat16), and cast on the way (float32: twice the files' bytes, with
    no moment that holds every bfloat16 tensor and every float32 one at once)."""
    root, _ = sharded
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", _MEASURE, str(root), dtype], cwd=repo,
                          capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    size, peak, kept = map(int, proc.stdout.split())
    assert size > 30 << 20
    # What is kept is the loaded tensors themselves (plus the allocator's and the
    # kernel's rounding, which differ between machines: huge pages, arenas).
    assert size * 0.9 < kept < size * 1.5, f"RSS kept {kept / size:.2f}x the model's size"
    # Above that, the peak holds at most one shard's mapping (a quarter of the model) and
    # one tensor in flight. Whole shards loaded and then cast would add half the model
    # (float32); every shard kept mapped to the end, the whole model again (bfloat16).
    transient = peak - kept
    assert transient < 0.4 * size, f"a transient {transient / size:.2f}x the model's size"
