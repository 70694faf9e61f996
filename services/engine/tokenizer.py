"""Text in and out through transformers' tokenizers, loaded lazily from the weights."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class Tokenizer:
    """Wraps a transformers tokenizer: encoding, decoding and chat templates."""

    def __init__(self, source_dir: str, gguf_file: str | None = None) -> None:
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(source_dir, gguf_file=gguf_file)
        except Exception as exc:  # transformers raises many types for a bad directory
            raise ValueError(f"cannot load a tokenizer from {source_dir}: {exc}") from exc

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a chat, ready to generate the assistant's reply."""
        text = self._tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             tokenize=False)
        return self.encode(text, add_special_tokens=False)
