"""Load a Hugging Face model directory: ``config.json`` plus one or more ``*.safetensors``.

Sharded checkpoints need no index file: every ``*.safetensors`` in the directory is read
and a tensor name appearing in two files is an error. Tensors go straight to the device
and dtype asked for, one at a time: a bfloat16 checkpoint bound for a GPU never sits on
the host whole, nor in float32. Tensors keep their names; the one
change is that ``lm_head.weight`` is dropped when the config ties it to the embedding.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from services.engine.model_config import ModelConfig, UnsupportedModelError
from services.engine.weights import CorruptWeightsError, LoadedWeights, check_tensors

# Bytes hashed from the start of each tensor: enough to tell two checkpoints with the
# same layout apart, small enough that the digest costs nothing next to the load.
_SAMPLE_BYTES = 4096
_CPU = torch.device("cpu")


def load_hf_dir(directory: Path, dtype: torch.dtype,
                device: torch.device = _CPU) -> LoadedWeights:
    """Read ``directory`` into a ``LoadedWeights`` with tensors on ``device`` in ``dtype``.

    Shard by shard, tensor by tensor (``safe_open``): each tensor is read from the
    file's mapping, moved to ``device`` and cast there, so the host holds at most one
    tensor in flight besides what it keeps (nothing, on a GPU) and one shard's mapping.

    Raises ``FileNotFoundError`` without ``config.json`` or any ``*.safetensors``,
    ``UnsupportedModelError`` for an architecture the engine lacks, and
    ``CorruptWeightsError`` naming the file for unreadable files or missing tensors.
    """
    config = read_config(directory / "config.json")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors files")
    digest = _digest(files)  # checks every header before any tensor is read
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt", device=str(device)) as shard:
                for name in shard.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if name in tensors:
                        raise CorruptWeightsError(
                            f"{file}: tensor {name} also in another shard")
                    if config.tie_word_embeddings and name == "lm_head.weight":
                        continue
                    tensors[name] = shard.get_tensor(name).to(dtype)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise CorruptWeightsError(f"{file}: not a readable safetensors file ({exc})") from exc
    check_tensors(config, tensors, directory)
    return LoadedWeights(config=config, tensors=tensors, digest=digest,
                         tokenizer_dir=str(directory), gguf_file=None)


def read_config(path: Path) -> ModelConfig:
    """Parse a ``config.json``; malformed JSON or missing keys raise naming the file."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (a model directory needs config.json)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptWeightsError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise CorruptWeightsError(f"{path}: expected a JSON object")
    try:
        return ModelConfig.from_hf(raw)
    except UnsupportedModelError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptWeightsError(f"{path}: missing or malformed setting ({exc})") from exc


def _digest(files: list[Path]) -> str:
    """Hash each file's name, size, JSON header, and the first bytes of every tensor."""
    h = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        h.update(f"{file.name}\0{size}\0".encode())
        with file.open("rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise CorruptWeightsError(f"{file}: truncated safetensors header")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > size - 8:
                raise CorruptWeightsError(f"{file}: header length exceeds the file size")
            header = f.read(header_len)
            h.update(header)
            try:
                entries = json.loads(header)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise CorruptWeightsError(f"{file}: malformed safetensors header") from exc
            for name in sorted(k for k in entries if k != "__metadata__"):
                start, end = entries[name]["data_offsets"]
                f.seek(8 + header_len + start)
                h.update(f.read(min(end - start, _SAMPLE_BYTES)))
    return h.hexdigest()[:32]
