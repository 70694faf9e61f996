"""The gateway's OpenAI-compatible HTTP API over a ``GenerationBackend``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with SSE
streaming), ``GET /v1/models``, ``GET /health``, ``GET /metrics``. One request::

    auth -> JSON body -> model -> prompt ids (chat template for chat) -> prepare()
    -> backend.generate() -> first event (admission errors become HTTP statuses)
    -> stream: SSE chunks ... data: [DONE]    or    non-stream: one JSON object

Errors are OpenAI bodies ``{"error": {"message", "type", "param", "code"}}``: 400 for a
malformed request (FastAPI's 422 included), 401 bad API key, 404 unknown model, 413 a
body over ``max_body_bytes``, 429 ``BackendOverloaded`` (with Retry-After), 503
``BackendUnavailable``, 504 timeout, 500 backend failure. Once a stream has started, a
failure is sent as an ``error`` event followed by ``[DONE]``. A request that ends early
for any reason (client disconnect, timeout, shutdown) is aborted in the backend exactly
once; the client's disconnect is noticed at once, while the request still queues too.

Request ids: the backend sees an id the gateway makes (unique across all clients and
both front-ends); ``X-Request-Id``, when given, is only the label the response carries,
so two clients choosing the same one cannot touch each other's request.

Tokenization and chat templates run on worker threads (``tokenizers`` releases the GIL
while it encodes), so a large prompt does not stall other requests or ``/health``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException

from common.tokenizer import TextTokenizer
from common.tracing import parse_traceparent
from services.gateway import openai_format as fmt
from services.gateway.backend import (
    BackendOverloaded,
    BackendUnavailable,
    GenerationBackend,
    GenerationRequest,
)
from services.gateway.metrics import GatewayMetrics, RequestTracker
from services.gateway.openai_format import ApiError, timeout_error
from services.gateway.pipeline import (
    PreparedRequest,
    RequestError,
    RequestPipeline,
    TextDelta,
    get_field,
)
from services.gateway.tenancy import ApiKeys, tenant_salt

log = structlog.get_logger(__name__)
_ABORT_TIMEOUT_S = 5.0
MAX_BODY_BYTES = 4 << 20
MAX_JSON_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")


class _Run:
    """One request in the backend: deltas under a deadline, abort on early close."""

    def __init__(self, backend: GenerationBackend, pipeline: RequestPipeline,
                 prepared: PreparedRequest, request_id: str, tracker: RequestTracker,
                 timeout_s: float) -> None:
        self.backend, self.request_id, self.tracker = backend, request_id, tracker
        self.finished = False
        self.completion_tokens = 0
        self.prompt_tokens = len(prepared.prompt_token_ids)
        self._deadline = asyncio.get_running_loop().time() + timeout_s
        request = GenerationRequest(request_id, prepared.prompt_token_ids, prepared.sampling,
                                    prepared.cache_salt, prepared.slo_ttft_ms,
                                    prepared.slo_tbt_ms, prepared.timing, prepared.trace)
        self._deltas = pipeline.stream(prepared, backend.generate(request),
                                       on_stop=lambda: backend.abort(request_id))

    async def next(self) -> TextDelta:
        """The next delta; ``TimeoutError`` past the request's deadline."""
        async with asyncio.timeout_at(self._deadline):
            delta = await anext(self._deltas)
        self.completion_tokens += len(delta.token_ids)
        self.tracker.tokens(len(delta.token_ids))
        if delta.finished:
            self.finished = True
            usage = delta.usage
            self.tracker.finish(delta.finish_reason or "stop",
                                usage.prompt_tokens if usage else self.prompt_tokens,
                                usage.completion_tokens if usage else self.completion_tokens)
        return delta

    async def close(self) -> None:
        """Abort the backend request unless it finished; release the stream. Idempotent."""
        with anyio.CancelScope(shield=True):
            if not self.finished:
                self.finished = True
                self.tracker.finish("abort", self.prompt_tokens, self.completion_tokens)
                with anyio.move_on_after(_ABORT_TIMEOUT_S):
                    await self.backend.abort(self.request_id)
            try:
                await self._deltas.aclose()
            except RuntimeError:  # still running in a task that is being torn down
                log.warning("stream_close_failed", request_id=self.request_id)

    async def first(self) -> TextDelta:
        """The first delta, with admission failures mapped to HTTP errors."""
        try:
            return await self.next()
        except (BackendOverloaded, BackendUnavailable, ValueError) as exc:
            self.finished = True  # refused by the backend: nothing to abort
            await self.close()
            raise fmt.admission_error(exc) from exc
        except TimeoutError as exc:
            await self.close()
            raise timeout_error() from exc
        except BaseException:
            await self.close()
            raise


async def _until_disconnect(request: Request) -> None:
    """Return once the client has gone away. A plain blocking ``receive``: the request's
    body is already read, so the next message the server has for us is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(watch: asyncio.Future, work: Any) -> Any:
    """``await work``, or ``_GONE`` (``work`` cancelled) if ``watch`` (the client's
    disconnect) completes first."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        return _GONE
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})


_GONE = object()


async def _collect(run: _Run, first: TextDelta, watch: asyncio.Future) -> list[TextDelta] | None:
    """Every delta of a non-streaming request, or None if the client disconnected first
    (``watch`` completed). The run is closed (aborted if unfinished)."""
    deltas = [first]

    async def rest() -> None:
        while not deltas[-1].finished:
            deltas.append(await run.next())

    try:
        return None if await _unless_gone(watch, rest()) is _GONE else deltas
    finally:
        await run.close()


class _SSEResponse(StreamingResponse):
    """A streaming response that closes its run however the stream ends, including
    when Starlette cancels it because the client went away."""

    def __init__(self, content: AsyncIterator[str], run: _Run, headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._run = run

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._run.close()


def check_json(value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raise ``ValueError`` for JSON nested deeper than ``max_depth`` or holding a lone
    surrogate (``"\\ud800"`` parses, but is no text: it can be neither tokenized nor
    sent back as UTF-8)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                raise ValueError("a string holds a lone UTF-16 surrogate (not valid Unicode)")
        elif isinstance(item, dict | list):
            if depth > max_depth:
                raise ValueError(f"JSON is nested deeper than {max_depth} levels")
            subs = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            stack.extend((sub, depth + 1) for sub in subs if isinstance(sub, str | dict | list))


def create_app(backend: GenerationBackend, tokenizer: TextTokenizer, *, model_name: str,
               max_model_len: int, api_keys: Sequence[str] = (), request_timeout_s: float = 600,
               max_body_bytes: int = MAX_BODY_BYTES,
               metrics_registry: CollectorRegistry | None = None) -> FastAPI:
    """The HTTP app serving ``model_name`` from ``backend``.

    ``api_keys``: when non-empty, ``/v1/*`` requires ``Authorization: Bearer <key>``
    with one of them; ``/health`` and ``/metrics`` stay open. ``request_timeout_s``
    bounds a request from arrival to its last token; ``max_body_bytes`` its body (413).
    """
    pipeline = RequestPipeline(tokenizer, max_model_len)
    metrics = GatewayMetrics(metrics_registry)
    keys = ApiKeys(api_keys)
    app = FastAPI(title="pdserve gateway", docs_url=None, redoc_url=None)
    app.state.metrics_registry = metrics.registry  # where /metrics reads, for more collectors

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        # Every error answer passes here, so pdserve:http_errors counts them all.
        metrics.http_errors.labels(status=str(exc.status)).inc()
        return exc.response()

    @app.exception_handler(RequestError)
    async def _request_error(r: Request, exc: RequestError) -> JSONResponse:
        return await _api_error(r, ApiError(400, str(exc), param=exc.param))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(r: Request, exc: RequestValidationError) -> JSONResponse:
        return await _api_error(r, ApiError(400, f"invalid request: {exc.errors()}"))

    @app.exception_handler(HTTPException)
    async def _http_error(r: Request, exc: HTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return await _api_error(r, ApiError(exc.status_code, str(exc.detail), code=code))

    @app.exception_handler(Exception)
    async def _internal_error(r: Request, exc: Exception) -> JSONResponse:
        log.exception("request_failed")
        return await _api_error(r, ApiError(500, f"internal error: {type(exc).__name__}",
                                            "server_error"))

    def authorize(request: Request) -> bytes | None:
        """The caller's API key, checked; None when the server has no keys."""
        if not keys.required:
            return None
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        token = given.strip().encode()
        if scheme.lower() != "bearer" or not keys.valid(token):
            raise ApiError(401, "missing or incorrect API key (send Authorization: Bearer KEY)",
                           code="invalid_api_key")
        return token

    async def read_raw(request: Request) -> bytes:
        too_large = ApiError(413, f"the request body is larger than {max_body_bytes} bytes",
                             code="request_too_large")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > max_body_bytes:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    def parse(raw: bytes) -> Any:
        try:
            body = json.loads(raw)
            check_json(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}") from exc
        except RecursionError as exc:
            raise ApiError(400, "request body is not valid JSON: nested too deeply") from exc
        except ValueError as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}") from exc
        return body

    async def read_body(request: Request) -> dict[str, Any]:
        token = authorize(request)
        body = await asyncio.to_thread(parse, await read_raw(request))
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(400, "model is required and must be a string", param="model")
        if model != model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                                f"{model_name!r}", param="model", code="model_not_found")
        if token is not None:
            body["cache_salt"] = tenant_salt(token, body.get("cache_salt"))
        return body

    def request_ids(request: Request, prefix: str) -> tuple[str, str]:
        """(the label the client sees, the id the backend sees)."""
        internal = f"{prefix}-{uuid.uuid4().hex}"
        given = request.headers.get("x-request-id")
        if given is None:
            return internal, internal
        if not 0 < len(given) <= 128 or not given.isprintable():
            raise ApiError(400, "X-Request-Id must be 1 to 128 printable characters")
        return given, internal

    async def serve(request: Request, body: dict[str, Any], prepared: PreparedRequest,
                    chat: bool) -> Response:
        stream = get_field(body, "stream", bool, False)
        options = body.get("stream_options")
        if options is not None and (not isinstance(options, dict) or not stream):
            raise RequestError("stream_options must be an object, and only with stream=true",
                               "stream_options")
        include_usage = get_field(options or {}, "include_usage", bool, False)
        request_id, internal_id = request_ids(request, "chatcmpl" if chat else "cmpl")
        prepared = dataclasses.replace(  # extensions a client may also ask for by header
            prepared, trace=parse_traceparent(request.headers.get("traceparent")),
            timing=prepared.timing or request.headers.get("x-pdserve-timing") == "1")
        if internal_id != request_id:
            log.debug("request_labelled", request_id=internal_id, label=request_id)
        writer = fmt.ResponseWriter(tokenizer, chat=chat, request_id=request_id,
                                    model=model_name)
        run = _Run(backend, pipeline, prepared, internal_id,
                   metrics.track(prepared.slo_ttft_ms, prepared.slo_tbt_ms),
                   request_timeout_s)
        # Watched from the start: a client may leave while its request still queues.
        watch = asyncio.ensure_future(_until_disconnect(request))
        try:
            first = await _unless_gone(watch, run.first())
            if first is _GONE:
                await run.close()
                return Response(status_code=499)
            headers = {"X-Request-Id": request_id}
            if stream:
                watch.cancel()  # the response watches the client from here
                events = fmt.sse_stream(writer, first, run.next, include_usage)
                return _SSEResponse(events, run, headers)
            try:
                deltas = await _collect(run, first, watch)
            except TimeoutError as exc:
                raise timeout_error() from exc
        finally:
            watch.cancel()
        if deltas is None:  # the client is gone; nobody reads this
            return Response(status_code=499)
        if deltas[-1].finish_reason == "error":
            raise ApiError(500, deltas[-1].error or "generation failed", "server_error")
        return JSONResponse(writer.final(deltas), headers=headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await read_body(request)
        fmt.reject_unsupported(body, chat=False)

        def prepare() -> PreparedRequest:
            return pipeline.prepare(body, fmt.completion_prompt(body, tokenizer))
        return await serve(request, body, await asyncio.to_thread(prepare), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_body(request)
        fmt.reject_unsupported(body, chat=True)
        messages = fmt.chat_messages(body)
        add_generation_prompt = get_field(body, "add_generation_prompt", bool, True)

        def prepare() -> PreparedRequest:
            try:
                text = tokenizer.apply_chat_template(messages, add_generation_prompt)
            except ValueError as exc:
                raise RequestError(str(exc), "messages") from exc
            # The template wrote the special tokens it wants; transformers encodes it so too.
            prompt = tokenizer.encode(text, add_special_tokens=False)
            return pipeline.prepare(body, prompt, chat=True)
        return await serve(request, body, await asyncio.to_thread(prepare), chat=True)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "pdserve",
                                            "max_model_len": max_model_len}]}

    @app.get("/health")
    async def health() -> Response:
        try:
            ok = await backend.ready()
        except Exception:
            log.exception("health_check_failed")
            ok = False
        refused = backend.refused()  # workers turned away: why a worker is missing
        return JSONResponse({"ready": ok, **({"refused": refused} if refused else {})},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
