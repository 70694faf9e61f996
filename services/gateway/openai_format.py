"""OpenAI request fields in, OpenAI response objects out.

Request side: the prompt of ``/v1/completions``, the messages of
``/v1/chat/completions`` and the options this server refuses rather than ignores.
Response side: ``ResponseWriter`` turns ``TextDelta``s into stream chunks
(``text_completion`` / ``chat.completion.chunk``) or one final object
(``text_completion`` / ``chat.completion``), with logprobs in each API's shape;
``sse_stream`` frames a request's deltas as server-sent events; ``ApiError`` is an
error with its HTTP status and OpenAI error body.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import structlog
from starlette.responses import JSONResponse

from common.protocol import Timing, TokenLogprob, Usage
from common.tokenizer import TextTokenizer
from services.gateway.backend import BackendOverloaded, BackendUnavailable
from services.gateway.pipeline import RequestError, TextDelta

log = structlog.get_logger(__name__)


class ApiError(Exception):
    """An error answered with an HTTP status and an OpenAI error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def timeout_error() -> ApiError:
    return ApiError(504, "the request timed out", "timeout_error", code="request_timeout")


def admission_error(exc: Exception) -> ApiError:
    """The HTTP error for a request the backend refused before its first token."""
    if isinstance(exc, BackendOverloaded):
        retry = str(max(1, math.ceil(exc.retry_after_s)))  # Retry-After takes whole seconds
        return ApiError(429, str(exc), "rate_limit_error", code="overloaded",
                        headers={"Retry-After": retry})
    if isinstance(exc, BackendUnavailable):
        return ApiError(503, str(exc) or "no backend available", "service_unavailable_error",
                        code="backend_unavailable")
    return ApiError(400, str(exc), param=getattr(exc, "param", None))


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def completion_prompt(body: Mapping[str, Any], tokenizer: TextTokenizer) -> list[int]:
    """Token ids of ``prompt``: a string (encoded with special tokens, as transformers'
    ``encode`` does), a list of token ids, or a list holding exactly one of those."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=True)
    if _is_token_list(prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(
            isinstance(p, str) or _is_token_list(p) for p in prompt):
        raise RequestError("batched prompts are not supported: send one prompt per request",
                           "prompt")
    raise RequestError("prompt must be a string, a list of token ids, or a list holding "
                       "exactly one of those", "prompt")


def chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``messages`` as the chat template expects them: role and string content.

    Text content parts are joined with newlines; other part types are refused.
    """
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string role", "messages")
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise RequestError(f"messages[{i}].content: only text parts are supported",
                                   "messages")
            content = "\n".join(p["text"] for p in content)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string or a list of parts",
                               "messages")
        clean = {"role": message["role"], "content": content}
        if isinstance(message.get("name"), str):
            clean["name"] = message["name"]
        out.append(clean)
    return out


def reject_unsupported(body: Mapping[str, Any], chat: bool) -> None:
    """Refuse options whose meaning this server cannot honour, instead of ignoring them."""
    checks = [("echo", bool(body.get("echo"))),
              ("suffix", body.get("suffix") is not None),
              ("logit_bias", bool(body.get("logit_bias"))),
              ("use_beam_search", bool(body.get("use_beam_search"))),
              ("response_format", body.get("response_format") not in (None, {"type": "text"}))]
    if chat:
        checks.append(("tools", bool(body.get("tools"))))
    for name, present in checks:
        if present:
            raise RequestError(f"{name} is not supported by this server", name)


def timing_object(t: Timing) -> dict[str, Any]:
    """The ``timing`` extension object: stage durations (ms) and the routing decision."""
    return {"route": t.route_ms, "queue": t.queue_ms, "prefill": t.prefill_ms,
            "kv_transfer": t.kv_transfer_ms, "first_token": t.first_token_ms,
            "decode": t.decode_ms, "total": t.total_ms, "kv_bytes": t.kv_bytes,
            "kv_backend": t.kv_backend,
            "routing": {"decode": t.decode_id, "prefill": t.prefill_id or None,
                        "reason": t.route_reason}}


def usage_object(usage: Usage | None) -> dict[str, Any] | None:
    """The OpenAI ``usage`` object."""
    if usage is None:
        return None
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


class ResponseWriter:
    """Builds the response objects of one request (``chat`` or completions)."""

    def __init__(self, tokenizer: TextTokenizer, *, chat: bool, request_id: str,
                 model: str) -> None:
        self._tokenizer = tokenizer
        self.chat = chat
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self._text_offset = 0  # completions' text_offset counts from the output start

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": object_name, "created": self.created,
                "model": self.model, "choices": choices}

    def role_chunk(self) -> dict[str, Any]:
        """The first chat chunk: the assistant role, no text yet."""
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""},
                  "logprobs": None, "finish_reason": None}
        return self._envelope("chat.completion.chunk", [choice])

    def chunk(self, delta: TextDelta) -> dict[str, Any]:
        """A stream chunk carrying ``delta``'s text, logprobs and finish reason."""
        logprobs = self._logprobs(delta.logprobs) if delta.logprobs else None
        if self.chat:
            content = {"content": delta.text} if delta.text or not delta.finished else {}
            choice = {"index": 0, "delta": content, "logprobs": logprobs,
                      "finish_reason": delta.finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": delta.text, "logprobs": logprobs,
                  "finish_reason": delta.finish_reason}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, usage: Usage | None) -> dict[str, Any]:
        """The last chunk with ``stream_options.include_usage``: no choices, usage."""
        name = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(name, []), "usage": usage_object(usage)}

    def final(self, deltas: Sequence[TextDelta]) -> dict[str, Any]:
        """The non-streaming response for a finished request's deltas."""
        text = "".join(d.text for d in deltas)
        token_logprobs = [lp for d in deltas for lp in d.logprobs]
        logprobs = self._logprobs(token_logprobs) if token_logprobs else None
        last = deltas[-1]
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": logprobs, "finish_reason": last.finish_reason}
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs,
                      "finish_reason": last.finish_reason}
            body = self._envelope("text_completion", [choice])
        body["usage"] = usage_object(last.usage)
        if last.timing is not None:
            body["timing"] = timing_object(last.timing)
        return body

    def _token(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def _logprobs(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        if self.chat:
            content = []
            for entry in entries:
                token = self._token(entry.token_id)
                top = [{"token": (t := self._token(x.token_id)), "logprob": x.logprob,
                        "bytes": list(t.encode())} for x in entry.top]
                content.append({"token": token, "logprob": entry.logprob,
                                "bytes": list(token.encode()), "top_logprobs": top})
            return {"content": content}
        tokens, offsets = [], []
        for entry in entries:
            tokens.append(self._token(entry.token_id))
            offsets.append(self._text_offset)
            self._text_offset += len(tokens[-1])
        return {"tokens": tokens,
                "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self._token(x.token_id): x.logprob for x in e.top}
                                 for e in entries],
                "text_offset": offsets}


async def sse_stream(writer: ResponseWriter, first: TextDelta,
                     next_delta: Callable[[], Awaitable[TextDelta]],
                     include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events for one request, ending with ``data: [DONE]``.

    Chat streams open with the assistant role. A delta is sent when it has text or
    logprobs, or finishes the request. A failure (error delta, ``TimeoutError`` or any
    exception from ``next_delta``) is sent as an OpenAI ``error`` event, then ``[DONE]``.
    """
    if writer.chat:
        yield sse(writer.role_chunk())
    delta = first
    while True:
        failed = delta.finish_reason == "error"
        if delta.text or delta.logprobs or (delta.finished and not failed):
            chunk = writer.chunk(delta)
            if failed:
                chunk["choices"][0]["finish_reason"] = None
            if include_usage:
                chunk["usage"] = None
            if delta.timing is not None:
                chunk["timing"] = timing_object(delta.timing)
            yield sse(chunk)
        if failed:
            yield sse(ApiError(500, delta.error or "generation failed", "server_error").body())
        if delta.finished:
            if include_usage and not failed:
                yield sse(writer.usage_chunk(delta.usage))
            break
        try:
            delta = await next_delta()
        except TimeoutError:
            yield sse(timeout_error().body())
            break
        except Exception as exc:
            log.exception("stream_failed", request_id=writer.request_id)
            yield sse(ApiError(500, f"generation failed: {exc}", "server_error").body())
            break
    yield "data: [DONE]\n\n"
