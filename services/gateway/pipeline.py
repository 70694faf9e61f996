"""From a client's request to token ids, and from token events back to text.

Shared by the HTTP (OpenAI) and ZeroMQ front-ends, so both validate alike and produce
the same text. The lifecycle of one request::

    body + prompt ids --prepare()--> PreparedRequest --(front-end)--> backend.generate()
    Tokens* --stream()--> TextDelta*   (detokenize, stop strings, usage)

``prepare`` raises ``RequestError`` (HTTP 400) naming the offending field. ``stream``
never raises for a bad event: a gap in positions or a backend stream that ends without
a final event becomes a final delta with ``finish_reason="error"``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from common.protocol import Timing, TokenLogprob, Tokens, Usage
from common.tokenizer import IncrementalDetokenizer, TextTokenizer
from services.gateway.stop_strings import StopMatcher

MAX_LOGPROBS = 20
# The least latency target a request may ask for. Every token takes a gateway -> worker
# round trip and a model step; no deployment serves one in under a millisecond.
MIN_SLO_MS = 1.0
_SEED_LIMIT = 2**64
_KINDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}


class RequestError(ValueError):
    """A request the gateway refuses as malformed; ``param`` names the field, if one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A validated request: what the backend needs plus the gateway's text options."""

    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    slo_ttft_ms: float | None = None  # extensions: the request's latency targets
    slo_tbt_ms: float | None = None
    timing: bool = False  # extension: return the request's Timing with its last chunk
    trace: str | None = None  # the client's traceparent, if valid


@dataclass(frozen=True, slots=True)
class TextDelta:
    """New output since the previous delta.

    ``token_ids`` start at output index ``position``; ``text`` may lag them (held back
    for a split character or a possible stop string). The last delta has
    ``finished=True``, a ``finish_reason``, ``usage`` and, for ``"error"``, ``error``.
    """

    text: str
    token_ids: list[int]
    position: int
    finished: bool = False
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None
    timing: Timing | None = None  # on the last delta, if the request asked for it


def get_field(body: Mapping[str, Any], name: str, kind: type, default: Any = None) -> Any:
    """``body[name]`` checked to be of ``kind``; ``default`` when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if ok and not math.isfinite(value):
            raise RequestError(f"{name} must be finite, got {value!r}", name)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise RequestError(f"{name} must be {_KINDS[kind]}, got {value!r}", name)
    return float(value) if kind is float else value


def _within(name: str, value: float, lo: float, hi: float, *, lo_open: bool = False) -> None:
    if value < lo or value > hi or (lo_open and value == lo):
        interval = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise RequestError(f"{name} must be in {interval}, got {value}", name)


async def _call(callback: Callable[[], Any] | None) -> None:
    if callback is not None:
        result = callback()
        if inspect.isawaitable(result):
            await result


def event_problem(event: Tokens, vocab_size: int) -> str | None:
    """Why a worker's ``event`` cannot be shown to a client (a token id outside the
    vocabulary, a negative count, a logprob that is not a finite number), or None: the
    request then ends with an error, where detokenizing, metrics or JSON used to raise
    out of the response."""
    ids = event.token_ids
    if ids and not (min(ids) >= 0 and max(ids) < vocab_size):
        return f"token ids outside the vocabulary [0, {vocab_size})"
    if (event.prompt_tokens or 0) < 0 or (event.cached_tokens or 0) < 0:
        return "a negative token count"
    for entry in event.logprobs or ():  # only where the request asked for logprobs
        for item in (entry, *entry.top):
            if not 0 <= item.token_id < vocab_size:
                return f"token ids outside the vocabulary [0, {vocab_size})"
            if not math.isfinite(item.logprob):
                return "a logprob that is not a finite number"
    return None


class RequestPipeline:
    """Validation and text processing for one model."""

    def __init__(self, tokenizer: TextTokenizer, max_model_len: int) -> None:
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    # ---- validation -------------------------------------------------------------------

    def check_prompt(self, token_ids: list[int], param: str = "prompt") -> list[int]:
        """Raise ``RequestError`` for an empty, too long or out-of-vocabulary prompt."""
        if not token_ids:
            raise RequestError(f"{param} is empty", param)
        vocab = self.tokenizer.vocab_size
        bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int)
               or not 0 <= t < vocab]
        if bad:
            raise RequestError(f"{param} has token ids outside [0, {vocab}): {bad[:5]}", param)
        if len(token_ids) >= self.max_model_len:
            raise RequestError(f"{param} is {len(token_ids)} tokens; this model's maximum "
                               f"context length is {self.max_model_len} tokens, which must "
                               f"also leave room for at least one generated token", param)
        return list(token_ids)

    def validate_sampling(self, body: Mapping[str, Any], prompt_len: int, *,
                          chat: bool = False) -> dict[str, Any]:
        """Map OpenAI (and vLLM extension) fields of ``body`` to a sampling dict.

        Every key of ``backend.SAMPLING_KEYS`` is set. ``max_tokens`` defaults to what
        the context leaves after the prompt; for chat ``max_completion_tokens`` wins
        over ``max_tokens``. Completions take ``logprobs: int``; chat takes
        ``logprobs: bool`` and ``top_logprobs: int``.
        """
        name = "max_tokens"
        if chat and body.get("max_completion_tokens") is not None:
            name = "max_completion_tokens"
        room = self.max_model_len - prompt_len
        max_tokens = get_field(body, name, int, room)
        if max_tokens < 1:
            raise RequestError(f"{name} must be >= 1, got {max_tokens}", name)
        if max_tokens > room:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{prompt_len + max_tokens} were requested ({prompt_len} in the prompt, "
                f"{max_tokens} in {name}); {name} can be at most {room}", name)
        n = get_field(body, "n", int, 1)
        if n != 1:
            raise RequestError(f"n must be 1 (one choice per request), got {n}", "n")
        if get_field(body, "best_of", int, 1) != 1:
            raise RequestError("best_of must be 1", "best_of")
        sampling: dict[str, Any] = {"max_tokens": max_tokens}
        for key, default, lo, hi, lo_open in (("temperature", 1.0, 0.0, 2.0, False),
                                              ("top_p", 1.0, 0.0, 1.0, True),
                                              ("min_p", 0.0, 0.0, 1.0, False),
                                              ("presence_penalty", 0.0, -2.0, 2.0, False),
                                              ("frequency_penalty", 0.0, -2.0, 2.0, False),
                                              ("repetition_penalty", 1.0, 0.0, math.inf, True)):
            sampling[key] = get_field(body, key, float, default)
            _within(key, sampling[key], lo, hi, lo_open=lo_open)
        sampling["top_k"] = get_field(body, "top_k", int, 0)
        if sampling["top_k"] < -1:
            raise RequestError(f"top_k must be -1 (off) or >= 0, got {sampling['top_k']}",
                               "top_k")
        seed = sampling["seed"] = get_field(body, "seed", int, None)
        if seed is not None and not 0 <= seed < _SEED_LIMIT:
            raise RequestError(f"seed must be in [0, 2**64), got {seed}", "seed")
        sampling["stop_token_ids"] = self._token_list(body, "stop_token_ids")
        sampling["ignore_eos"] = get_field(body, "ignore_eos", bool, False)
        min_tokens = sampling["min_tokens"] = get_field(body, "min_tokens", int, 0)
        if not 0 <= min_tokens <= max_tokens:
            raise RequestError(f"min_tokens must be in [0, {name}={max_tokens}], "
                               f"got {min_tokens}", "min_tokens")
        sampling["logprobs"] = self._logprobs(body, chat)
        return sampling

    def _token_list(self, body: Mapping[str, Any], name: str) -> list[int]:
        ids = body.get(name)
        if ids is None:
            return []
        vocab = self.tokenizer.vocab_size
        if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int)
                                            or not 0 <= t < vocab for t in ids):
            raise RequestError(f"{name} must be a list of token ids in [0, {vocab})", name)
        return list(ids)

    @staticmethod
    def _logprobs(body: Mapping[str, Any], chat: bool) -> int | None:
        if chat:
            wanted = get_field(body, "logprobs", bool, False)
            top = get_field(body, "top_logprobs", int, None)
            if top is not None and not wanted:
                raise RequestError("top_logprobs requires logprobs to be true", "top_logprobs")
            name, count = "top_logprobs", (top or 0) if wanted else None
        else:
            name, count = "logprobs", get_field(body, "logprobs", int, None)
        if count is not None and not 0 <= count <= MAX_LOGPROBS:
            raise RequestError(f"{name} must be in [0, {MAX_LOGPROBS}], got {count}", name)
        return count

    @staticmethod
    def stop_strings(body: Mapping[str, Any]) -> list[str]:
        """``stop``: null, a string, or a list of non-empty strings."""
        stop = body.get("stop")
        if stop is None:
            return []
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise RequestError("stop must be a non-empty string or a list of them", "stop")
        return list(dict.fromkeys(stops))

    def prepare(self, body: Mapping[str, Any], prompt_token_ids: list[int], *,
                chat: bool = False) -> PreparedRequest:
        """Validate everything in ``body`` that shapes generation."""
        prompt = self.check_prompt(prompt_token_ids, "messages" if chat else "prompt")
        return PreparedRequest(
            prompt_token_ids=prompt,
            sampling=self.validate_sampling(body, len(prompt), chat=chat),
            stop=self.stop_strings(body),
            include_stop_str_in_output=get_field(body, "include_stop_str_in_output", bool, False),
            skip_special_tokens=get_field(body, "skip_special_tokens", bool, True),
            cache_salt=get_field(body, "cache_salt", str, None) or None,
            slo_ttft_ms=self._slo(body, "slo_ttft_ms"),
            slo_tbt_ms=self._slo(body, "slo_tbt_ms"),
            timing=get_field(self._extension(body), "timing", bool, False))

    @staticmethod
    def _extension(body: Mapping[str, Any]) -> Mapping[str, Any]:
        """The ``pdserve`` object of options no OpenAI field covers (absent: none)."""
        ext = body.get("pdserve")
        if ext is not None and not isinstance(ext, dict):
            raise RequestError("pdserve must be an object", "pdserve")
        return ext or {}

    @staticmethod
    def _slo(body: Mapping[str, Any], name: str) -> float | None:
        """An SLO extension field in milliseconds: absent/null, or at least ``MIN_SLO_MS``.

        A target below the floor is refused here (400) rather than by admission (429,
        "try again later"): no retry could ever meet it.
        """
        value = get_field(body, name, float, None)
        if value is not None and value < MIN_SLO_MS:
            raise RequestError(f"{name} must be at least {MIN_SLO_MS:g} milliseconds (no "
                               f"request is served faster), got {value:g}", name)
        return value

    # ---- streaming --------------------------------------------------------------------

    async def stream(self, request: PreparedRequest, events: AsyncIterator[Tokens],
                     on_stop: Callable[[], Awaitable[None] | None] | None = None,
                     ) -> AsyncIterator[TextDelta]:
        """Yield one ``TextDelta`` per event until the request finishes.

        When a stop string completes, the output is cut before it (after it with
        ``include_stop_str_in_output``), ``on_stop`` is called (the caller aborts the
        backend request; it may be a coroutine function), and a final delta with
        ``finish_reason="stop"`` ends the stream. Exceptions the backend raises before
        its first event propagate. ``events`` is closed when this generator ends.
        """
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                       request.skip_special_tokens)
        stops = StopMatcher(request.stop, request.include_stop_str_in_output)
        min_tokens = request.sampling.get("min_tokens", 0)
        counts = {"prompt": len(request.prompt_token_ids), "cached": 0, "done": 0}

        def usage() -> Usage:
            return Usage(prompt_tokens=counts["prompt"], completion_tokens=counts["done"],
                         total_tokens=counts["prompt"] + counts["done"],
                         cached_tokens=counts["cached"])

        try:
            async for event in events:
                problem = event_problem(event, self.tokenizer.vocab_size)
                if problem is not None:
                    yield TextDelta(stops.flush(), [], counts["done"], True, "error", usage(),
                                    error=f"the worker sent {problem}")
                    return
                counts["prompt"] = event.prompt_tokens or counts["prompt"]
                counts["cached"] = event.cached_tokens or counts["cached"]
                start = counts["done"]
                skip = start - event.position  # a resent overlap after a failover
                if event.token_ids and skip < 0:
                    yield TextDelta(stops.flush(), [], start, True, "error", usage(),
                                    error=f"token stream gap: expected position {start}, "
                                          f"got {event.position}")
                    return
                ids = event.token_ids[skip:] if event.token_ids else []
                logprobs = event.logprobs[skip:] if event.logprobs else []
                pieces: list[str] = []
                hit = False
                for i, token in enumerate(ids):
                    counts["done"] += 1
                    text = detok.push([token], final=event.finished and i == len(ids) - 1)
                    piece, hit = stops.feed(text, check=counts["done"] > min_tokens)
                    pieces.append(piece)
                    if hit:
                        break
                taken = counts["done"] - start
                if hit:
                    if not event.finished:  # a finished request needs no abort
                        await _call(on_stop)
                    yield TextDelta("".join(pieces), ids[:taken], start, True, "stop", usage(),
                                    logprobs[:taken])
                    return
                if event.finished:
                    if not ids:
                        pieces.append(stops.feed(detok.push([], final=True), check=False)[0])
                    pieces.append(stops.flush())
                    reason = event.finish_reason or ("error" if event.error else "stop")
                    yield TextDelta("".join(pieces), ids, start, True, reason, usage(),
                                    logprobs, event.error, event.timing)
                    return
                yield TextDelta("".join(pieces), ids, start, logprobs=logprobs)
            yield TextDelta(stops.flush(), [], counts["done"], True, "error", usage(),
                            error="the backend ended the stream without a final event")
        finally:
            closer = getattr(events, "aclose", None)
            if closer is not None:
                await closer()
