"""Token streams from a worker to the gateways, one PUSH socket per gateway address.

Messages for one address are sent in the order they were queued, by one task, so a
request's tokens never overtake each other on the way out.
"""

from __future__ import annotations

import asyncio

import structlog
import zmq.asyncio

from common.protocol import TokenLogprob, Tokens, TopLogprob
from common.zmq_io import PushSocket

log = structlog.get_logger(__name__)


class TokenStreams:
    """The worker's outgoing token streams, keyed by gateway address (``Generate`` and
    ``Prefill`` name the address their tokens go to)."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self._ctx = ctx
        self._queues: dict[str, asyncio.Queue] = {}
        self._tasks: dict[str, asyncio.Task] = {}

    def send(self, addr: str, request_id: str, tokens: Tokens) -> None:
        """Queue ``tokens`` for the gateway at ``addr``; never blocks."""
        q = self._queues.get(addr)
        if q is None:
            q = self._queues[addr] = asyncio.Queue()
            self._tasks[addr] = asyncio.create_task(self._pump(addr, q))
        q.put_nowait((request_id, tokens))

    async def _pump(self, addr: str, q: asyncio.Queue) -> None:
        sock = PushSocket(self._ctx, addr, bind=False)
        try:
            while True:
                request_id, tokens = await q.get()
                try:
                    await sock.send(tokens, request_id=request_id)
                except Exception:
                    log.exception("token stream send failed", addr=addr, request_id=request_id)
        finally:
            await sock.close()

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
        self._queues.clear()


def logprob_records(logprobs) -> list[TokenLogprob]:
    """The engine's per-token logprobs as the records ``Tokens`` carries."""
    return [TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
                         top=[TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
            for lp in logprobs if lp is not None]
