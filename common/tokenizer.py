"""Tokenization, chat templates and streaming detokenization without torch.

The gateway must not import ``transformers`` (it imports torch), so this module reads
the files ``transformers`` writes with ``save_pretrained`` and reproduces the parts of
its behaviour the gateway needs:

- ``tokenizer.json`` through the ``tokenizers`` library, the same backend transformers'
  fast tokenizers use, so ids and text agree with ``AutoTokenizer`` on the same files;
- ``tokenizer_config.json`` / ``special_tokens_map.json`` for the special tokens. What
  ``add_special_tokens=True`` adds is decided by the post-processor stored in
  ``tokenizer.json``: transformers 5 drops ``add_bos_token`` / ``add_eos_token`` from the
  config whenever ``tokenizer.json`` exists, and so does this module (SmolLM2's files set
  no BOS; Llama's ``tokenizer.json`` carries its BOS template);
- the chat template (``chat_template.jinja``, else the config's ``chat_template``),
  rendered in a sandbox with the globals and filters transformers provides.

Models whose directory lacks ``tokenizer.json`` (GGUF files, slow-only tokenizers) are
first exported with ``services.engine.tokenizer_export``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer, processors

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                 "cls_token", "mask_token")
# Tokens of prompt context the detokenizer decodes with the first output tokens, so that
# a leading space of the first output token comes out as it would mid-text.
_PROMPT_CONTEXT = 6
_REPLACEMENT = "\ufffd"


def _token_text(value: Any) -> str | None:
    """A special token as stored in the config files: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable JSON file: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class TextTokenizer:
    """Encode, decode and render chat templates for one model.

    ``add_bos_token`` / ``add_eos_token``, when given, replace the tokenizer's
    post-processor with one that adds exactly those tokens (as transformers'
    ``update_post_processor`` does); None keeps the stored one.
    ``vocab_size`` counts added tokens too: it is one more than the largest id
    ``decode`` accepts. ``eos_token_id`` is None when the tokenizer has no EOS token.
    """

    def __init__(self, tokenizer: Tokenizer, *, special_tokens: Mapping[str, str] | None = None,
                 chat_template: str | None = None, add_bos_token: bool | None = None,
                 add_eos_token: bool | None = None) -> None:
        self._tok = tokenizer
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v}
        self.chat_template = chat_template
        missing = [t for t in self.special_tokens.values() if tokenizer.token_to_id(t) is None]
        if missing:  # transformers adds special tokens the vocabulary lacks; so do we
            tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                          for t in dict.fromkeys(missing)])
        explicit = add_bos_token is not None or add_eos_token is not None
        if explicit or tokenizer.post_processor is None:
            self._set_post_processor(bool(add_bos_token), bool(add_eos_token))
        self._template: jinja2.Template | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> TextTokenizer:
        """Load ``tokenizer.json`` and its companion files from a directory.

        Raises ``ValueError`` when ``tokenizer.json`` is missing or a file is malformed.
        """
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"{path}: no tokenizer.json (export the model's tokenizer with "
                             f"`python -m services.engine.tokenizer_export MODEL`)")
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise ValueError(f"{tokenizer_file}: cannot be parsed: {exc}") from exc
        config = _read_json(path / "tokenizer_config.json")
        special = {k: _token_text(config.get(k)) for k in _SPECIAL_KEYS}
        if "added_tokens_decoder" not in config:  # legacy layout: the map file wins
            for key, value in _read_json(path / "special_tokens_map.json").items():
                if key in _SPECIAL_KEYS and _token_text(value):
                    special[key] = _token_text(value)
        template_file = path / "chat_template.jinja"
        template = config.get("chat_template")
        if template_file.is_file():
            template = template_file.read_text(encoding="utf-8")
        elif isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise ValueError(f"{path}: chat_template must be a string")
        return cls(tokenizer, special_tokens={k: v for k, v in special.items() if v},
                   chat_template=template)

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        bos, eos = self.special_tokens.get("bos_token"), self.special_tokens.get("eos_token")
        add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
        single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
        pair = (f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1"
                f"{' ' + eos + ':1' if add_eos else ''}")
        specials = [(t, self._tok.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos))
                    if on]
        self._tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=specials)

    @property
    def eos_token_id(self) -> int | None:
        eos = self.special_tokens.get("eos_token")
        return None if eos is None else self._tok.token_to_id(eos)

    @property
    def bos_token_id(self) -> int | None:
        bos = self.special_tokens.get("bos_token")
        return None if bos is None else self._tok.token_to_id(bos)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a string, got {type(text).__name__}")
        # encode_batch releases the GIL while it works (encode does not): a long prompt
        # tokenized on a worker thread then leaves the caller's event loop running.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``; raises ``ValueError`` for an id outside the vocabulary."""
        ids = list(token_ids)
        limit = self.vocab_size
        bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < limit]
        if bad:
            raise ValueError(f"token ids out of the vocabulary [0, {limit}): {bad[:5]}")
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, **extra: Any) -> str:
        """Render a conversation as the model's prompt text.

        ``messages`` is a list of dicts, each with a string ``role`` and a ``content``
        (a string, a list of content parts, or None). ``extra`` reaches the template as
        variables (e.g. ``tools``). Encode the result with ``add_special_tokens=False``:
        the template already wrote the special tokens it wants. Raises ``ValueError`` for
        malformed messages, a missing template, or an error raised by the template.
        """
        if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
            raise ValueError("messages must be a list of {role, content} objects")
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or "role" not in message \
                    or "content" not in message:
                raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
            if not isinstance(message["role"], str):
                raise ValueError(f"messages[{i}].role must be a string")
            if not isinstance(message["content"], str | list | type(None)):
                raise ValueError(f"messages[{i}].content must be a string or a list of parts")
        template = self._compiled_template()
        variables = {**self.special_tokens, **extra}
        try:
            return template.render(messages=[dict(m) for m in messages],
                                   add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as exc:  # includes sandbox SecurityError
            raise ValueError(f"chat template error: {exc}") from exc
        except (TypeError, KeyError, AttributeError, IndexError) as exc:
            # The template's own code on turns it did not expect (a None content added
            # to a string, parts where it wants text): the messages' fault.
            raise ValueError(f"chat template error on these messages: {exc!r}") from exc

    def _compiled_template(self) -> jinja2.Template:
        if self._template is None:
            if not self.chat_template:
                raise ValueError("this tokenizer has no chat template")
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            try:
                self._template = env.from_string(self.chat_template)
            except jinja2.exceptions.TemplateSyntaxError as exc:
                raise ValueError(f"chat template does not compile: {exc}") from exc
        return self._template


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text, one push at a time.

    Contract: for any split of a sequence ``ids`` into pushes, with ``final=True`` on the
    last one, the concatenation of the returned strings equals
    ``tokenizer.decode(ids, skip_special_tokens)``.

    Text is decoded over a window that starts a little before the newest tokens
    (``prefix_offset``) and diffed against the text the window already produced up to
    ``read_offset``. Decoding in context keeps the spaces that tokenizers merge into a
    token's start; holding back while the window ends in U+FFFD keeps a character whose
    bytes span tokens from being emitted half-made::

        ids:  ... | prefix_offset ...... read_offset ...... new tokens |
                    already emitted text   ^ emitted so far    new text

    ``prompt_token_ids`` (optional) supply the context for the first output tokens.
    """

    def __init__(self, tokenizer: TextTokenizer, prompt_token_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_token_ids or [])[-_PROMPT_CONTEXT:]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, token_ids: Sequence[int], *, final: bool = False) -> str:
        """Add tokens; return the text they complete. ``final`` releases held-back text."""
        self._ids.extend(token_ids)
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset:self._read_offset], self._skip)
        text = decode(self._ids[self._prefix_offset:], self._skip)
        if len(text) <= len(prefix) or (text.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return text[len(prefix):]
