"""The ZeroMQ client SDK for a pdserve gateway: blocking and asyncio, streaming or not.

    from common.client import Client

    with Client("tcp://127.0.0.1:5550") as client:
        done = client.generate("The capital of France is", max_tokens=8, temperature=0)
        print(done.text)
        for chunk in client.stream(messages=[{"role": "user", "content": "Hi!"}]):
            print(chunk.text, end="", flush=True)

Sampling keywords are those of the OpenAI API plus pdserve's extensions (max_tokens,
temperature, top_p, top_k, min_p, seed, presence_penalty, frequency_penalty,
repetition_penalty, stop_token_ids, ignore_eos, min_tokens, logprobs). ``timing=True``
asks for the request's stage timings (``Completion.timing``, the last chunk's
``timing``); ``traceparent`` makes the request's trace a child of the caller's span.
Imports no torch.

Wire: the client's DEALER sends ``ClientRequest`` (request id in the envelope); the
gateway answers with ``ClientChunk`` messages for that id, the last one ``finished``;
``Abort`` with the same id stops it. A chunk carrying ``error`` raises
:class:`GenerationError`. Request ids are the client's own: they are scoped by its socket,
so only this client can abort its requests. ``api_key`` is required when the gateway
has API keys configured (code ``unauthorized`` otherwise).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any, NamedTuple

import zmq
import zmq.asyncio

from common.protocol import (
    Abort,
    ClientChunk,
    ClientRequest,
    Error,
    Timing,
    Usage,
    decode,
    encode,
)

DEFAULT_ADDRESS = "tcp://127.0.0.1:5550"


class GenerationError(RuntimeError):
    """The gateway could not complete the request; ``code`` says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class Completion(NamedTuple):
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage | None
    timing: Timing | None = None  # with ``timing=True``: where the time went


def _request(model: str, prompt, messages, prompt_token_ids, stop, stream, cache_salt,
             timeout_s, api_key, sampling: dict[str, Any], timing: bool) -> ClientRequest:
    if sum(x is not None for x in (prompt, messages, prompt_token_ids)) != 1:
        raise ValueError("give exactly one of prompt, messages or prompt_token_ids")
    if isinstance(stop, str):
        stop = [stop]
    return ClientRequest(model=model, sampling=sampling, prompt=prompt,
                         prompt_token_ids=list(prompt_token_ids) if prompt_token_ids else None,
                         messages=messages, stop=list(stop or ()), stream=stream,
                         cache_salt=cache_salt, timeout_s=timeout_s, api_key=api_key,
                         timing=timing)


def _check(msg) -> ClientChunk:
    rec = msg.record
    if isinstance(rec, Error):
        raise GenerationError(rec.code, rec.message)
    if rec.error:
        raise GenerationError("generation_failed", rec.error)
    return rec


def _collect(rid: str, chunks) -> Completion:
    text, ids, reason, usage, timing = [], [], None, None, None
    for c in chunks:
        text.append(c.text)
        ids.extend(c.token_ids)
        if c.finished:
            reason, usage, timing = c.finish_reason, c.usage, c.timing
    return Completion(rid, "".join(text), ids, reason, usage, timing)


class Client:
    """Blocking client; one request at a time per instance."""

    def __init__(self, address: str = DEFAULT_ADDRESS, *, model: str = "",
                 timeout_s: float = 600.0, api_key: str | None = None) -> None:
        self.model, self.timeout_s, self.api_key = model, timeout_s, api_key
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)

    def stream(self, prompt: str | None = None, *, messages: list[dict] | None = None,
               prompt_token_ids: list[int] | None = None, stop=None,
               request_id: str | None = None, cache_salt: str | None = None,
               timing: bool = False, traceparent: str | None = None,
               **sampling: Any) -> Iterator[ClientChunk]:
        rid = request_id or f"sdk-{uuid.uuid4().hex}"
        req = _request(self.model, prompt, messages, prompt_token_ids, stop, True,
                       cache_salt, self.timeout_s, self.api_key, sampling, timing)
        self._sock.send_multipart(encode(req, request_id=rid, trace=traceparent))
        deadline = time.monotonic() + self.timeout_s
        finished = False
        try:
            while not finished:
                left = deadline - time.monotonic()
                if left <= 0 or not self._sock.poll(int(left * 1000)):
                    raise TimeoutError(f"no answer from the gateway in {self.timeout_s} s")
                msg = decode(self._sock.recv_multipart())
                if msg.envelope.request_id != rid:
                    continue  # a late chunk of an earlier, abandoned request
                chunk = _check(msg)
                finished = chunk.finished
                yield chunk
        finally:
            if not finished:
                self.abort(rid)

    def generate(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        rid = kwargs.pop("request_id", None) or f"sdk-{uuid.uuid4().hex}"
        return _collect(rid, self.stream(prompt, request_id=rid, **kwargs))

    def abort(self, request_id: str) -> None:
        self._sock.send_multipart(encode(Abort(reason="client"), request_id=request_id))

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio client; many concurrent requests share one socket."""

    def __init__(self, address: str = DEFAULT_ADDRESS, *, model: str = "",
                 timeout_s: float = 600.0, api_key: str | None = None) -> None:
        self.model, self.timeout_s, self.api_key = model, timeout_s, api_key
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._queues: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None

    async def _read(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            try:
                msg = decode(frames)
            except ValueError:
                continue
            q = self._queues.get(msg.envelope.request_id or "")
            if q is not None:
                q.put_nowait(msg)

    async def stream(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                     prompt_token_ids: list[int] | None = None, stop=None,
                     request_id: str | None = None, cache_salt: str | None = None,
                     timing: bool = False, traceparent: str | None = None,
                     **sampling: Any) -> AsyncIterator[ClientChunk]:
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())
        rid = request_id or f"sdk-{uuid.uuid4().hex}"
        req = _request(self.model, prompt, messages, prompt_token_ids, stop, True,
                       cache_salt, self.timeout_s, self.api_key, sampling, timing)
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = q
        finished = False
        try:
            await self._sock.send_multipart(encode(req, request_id=rid, trace=traceparent))
            while not finished:
                async with asyncio.timeout(self.timeout_s):  # cancel-safe, unlike wait_for
                    msg = await q.get()
                chunk = _check(msg)
                finished = chunk.finished
                yield chunk
        finally:
            self._queues.pop(rid, None)
            if not finished:
                await self.abort(rid)

    async def generate(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        rid = kwargs.pop("request_id", None) or f"sdk-{uuid.uuid4().hex}"
        chunks = [c async for c in self.stream(prompt, request_id=rid, **kwargs)]
        return _collect(rid, chunks)

    async def abort(self, request_id: str) -> None:
        await self._sock.send_multipart(encode(Abort(reason="client"), request_id=request_id))

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._sock.close(0)
        self._ctx.term()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
