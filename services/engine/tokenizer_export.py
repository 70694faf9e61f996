"""Write a model's tokenizer as plain files the torch-free gateway can load.

A GGUF file carries its tokenizer inside; some Hugging Face directories carry only a
slow tokenizer. ``transformers`` (which imports torch) converts either to
``tokenizer.json`` + ``tokenizer_config.json`` + ``chat_template.jinja``, which
``common.tokenizer.TextTokenizer.from_dir`` reads without torch. The gateway runs::

    python -m services.engine.tokenizer_export MODEL

in a subprocess; it prints the directory to load. Exports are cached under
``${PDSERVE_CACHE:-~/.cache/pdserve}/tokenizers/<key>``, the key a hash of the resolved
model path and its size, so the export runs once per model file.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

from services.engine.weights import resolve_model


def _resolved(model_ref: str | os.PathLike[str]) -> Path:
    path = Path(resolve_model(os.fspath(model_ref)))
    if not path.exists():
        raise FileNotFoundError(f"no model at {os.fspath(model_ref)!r}: not a path and not "
                                f"a known alias")
    return path.resolve()


def export_tokenizer(model_ref: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Load the tokenizer of ``model_ref`` with transformers and save it into ``out_dir``.

    ``model_ref`` is a Hugging Face directory, a ``.gguf`` file or a model alias. Raises
    ``FileNotFoundError`` for a missing model and ``ValueError`` when no fast tokenizer
    (``tokenizer.json``) can be produced.
    """
    from transformers import AutoTokenizer

    path = _resolved(model_ref)
    try:
        if path.is_dir():
            tokenizer = AutoTokenizer.from_pretrained(str(path))
        elif path.suffix.lower() == ".gguf":
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        else:
            raise ValueError(f"{path}: expected a model directory or a .gguf file")
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"cannot load a tokenizer from {path}: {exc}") from exc
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out))
    if not (out / "tokenizer.json").is_file():
        raise ValueError(f"{path}: the tokenizer has no fast (tokenizer.json) form")
    return out


def _cache_key(path: Path) -> str:
    if path.is_dir():
        size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    else:
        size = path.stat().st_size
    return hashlib.sha256(f"{path}\0{size}".encode()).hexdigest()[:24]


def cache_root() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE") or "~/.cache/pdserve").expanduser()


def tokenizer_dir_for(model_ref: str | os.PathLike[str]) -> Path:
    """A directory with ``tokenizer.json`` for ``model_ref``, exporting it at most once.

    A Hugging Face directory that already has ``tokenizer.json`` is returned as is.
    Otherwise the export goes to a temporary directory beside the cache entry and is
    renamed into place, so a reader never sees a half-written export and two processes
    exporting at once both end with the same complete directory.
    """
    path = _resolved(model_ref)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return path
    return cached_dir(cache_root() / "tokenizers" / _cache_key(path), "tokenizer.json",
                      lambda out: export_tokenizer(path, out))


def cached_dir(target: Path, marker: str, write) -> Path:
    """``target``, written once by ``write(directory)`` unless it already holds
    ``marker``: into a temporary directory beside it, then renamed into place, so a
    reader never sees half of it and two processes writing at once both end with the
    same complete directory."""
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(staging)
        try:
            os.rename(staging, target)
        except OSError:
            # Another process finished first (rename onto a non-empty directory fails).
            if not (target / marker).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m services.engine.tokenizer_export",
        description="Print a directory holding MODEL's tokenizer.json, exporting it if needed.")
    parser.add_argument("model", help="Hugging Face directory, .gguf file or model alias")
    args = parser.parse_args(argv)
    try:
        print(tokenizer_dir_for(args.model))
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
