"""A model of a named shape (``model_config.PRESETS``) with random weights, and a byte-level
tokenizer to serve it with text.

For benchmarks on hardware with no checkpoint at hand: ``--random-weights llama-3-8b``
builds the 8B shape straight on the target device in the target dtype (no download, no
host copy), seeded, so every worker given the same preset, seed, device type and dtype
holds the same weights and reports the same fingerprint. That fingerprint starts
``random-`` and hashes none of a real checkpoint's bytes: such a worker never exchanges
KV with one serving real weights.

Random weights have no tokenizer. ``byte_tokenizer_dir`` writes one (once, cached like
exported tokenizers): ids 0-255 are the bytes of UTF-8 text, the preset's BOS and EOS
ids are ``<|begin_of_text|>`` / ``<|end_of_text|>``, and every other id decodes to a
placeholder ``<|tN|>``. Text goes in and out, but what comes out is noise; requests
given as token ids need no tokenizer at all. The gateway, which loads no weights, takes
the directory from ``python -m services.engine.weights.random_init PRESET``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from services.engine.model_config import RANDOM_PREFIX, ModelConfig, preset
from services.engine.tokenizer_export import cache_root, cached_dir
from services.engine.weights import LoadedWeights, expected_shapes

BOS_TOKEN, EOS_TOKEN = "<|begin_of_text|>", "<|end_of_text|>"
_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n"
                  "{{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def random_digest(name: str, seed: int, device: torch.device) -> str:
    """What identifies random weights: the same preset and seed draw different numbers
    on a CPU and on a GPU (their generators differ), so the device type is part of it."""
    return f"{RANDOM_PREFIX}{name}-seed{seed}-{device.type}"


def random_weights(name: str, seed: int = 0, *, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu") -> LoadedWeights:
    """The preset ``name`` with weights drawn from ``seed``, every tensor made on
    ``device`` in ``dtype``. Projections and embeddings are normal with standard
    deviation ``hidden_size ** -0.5`` (activations keep a unit scale at any width);
    norm weights are ones, biases zeros. ``ValueError`` for an unknown preset."""
    cfg = preset(name)
    device = torch.device(device)
    # The meta device (shapes only, for checks) has no generator and needs none.
    gen = None if device.type == "meta" else torch.Generator(device=device).manual_seed(seed)
    std = cfg.hidden_size ** -0.5
    tensors: dict[str, torch.Tensor] = {}
    for tensor_name, shape in expected_shapes(cfg).items():
        t = torch.empty(shape, dtype=dtype, device=device)
        if tensor_name.endswith("norm.weight"):
            t.fill_(1.0)
        elif tensor_name.endswith(".bias"):
            t.zero_()
        else:
            t.normal_(0.0, std, generator=gen)
        tensors[tensor_name] = t
    return LoadedWeights(config=cfg, tensors=tensors,
                         digest=random_digest(name, seed, device),
                         tokenizer_dir=str(byte_tokenizer_dir(cfg)), gguf_file=None)


def _byte_chars() -> list[str]:
    """The character byte-level tokenizers (GPT-2's scheme) stand each byte for:
    printable Latin-1 bytes are themselves, the rest shifted past U+0100 in order."""
    keep = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, shifted = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(0x100 + shifted))
            shifted += 1
    return chars


def write_byte_tokenizer(cfg: ModelConfig, out: Path) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` of a byte-level tokenizer over
    ``cfg``'s vocabulary into ``out`` (see the module docstring)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else None
    specials = {i: t for i, t in ((cfg.bos_token_id, BOS_TOKEN), (eos, EOS_TOKEN))
                if i is not None}
    if cfg.vocab_size < 256 or any(not 256 <= i < cfg.vocab_size for i in specials):
        raise ValueError("a byte tokenizer needs a vocabulary of 256 bytes plus BOS/EOS "
                         "ids above them")
    vocab = {c: b for b, c in enumerate(_byte_chars())}
    vocab.update((specials.get(i, f"<|t{i}|>"), i) for i in range(256, cfg.vocab_size))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in specials.values()])
    if cfg.bos_token_id is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B",
            special_tokens=[(BOS_TOKEN, cfg.bos_token_id)])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": _CHAT_TEMPLATE,
              "model_max_length": cfg.max_position_embeddings}
    if cfg.bos_token_id is not None:
        config["bos_token"] = BOS_TOKEN
    if eos is not None:
        config["eos_token"] = EOS_TOKEN
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def byte_tokenizer_dir(cfg: ModelConfig) -> Path:
    """A directory holding the byte tokenizer for ``cfg``'s vocabulary and special ids,
    written once under the tokenizer cache (staged and renamed into place, so a
    reader never sees half of it)."""
    eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else "none"
    key = f"bytes-v{cfg.vocab_size}-b{cfg.bos_token_id}-e{eos}"
    return cached_dir(cache_root() / "tokenizers" / key, "tokenizer_config.json",
                      lambda out: write_byte_tokenizer(cfg, out))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m services.engine.weights.random_init",
        description="Print the byte tokenizer directory for a random-weights preset "
                    "(give it to the gateway as --tokenizer-dir).")
    parser.add_argument("preset", help="a model shape preset, e.g. llama-3-8b")
    args = parser.parse_args(argv)
    try:
        cfg = preset(args.preset)
        print(byte_tokenizer_dir(cfg))
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"max_model_len {cfg.max_position_embeddings}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
