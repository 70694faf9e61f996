"""What the torch-free gateway needs to know about a model, found in a child process.

    python -m services.gateway.model_info MODEL [--random-weights PRESET]
    → {"tokenizer_dir": ..., "max_model_len": ..., "vocab_size": ...}

With ``--random-weights`` the model is the shape preset the workers draw random weights
for (``services/engine/model_config.py``): its context length, and the byte tokenizer
the workers use (``weights/random_init.py``); ``MODEL`` is then only a name.

The gateway never imports torch; reading weights metadata and exporting a GGUF's
tokenizer do, so :func:`describe_model` runs this module as a subprocess.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple


class ModelInfo(NamedTuple):
    tokenizer_dir: str
    max_model_len: int
    vocab_size: int


def describe_model(model: str, timeout_s: float = 300.0, *,
                   random_weights: str = "") -> ModelInfo:
    preset = ["--random-weights", random_weights] if random_weights else []
    proc = subprocess.run([sys.executable, "-m", "services.gateway.model_info", model,
                           *preset], capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        raise ValueError(f"cannot load model {model!r}: {tail[0]}")
    return ModelInfo(**json.loads(proc.stdout.strip().splitlines()[-1]))


def _inspect(model: str, random_weights: str = "") -> ModelInfo:
    if random_weights:
        from services.engine.model_config import preset
        from services.engine.weights.random_init import byte_tokenizer_dir

        cfg = preset(random_weights)
        return ModelInfo(str(byte_tokenizer_dir(cfg)), cfg.max_position_embeddings,
                         cfg.vocab_size)
    from services.engine.tokenizer_export import tokenizer_dir_for
    from services.engine.weights import resolve_model
    from services.engine.weights.hf import read_config

    path = Path(resolve_model(model))
    if path.is_dir():
        config = read_config(path / "config.json")
    else:
        import gguf

        from services.engine.weights.gguf import config_from_gguf

        reader = gguf.GGUFReader(path)
        config = config_from_gguf(reader, path, {t.name: t for t in reader.tensors})
    return ModelInfo(str(tokenizer_dir_for(model)), config.max_position_embeddings,
                     config.vocab_size)


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) not in (1, 3) or (len(args) == 3 and args[1] != "--random-weights"):
        sys.exit("usage: python -m services.gateway.model_info MODEL "
                 "[--random-weights PRESET]")
    try:
        print(json.dumps(_inspect(args[0], *args[2:])._asdict()))
    except (ValueError, FileNotFoundError) as exc:
        sys.exit(f"error: {exc}")
