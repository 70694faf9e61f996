"""Token streams from a worker to the gateways, one PUSH socket per gateway address.

Messages for one address are sent in the order they were queued, by one task, so a
request's tokens never overtake each other on the way out.

The addresses come from requests (``Generate`` and ``Prefill`` name them), so the
sockets are bounded: a stream idle for ``idle_close_s`` closes, and past
``max_streams`` addresses the least recently used one is closed to make room. A peer
that names a new address per request costs a bounded number of descriptors, not one
each. (With CURVE keys only a gateway may send Generate, and a stream connects only to
a holder of the gateway's key.)
"""

from __future__ import annotations

import asyncio
import collections

import structlog
import zmq.asyncio

from common.protocol import StreamMoved, TokenLogprob, Tokens, TopLogprob
from common.zmq_io import PushSocket

log = structlog.get_logger(__name__)

MAX_STREAMS = 16  # gateways a worker streams to at once; more than a deployment has
IDLE_CLOSE_S = 60.0


class TokenStreams:
    """The worker's outgoing token streams, keyed by gateway address (``Generate`` and
    ``Prefill`` name the address their tokens go to)."""

    def __init__(self, ctx: zmq.asyncio.Context, *, max_streams: int = MAX_STREAMS,
                 idle_close_s: float = IDLE_CLOSE_S) -> None:
        if max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {max_streams}")
        self._ctx = ctx
        self.max_streams = max_streams
        self.idle_close_s = idle_close_s
        # Least recently used first.
        self._queues: collections.OrderedDict[str, asyncio.Queue] = collections.OrderedDict()
        self._tasks: dict[str, asyncio.Task] = {}
        self._closed = False

    def __len__(self) -> int:
        return len(self._tasks)

    def send(self, addr: str, request_id: str, tokens: Tokens | StreamMoved) -> None:
        """Queue ``tokens`` for the gateway at ``addr``; never blocks."""
        if self._closed:  # the worker is stopping: nobody will send it
            return
        q = self._queues.get(addr)
        if q is None:
            while len(self._queues) >= self.max_streams:
                self._evict()
            q = self._queues[addr] = asyncio.Queue()
            self._tasks[addr] = asyncio.create_task(self._pump(addr, q))
        else:
            self._queues.move_to_end(addr)
        q.put_nowait((request_id, tokens))

    def _evict(self) -> None:
        addr, q = self._queues.popitem(last=False)
        if not q.empty():
            log.warning("token stream evicted with tokens queued", addr=addr,
                        queued=q.qsize())
        self._tasks.pop(addr).cancel()

    async def _pump(self, addr: str, q: asyncio.Queue) -> None:
        sock = None
        try:
            sock = PushSocket(self._ctx, addr, bind=False, server="gateway")
            while True:
                try:
                    async with asyncio.timeout(self.idle_close_s):  # cancel-safe, unlike wait_for
                        request_id, tokens = await q.get()
                except TimeoutError:
                    if q.empty():
                        return
                    continue
                try:
                    await sock.send(tokens, request_id=request_id)
                except Exception:
                    log.exception("token stream send failed", addr=addr, request_id=request_id)
        except (zmq.ZMQError, ValueError) as exc:  # an address no socket can connect to
            log.warning("token stream cannot connect", addr=addr, error=str(exc))
        finally:
            if sock is not None:
                await sock.close()
            if self._queues.get(addr) is q:  # not replaced by a newer stream to addr
                del self._queues[addr]
                self._tasks.pop(addr, None)

    async def flush(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` until every queued message was handed to ZeroMQ (a
        stop closes the sockets without linger: what is still queued then is lost)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while (any(not q.empty() for q in self._queues.values())
               and asyncio.get_running_loop().time() < deadline):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # ZeroMQ's I/O thread puts the last frames on the wire

    async def close(self) -> None:
        self._closed = True
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
