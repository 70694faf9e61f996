"""Per-request sampling parameters, validated once when the request arrives.

Every rule follows vLLM's, so a request that vLLM accepts is accepted here with the
same meaning. A bad value raises ``ValueError`` whose message starts with the field
name, e.g. ``"temperature must be >= 0, got -1.0"``, so the API layer can return it
to the client unchanged.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

MAX_LOGPROBS = 20
# torch.Generator.manual_seed takes any value in [0, 2**64).
SEED_LIMIT = 2**64


def _integer(name: str, value: Any) -> int:
    # bool is an Integral; `"max_tokens": true` is a client bug, not 1.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick the next token of one request.

    - ``temperature == 0`` or ``top_k == 1`` means greedy (see ``greedy``). The sampler
      treats temperatures below ``sampler.MIN_TEMPERATURE`` as that minimum.
    - ``top_k`` of 0 or -1 disables top-k; -1 is stored as 0.
    - ``repetition_penalty`` (HF/vLLM): for every token seen in the prompt or the output,
      a positive logit is divided by it and a non-positive one multiplied.
    - ``presence_penalty`` / ``frequency_penalty`` (OpenAI): over output tokens only,
      ``logit -= frequency * count + presence * (count > 0)``.
    - ``stop_token_ids`` end the request like EOS; a list is stored as a tuple.
    - ``logprobs``: how many top alternatives to report per generated token (0..20);
      ``None`` reports nothing, 0 reports only the chosen token.
    - ``min_tokens``: EOS and stop ids are suppressed until this many tokens exist.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0

    def __post_init__(self) -> None:
        max_tokens = self._set("max_tokens", _integer("max_tokens", self.max_tokens))
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")

        temperature = self._set("temperature", _number("temperature", self.temperature))
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")

        top_k = _integer("top_k", self.top_k)
        if top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 0, got {top_k}")
        self._set("top_k", max(top_k, 0))

        top_p = self._set("top_p", _number("top_p", self.top_p))
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")

        min_p = self._set("min_p", _number("min_p", self.min_p))
        if not 0 <= min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}")

        rep = self._set("repetition_penalty",
                        _number("repetition_penalty", self.repetition_penalty))
        if rep <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {rep}")

        for name in ("presence_penalty", "frequency_penalty"):
            value = self._set(name, _number(name, getattr(self, name)))
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")

        if self.seed is not None:
            seed = self._set("seed", _integer("seed", self.seed))
            if not 0 <= seed < SEED_LIMIT:
                raise ValueError(f"seed must be in [0, 2**64), got {seed}")

        self._set("stop_token_ids", self._stop_token_ids())

        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")

        if self.logprobs is not None:
            logprobs = self._set("logprobs", _integer("logprobs", self.logprobs))
            if not 0 <= logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}")

        min_tokens = self._set("min_tokens", _integer("min_tokens", self.min_tokens))
        if not 0 <= min_tokens <= max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens}")

    def _set(self, name: str, value: Any) -> Any:
        object.__setattr__(self, name, value)
        return value

    def _stop_token_ids(self) -> tuple[int, ...]:
        ids = self.stop_token_ids
        if not isinstance(ids, list | tuple):
            raise ValueError(f"stop_token_ids must be a list of integers, got {ids!r}")
        checked = tuple(_integer("stop_token_ids", i) for i in ids)
        if any(i < 0 for i in checked):
            raise ValueError(f"stop_token_ids must be >= 0, got {list(checked)}")
        return checked

    @property
    def greedy(self) -> bool:
        """True when the next token is exactly the argmax of the (penalized) logits."""
        return self.temperature == 0 or self.top_k == 1

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Build from a request's JSON object; missing keys take their defaults.

        Raises ``ValueError`` naming any unknown key, or the first invalid field.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"sampling params must be an object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(repr(k) for k in d if k not in known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**d)
