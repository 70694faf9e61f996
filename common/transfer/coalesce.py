"""Chunks that ``send`` queues for one receiver and request go out together as a BATCH.

A prefill worker that has several layers at hand calls ``send`` once per layer; each
such chunk alone costs a header, a token check, a verdict and a receiver wake-up, which
for sub-megabyte chunks is most of what a transfer costs. So a sender whose backend
takes batches (``batch.py``) does not post a small chunk at once: it queues it, per
(address, request), and posts the queue at the event loop's next turn, one BATCH (or
the lone chunk) of everything ``send`` queued meanwhile. Callers change nothing:
``send`` still returns with the chunk on its way, and the same limits hold (a queue that
reaches ``batch.MAX_CHUNKS`` chunks or ``batch.MAX_BYTES`` bytes is posted by the send
that filled it, before it returns). A chunk of ``COALESCE_BYTES`` or more goes alone, at
once, as before: per-message costs are small beside its bytes, and the shm ring keeps
such chunks in the slot just emptied, still in cache.

Order: the posts for one (address, request) run one after another, each waiting for the
previous; ``finish`` posts what is queued and waits for the posts before it writes its
FINISH, so the FINISH never overtakes a chunk. A send that finds the previous post still
waiting (for room in the shm ring, for the socket to drain) waits for it too: that is
the backpressure a send gave before. A post that fails fails the request (its next
``send`` and its ``finish`` raise, as for a chunk whose verdict failed).
"""

from __future__ import annotations

import asyncio

from common.transfer import batch, wire

COALESCE_BYTES = 1 << 20


class Queue:
    """Chunks of one request waiting for the next turn, and their token."""

    __slots__ = ("token", "items", "nbytes")

    def __init__(self, token: bytes) -> None:
        self.token = token
        self.items: list[tuple[int, list[int], memoryview]] = []
        self.nbytes = 0


class Coalescer:
    """The queues and posts of one sender. ``post(address, request_id, message, views)``
    is the sender's ``_start``: it posts one chunk (``views`` a memoryview) or one batch
    (a list); ``connect(address)`` its ``_connection``, awaited before a queue opens so
    that a receiver that cannot be reached fails the ``send`` itself (with a connection
    at hand it returns without suspending)."""

    def __init__(self, post, connect) -> None:
        self._post, self._connect = post, connect
        self._queues: dict[tuple[str, str], Queue] = {}
        self._posting: dict[tuple[str, str], asyncio.Future] = {}
        self.posts = 0  # messages posted from queues: what a test counts

    async def add(self, address: str, request_id: str, layer: int, block_ids: list[int],
                  view: memoryview, token: bytes) -> None:
        key = (address, request_id)
        posting = self._posting.get(key)
        if posting is not None and not posting.done():
            await asyncio.shield(posting)  # backpressure, and order after it
        queue = self._queues.get(key)
        if queue is not None and queue.token != token:
            await self.flush(address, request_id)
            queue = None
        if queue is None:
            await self._connect(address)
            queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = Queue(token)
            asyncio.get_running_loop().call_soon(self._kick, key, queue)
        queue.items.append((layer, block_ids, view))
        queue.nbytes += view.nbytes
        if len(queue.items) >= batch.MAX_CHUNKS or queue.nbytes >= batch.MAX_BYTES:
            await self.flush(address, request_id)

    @property
    def busy(self) -> bool:
        """Whether anything is queued or being posted: else ``flush`` has nothing to do
        (a request sent with ``send_many`` alone skips it)."""
        return bool(self._queues or self._posting)

    async def flush(self, address: str, request_id: str) -> None:
        """Post what is queued for ``(address, request_id)`` now, in the caller's task
        (so its frame is corked with what the caller writes next), after the posts
        before it; return once all of them are done."""
        key = (address, request_id)
        while (posting := self._posting.get(key)) is not None and not posting.done():
            await asyncio.shield(posting)
        queue = self._queues.pop(key, None)
        if queue is None:
            return
        inline = self._posting[key] = asyncio.get_running_loop().create_future()
        try:
            await self._run(None, key, queue)
        finally:
            if not inline.done():  # close() may have cancelled it
                inline.set_result(None)
            if self._posting.get(key) is inline:
                del self._posting[key]

    async def close(self) -> None:
        """Forget what is queued; cancel the posts under way."""
        self._queues.clear()
        posting = list(self._posting.values())
        for task in posting:
            task.cancel()
        await asyncio.gather(*posting, return_exceptions=True)

    def _kick(self, key: tuple[str, str], queue: Queue) -> None:
        if self._queues.get(key) is queue:
            del self._queues[key]
            self._chain(key, queue)

    def _chain(self, key: tuple[str, str], queue: Queue) -> None:
        task = asyncio.ensure_future(self._run(self._posting.get(key), key, queue))
        self._posting[key] = task
        task.add_done_callback(lambda done: self._posting.pop(key, None)
                               if self._posting.get(key) is done else None)

    async def _run(self, before: asyncio.Future | None, key: tuple[str, str],
                   queue: Queue) -> None:
        if before is not None:
            await asyncio.gather(before, return_exceptions=True)
        address, request_id = key
        items, token = queue.items, queue.token
        self.posts += 1
        try:
            if len(items) == 1:
                layer, blocks, view = items[0]
                await self._post(address, request_id,
                                 wire.Chunk(request_id, layer, blocks, 0, 0, token), view)
            else:
                message = batch.Batch(request_id, [i[0] for i in items],
                                      [i[1] for i in items], 0,
                                      [i[2].nbytes for i in items], 0, token)
                await self._post(address, request_id, message, [i[2] for i in items])
        except Exception:  # noqa: S110 - the request holds the failure (InFlight.lost)
            pass
