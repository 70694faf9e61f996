"""The ZeroMQ client protocol of the gateway (what ``common.client`` speaks).

A ROUTER socket: ``ClientRequest`` starts a request (its id in the envelope) and is
answered by ``ClientChunk`` messages, the last one ``finished``; ``Abort`` stops it and is
answered by ``Ack``. A bad frame, a bad request or a backend refusal is answered with
``Error``; the socket keeps serving.

Ids: a request's id is the client's own name for it, scoped by the client's socket
(its routing identity): a second request with an id still running from that socket is
refused and the first goes on; other sockets have ids of their own, and an ``Abort``
reaches only its own socket's requests. The backend sees an id the gateway makes.

Keys: with ``api_keys`` configured, a ``ClientRequest`` must carry one of them, as HTTP
requests must; the cache salt is then bound to the key (``tenancy``).
"""

from __future__ import annotations

import asyncio
import math
import uuid

import structlog
import zmq
import zmq.asyncio

from common.protocol import Abort, Ack, ClientChunk, ClientRequest, Error, ProtocolError
from common.protocol import decode as decode_message
from common.protocol import encode as encode_message
from common.tokenizer import TextTokenizer
from services.gateway.backend import (
    BackendOverloaded,
    BackendUnavailable,
    GenerationBackend,
    GenerationRequest,
)
from services.gateway.pipeline import PreparedRequest, RequestError, RequestPipeline
from services.gateway.tenancy import ApiKeys, tenant_salt

log = structlog.get_logger(__name__)


class ZmqFrontend:
    def __init__(self, ctx: zmq.asyncio.Context, bind: str, backend: GenerationBackend,
                 pipeline: RequestPipeline, tokenizer: TextTokenizer, model_name: str, *,
                 request_timeout_s: float = 600.0, api_keys: tuple[str, ...] = ()) -> None:
        self.backend, self.pipeline, self.tokenizer = backend, pipeline, tokenizer
        self.model_name = model_name
        self.request_timeout_s = request_timeout_s
        self.keys = ApiKeys(api_keys)
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(bind)
        self.tasks: dict[tuple[bytes, str], asyncio.Task] = {}  # (identity, client's id)
        self._loop_task: asyncio.Task | None = None

    @property
    def address(self) -> str:
        return self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    async def start(self) -> None:
        self._loop_task = asyncio.create_task(self._serve())

    @property
    def loops(self) -> list[asyncio.Task]:
        """The client-port loop, which must run as long as the gateway serves."""
        return [self._loop_task] if self._loop_task is not None else []

    async def close(self) -> None:
        for task in [self._loop_task, *self.tasks.values()]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*[t for t in [self._loop_task, *self.tasks.values()] if t],
                             return_exceptions=True)
        self.sock.close(0)

    async def _send(self, identity: bytes, record, rid: str | None, parent: str | None) -> None:
        await self.sock.send_multipart([identity, *encode_message(record, request_id=rid,
                                                                  parent=parent)])

    async def _serve(self) -> None:
        while True:
            identity, *frames = await self.sock.recv_multipart()
            try:
                msg = decode_message(frames)
            except ProtocolError as exc:
                env = exc.envelope
                log.warning("bad client frame", code=exc.code, error=str(exc))
                await self._send(identity, Error(exc.code, exc.message),
                                 env.request_id if env else None, env.id if env else None)
                continue
            rid, rec = msg.envelope.request_id, msg.record
            if isinstance(rec, Abort):
                task = self.tasks.pop((identity, rid or ""), None)
                if task is not None:
                    task.cancel()
                await self._send(identity, Ack(detail="aborted"), rid, msg.envelope.id)
            elif isinstance(rec, ClientRequest):
                if self.keys.required and not self.keys.valid(
                        rec.api_key.encode() if isinstance(rec.api_key, str) else None):
                    await self._send(identity, Error("unauthorized",
                                                     "missing or incorrect API key (api_key)"),
                                     rid, msg.envelope.id)
                    continue
                rid = rid or f"zmq-{uuid.uuid4().hex}"
                key = (identity, rid)
                if key in self.tasks:
                    await self._send(identity, Error(
                        "bad_request", f"request id {rid!r} is already running from this "
                                       "client; use a new id"), rid, msg.envelope.id)
                    continue
                self.tasks[key] = asyncio.create_task(
                    self._run(identity, rid, msg.envelope.id, rec, msg.envelope.trace))
            else:
                await self._send(identity, Error("unsupported", type(rec).__name__), rid,
                                 msg.envelope.id)

    def _prompt_ids(self, rec: ClientRequest) -> tuple[list[int], bool]:
        if sum(x is not None for x in (rec.prompt, rec.prompt_token_ids, rec.messages)) != 1:
            raise RequestError("give exactly one of prompt, prompt_token_ids or messages")
        if rec.messages is not None:
            text = self.tokenizer.apply_chat_template(rec.messages)
            return self.tokenizer.encode(text, add_special_tokens=False), True
        if rec.prompt is not None:
            return self.tokenizer.encode(rec.prompt), False
        return list(rec.prompt_token_ids), False

    def _prepare(self, rec: ClientRequest) -> PreparedRequest:
        if rec.model and rec.model != self.model_name:
            raise RequestError(f"model {rec.model!r} is not served here "
                               f"(serving {self.model_name!r})", "model")
        ids, chat = self._prompt_ids(rec)
        salt = rec.cache_salt
        if self.keys.required and isinstance(rec.api_key, str):
            salt = tenant_salt(rec.api_key.encode(), salt)
        body = {**rec.sampling, "stop": rec.stop or None, "cache_salt": salt}
        return self.pipeline.prepare(body, ids, chat=chat)

    def _timeout(self, rec: ClientRequest) -> float:
        """The request's own timeout, capped by the gateway's."""
        given = rec.timeout_s
        if given is None:
            return self.request_timeout_s
        if isinstance(given, bool) or not isinstance(given, int | float) \
                or not math.isfinite(given) or given <= 0:
            raise RequestError(f"timeout_s must be a number > 0 seconds, got {given!r}",
                               "timeout_s")
        return min(float(given), self.request_timeout_s)

    async def _run(self, identity: bytes, rid: str, parent: str, rec: ClientRequest,
                   trace: str | None = None) -> None:
        started = False
        internal = f"zmq-{uuid.uuid4().hex}"  # client ids are per socket; the backend's are not
        try:
            timeout_s = self._timeout(rec)
            prepared = await asyncio.to_thread(self._prepare, rec)
            events = self.backend.generate(GenerationRequest(
                internal, prepared.prompt_token_ids, prepared.sampling, prepared.cache_salt,
                prepared.slo_ttft_ms, prepared.slo_tbt_ms, rec.timing, trace))
            started = True
            async with asyncio.timeout(timeout_s):
                async for d in self.pipeline.stream(
                        prepared, events, on_stop=lambda: self.backend.abort(internal)):
                    await self._send(identity, ClientChunk(
                        text=d.text, token_ids=list(d.token_ids), position=d.position,
                        finished=d.finished, finish_reason=d.finish_reason,
                        usage=d.usage, error=d.error, timing=d.timing), rid, parent)
        except (RequestError, ValueError) as exc:
            await self._send(identity, Error("bad_request", str(exc)), rid, parent)
        except BackendOverloaded as exc:
            await self._send(identity, Error("overloaded", str(exc)), rid, parent)
        except BackendUnavailable as exc:
            await self._send(identity, Error("unavailable", str(exc)), rid, parent)
        except TimeoutError:
            await self.backend.abort(internal)
            await self._send(identity, Error("timeout", "request timed out"), rid, parent)
        except asyncio.CancelledError:
            if started:
                await self.backend.abort(internal)
            raise
        except Exception as exc:  # one request's failure never stops the front-end
            log.exception("client request failed", request_id=internal, label=rid)
            await self._send(identity, Error("internal", str(exc)), rid, parent)
        finally:
            if self.tasks.get((identity, rid)) is asyncio.current_task():
                del self.tasks[(identity, rid)]
