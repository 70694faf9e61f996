"""The ZeroMQ client protocol of the gateway (what ``common.client`` speaks).

A ROUTER socket: ``ClientRequest`` starts a request (its id in the envelope) and is
answered by ``ClientChunk`` messages, the last one ``finished``; ``Abort`` stops it and is
answered by ``Ack``. A bad frame, a bad request or a backend refusal is answered with
``Error``; the socket keeps serving.
"""

from __future__ import annotations

import asyncio
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
from services.gateway.pipeline import RequestError, RequestPipeline

log = structlog.get_logger(__name__)


class ZmqFrontend:
    def __init__(self, ctx: zmq.asyncio.Context, bind: str, backend: GenerationBackend,
                 pipeline: RequestPipeline, tokenizer: TextTokenizer, model_name: str, *,
                 request_timeout_s: float = 600.0) -> None:
        self.backend, self.pipeline, self.tokenizer = backend, pipeline, tokenizer
        self.model_name = model_name
        self.request_timeout_s = request_timeout_s
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(bind)
        self.tasks: dict[str, asyncio.Task] = {}
        self._loop_task: asyncio.Task | None = None

    @property
    def address(self) -> str:
        return self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    async def start(self) -> None:
        self._loop_task = asyncio.create_task(self._serve())

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
                await self._send(identity, Error(exc.code, str(exc)),
                                 env.request_id if env else None, env.id if env else None)
                continue
            rid, rec = msg.envelope.request_id, msg.record
            if isinstance(rec, Abort):
                task = self.tasks.pop(rid or "", None)
                if task is not None:
                    task.cancel()
                await self._send(identity, Ack(detail="aborted"), rid, msg.envelope.id)
            elif isinstance(rec, ClientRequest):
                rid = rid or f"zmq-{uuid.uuid4().hex}"
                if rid in self.tasks:
                    await self._send(identity, Error("bad_request", f"request id {rid} in use"),
                                     rid, msg.envelope.id)
                    continue
                self.tasks[rid] = asyncio.create_task(
                    self._run(identity, rid, msg.envelope.id, rec))
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

    async def _run(self, identity: bytes, rid: str, parent: str, rec: ClientRequest) -> None:
        started = False
        try:
            if rec.model and rec.model != self.model_name:
                raise RequestError(f"model {rec.model!r} is not served here "
                                   f"(serving {self.model_name!r})", "model")
            ids, chat = self._prompt_ids(rec)
            body = {**rec.sampling, "stop": rec.stop or None, "cache_salt": rec.cache_salt}
            prepared = self.pipeline.prepare(body, ids, chat=chat)
            events = self.backend.generate(GenerationRequest(
                rid, prepared.prompt_token_ids, prepared.sampling, prepared.cache_salt,
                prepared.slo_ttft_ms, prepared.slo_tbt_ms))
            started = True
            async with asyncio.timeout(rec.timeout_s or self.request_timeout_s):
                async for d in self.pipeline.stream(prepared, events,
                                                    on_stop=lambda: self.backend.abort(rid)):
                    await self._send(identity, ClientChunk(
                        text=d.text, token_ids=list(d.token_ids), position=d.position,
                        finished=d.finished, finish_reason=d.finish_reason,
                        usage=d.usage, error=d.error), rid, parent)
        except (RequestError, ValueError) as exc:
            await self._send(identity, Error("bad_request", str(exc)), rid, parent)
        except BackendOverloaded as exc:
            await self._send(identity, Error("overloaded", str(exc)), rid, parent)
        except BackendUnavailable as exc:
            await self._send(identity, Error("unavailable", str(exc)), rid, parent)
        except TimeoutError:
            await self.backend.abort(rid)
            await self._send(identity, Error("timeout", "request timed out"), rid, parent)
        except asyncio.CancelledError:
            if started:
                await self.backend.abort(rid)
            raise
        except Exception as exc:  # one request's failure never stops the front-end
            log.exception("client request failed", request_id=rid)
            await self._send(identity, Error("internal", str(exc)), rid, parent)
        finally:
            self.tasks.pop(rid, None)
