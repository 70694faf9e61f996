"""The ucx backend: UCX through ``ucxx`` (the optional extra ``pdserve[ucx]``, package
``ucxx-cu12``). UCX picks the transport itself: RDMA where the hardware has it, else its
own TCP and shared-memory transports (CPU-only hosts included). The sender is in
``ucx_sender.py``, the receiver in ``ucx_receiver.py``.

Address: ``ucx://host:port``, the port of a ucxx listener. The listener binds every
interface (ucxx offers no bind address); ``host`` is only what the receiver advertises.

Messages go on the sender's endpoint in runs, a run to a tagged message: its length
(u32, little-endian), then ``wire.py`` messages back to back, each its prefix, its
header and, when its payload is at most ``INLINE_BYTES``, its payload. A payload
larger than that follows its run as a tagged message of its own, and ends the run. A
CHUNK's head slice (a tensor-parallel rank's KV heads, ``Chunk.heads``) is in its
header, so slices travel as any chunk does and the receiver hands them to the table's
slice path (``slices.py``), as tcp and shm do. The
sender adds each message to the endpoint's run and posts the run at the event loop's
next turn, once it holds ``RUN_BYTES``, or at once with a FINISH, an ABORT or a large
payload: a request of small chunks costs a few UCX messages, not two a chunk (each one
costs hundreds of µs inside ucxx). The receiver keeps a run's receive posted (into one
of two buffers, used by turns, as large as a run can be); on each run it posts the
receive of a payload that follows, of the size its prefix announced, straight into one
of two buffers it uses by turns for the connection (grown, never shrunk), then the next
run's. Once such a payload is in, the next run has usually come too (the sender does not
wait for one send to end before posting the next): its own payload's receive is posted
before this one is verified, so that a payload is always on its way while the receiver
works; an unmatched payload would wait in UCX until then. A payload nobody wants is
received into one byte and its truncation ignored. Verdicts go back on the same
endpoint, in chunk order, batched as the tcp receiver does (``frame_reader.py``), a
batch to a tagged message framed as a run: its length then its VERDICT messages. The
sender keeps a receive posted for them.

Configuration: ``UCX_*`` environment variables (``UCX_TLS=tcp,self,sm``, device
choices...) as read by UCX when ucxx first starts in the process; ucxx keeps one
context per process. ``ucxx`` is imported only when a ucx receiver or sender is built:
importing it loads numpy, which the rest of ``common/`` never does.

Idle connections: ucxx, in its default progress mode, waits for a request by polling it
with ``asyncio.sleep(0)``, so a process with a receive posted (each connection keeps
one, for the next run or the next verdicts) would keep a core busy while nothing moves.
Those receives are waited for by ``receive`` instead: polled at once for
``SPIN_S``, then with sleeps doubling up to ``IDLE_POLL_S``, so the first message after
a pause is seen at most that late. That is still a wake-up every 0.5 ms per posted
receive: on a 2-core VM a timer wake-up costs 15-70 µs, and an idle sender-receiver pair
measured 7-11 % of a core on the event loop, plus about 2 % in ucxx's progress thread
(thread mode waits on its epoll with a 1 ms timeout, fixed inside ucxx). Waiting on
ucxx's Python futures instead (``UCXPY_ENABLE_PYTHON_FUTURE=1``) took the loop's share
to nothing, but doubled a small transfer's latency (a notifier-thread hop per request)
and ties the notifier to the first event loop (it raised once that loop closed), so it
is not used; polling less often trades first-message latency for little (two tasks
sleeping 4 ms still cost 3.4 % of a core there).

So how often a waiting receive looks depends on whether a message is due: each side has
a ``Pacer`` that knows. The receiver is busy while its table has a transfer expected,
the sender's connection while chunks wait for verdicts; then the receive polls as above.
Otherwise it naps ``IDLE_S`` between looks, and the ``Pacer`` ends every nap at once
when a message becomes due (``TransferTable.expect``, a chunk written): an idle pair
costs a wake-up per ``IDLE_S`` and per receive, under 1 % of a core beside ucxx's own
progress thread, while the first message of a transfer is still seen within
``IDLE_POLL_S``. Only a message nobody waits for (a late chunk, a closed endpoint) is
seen up to ``IDLE_S`` late. ucxx's "blocking" progress mode, which would wait on UCX's
event descriptor instead, kept half a core busy with ucxx 0.52 on an idle pair, so the
thread mode stays.

Dead peer: when a sender's endpoint fails or closes, each live transfer that carried a
message on it fails at once ("sender connection lost"); ``send`` raises TransferError
when the receiver's endpoint fails.
"""

from __future__ import annotations

import asyncio
import os
import struct
import time

from common.transfer import wire
from common.transfer.negotiate import BackendUnavailable

SCHEME = "ucx"
PACKAGE = "ucxx-cu12"
BATCH_LENGTH = struct.Struct("<I")
INLINE_BYTES = 1 << 20  # payloads up to this travel inside their run
RUN_BYTES = 4 << 20  # a run is posted once this full; larger only with a single message
SPIN_S = 200e-6  # a receive is polled without sleeping this long after it is posted
IDLE_POLL_S = 500e-6  # then at least this often, while a message is due (Pacer)
IDLE_S = 20e-3  # how often while none is
RUN_BUFFER_BYTES = BATCH_LENGTH.size + max(
    RUN_BYTES, wire.PREFIX.size + wire.MAX_HEADER_BYTES + INLINE_BYTES
)


def load_ucxx():
    """The ``ucxx`` module; BackendUnavailable (an ImportError) naming the package if it
    cannot be imported."""
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # ucxx sets a few itself
    try:
        import ucxx
    except Exception as exc:  # ImportError, or OSError from a missing shared library
        raise BackendUnavailable(
            "ucx",
            f"cannot import ucxx ({type(exc).__name__}: {exc}); install the 'ucx' "
            f"extra (pip install 'pdserve[ucx]', package {PACKAGE})",
            PACKAGE,
        ) from exc
    return ucxx


def split_run(buffer: bytearray) -> list[tuple[wire.Kind, memoryview, int, memoryview | None]]:
    """The messages of the run at the start of ``buffer``, as ``(kind, header, payload
    length, payload)``; ``payload`` is None for one that follows on its own (the last
    message's only). WireError if the run does not follow the spec."""
    (length,) = BATCH_LENGTH.unpack_from(buffer)
    end = BATCH_LENGTH.size + length
    if length == 0 or end > len(buffer):
        limit = len(buffer) - BATCH_LENGTH.size
        raise wire.WireError(f"a run of {length} bytes, outside (0, {limit}]")
    view, offset, messages = memoryview(buffer), BATCH_LENGTH.size, []
    while offset < end:
        if messages and messages[-1][3] is None:
            raise wire.WireError("a message after one whose payload follows on its own")
        if end - offset < wire.PREFIX.size:
            raise wire.WireError("a run that ends inside a message")
        kind, header_len, size = wire.decode_prefix(view[offset : offset + wire.PREFIX.size])
        if kind is wire.Kind.VERDICT:
            raise wire.WireError("VERDICT goes from receiver to sender, not back")
        if kind is wire.Kind.BATCH:  # ucx senders send chunks one by one
            raise wire.WireError("the ucx backend takes no BATCH")
        start = offset + wire.PREFIX.size
        offset = start + header_len
        payload = None
        if size <= INLINE_BYTES:
            payload, offset = view[offset : offset + size], offset + size
        if offset > end:
            raise wire.WireError("a run that ends inside a message")
        messages.append((kind, view[start : start + header_len], size, payload))
    return messages


class Pacer:
    """Whether a message is due on one side's connections (``busy()``), and the naps of
    its receives that wait while none is; ``wake()`` ends them (see the module's
    docstring). Runs on one event loop."""

    def __init__(self, busy) -> None:
        self.busy = busy
        self._naps: set[asyncio.Future] = set()

    async def nap(self) -> None:
        """Return after ``IDLE_S``, or at the next ``wake()``."""
        loop = asyncio.get_running_loop()
        nap = loop.create_future()
        timer = loop.call_later(IDLE_S, _end_nap, nap)
        self._naps.add(nap)
        try:
            await nap
        finally:
            timer.cancel()
            self._naps.discard(nap)

    def wake(self) -> None:
        for nap in self._naps:
            _end_nap(nap)


def _end_nap(nap: asyncio.Future) -> None:
    if not nap.done():
        nap.set_result(None)


async def receive(ep, buffer, pacer: Pacer | None = None) -> None:
    """``ep.recv(buffer)`` for a receive that may wait long: the same tagged receive,
    waited for without keeping a core busy (see the module's docstring), looking only
    every ``IDLE_S`` while ``pacer`` says no message is due. Falls back to ``ep.recv``
    where this ucxx's endpoint lacks the parts it uses."""
    try:
        from ucxx._lib.arr import Array
        from ucxx.types import Tag, TagMaskFull

        handle, tag = ep._ep, Tag(ep._tags["msg_recv"])
    except (ImportError, AttributeError, KeyError, TypeError):
        await ep.recv(buffer)
        return
    handle.raise_on_error()
    if ep.closed:
        await ep.recv(buffer)  # raises as ucxx does for a closed endpoint
        return
    request = handle.tag_recv(Array(buffer), tag, TagMaskFull)
    spin_until, delay = time.monotonic() + SPIN_S, 0.0
    while not request.completed:
        if delay >= IDLE_POLL_S and pacer is not None and not pacer.busy():
            await pacer.nap()
            continue
        await asyncio.sleep(delay)
        if delay or time.monotonic() > spin_until:
            delay = min(IDLE_POLL_S, 2 * delay or 25e-6)
    request.check_error()
