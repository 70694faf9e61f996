"""Continuing a request whose decode worker was lost (DESIGN.md, failure rules).

A decode worker is lost when its stream goes quiet and the conductor no longer lists it
alive (its heartbeats stopped), when it hands the request back because it is stopping
(``WORKER_LEAVING``), or when a ``Generate`` to it fails. The gateway then
submits the request again, excluding that worker: the prompt plus the tokens already
streamed as the new prompt, the same sampling, and ``start_position`` at the first
token still owed. The worker keeps those last ``start_position`` prompt tokens as the
request's output so far, so ``max_tokens``, ``min_tokens``, penalties and seeded draws
(keyed by output position) all continue exactly as if nothing had happened; only the
route's cost estimate uses what is still owed (``remaining_tokens``). The new
worker recomputes the KV of what it is given. A worker that stops on purpose first
tries to move each request with its KV to another decode worker itself; when it does,
it says so on the stream (``StreamMoved``) and nothing is re-routed (``moved_route``).

Each attempt runs under a request id of its own (``attempt_id``): whatever a lost
worker still delivers (tokens in flight, a frozen process that resumes) finds no queue
and is dropped, so two streams never mix. The lost worker is also sent an abort.

With no live decode worker, the gateway asks the conductor again every ``poll_s`` for
up to ``wait_s`` (a restarted worker counts as soon as the conductor lists it alive),
then fails the request with an error event.

A new request waits too, but less: when the conductor answers its first Route with
``unavailable`` (no live decode worker, as in the second after a conductor restart,
before the workers have said Hello again), the gateway asks again every
``route_poll_s`` for up to ``route_wait_s`` from its arrival (``wait_for_route``),
then answers 503. A new request whose first ``Generate`` fails (the worker is stopping
and answers ``unavailable``, or it does not answer: frozen, or killed just as it was
chosen) is handled as a lost worker: the worker is avoided, aborted, and the request
routed again at once, since another live worker may take it even when the wait is
over; at most ``max_failovers`` workers are passed over so.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog

from common.protocol import RouteReply, StreamMoved, WorkerStatus
from services.gateway.backend import BackendUnavailable

T = TypeVar("T")
log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class FailoverSettings:
    """``wait_s``: how long one failover may wait for a live decode worker to take the
    request; ``poll_s``: the pause between attempts; ``max_failovers``: how many lost
    workers one request survives. ``route_wait_s``: how long a new request waits for
    a live decode worker when the conductor has none (0: answer at once);
    ``route_poll_s``: the pause between its Routes (short: the usual gap, a conductor
    restart, lasts a heartbeat or so)."""

    wait_s: float = 30.0
    poll_s: float = 1.0
    max_failovers: int = 3
    route_wait_s: float = 5.0
    route_poll_s: float = 0.2

    def __post_init__(self) -> None:
        if not 0 <= self.wait_s < float("inf"):
            raise ValueError(f"decode failover wait must be >= 0 s, got {self.wait_s}")
        if not 0 < self.poll_s < float("inf"):
            raise ValueError(f"decode failover poll must be > 0 s, got {self.poll_s}")
        if self.max_failovers < 0:
            raise ValueError(f"max failovers must be >= 0, got {self.max_failovers}")
        if not 0 <= self.route_wait_s < float("inf"):
            raise ValueError(f"route wait must be >= 0 s, got {self.route_wait_s}")
        if not 0 < self.route_poll_s < float("inf"):
            raise ValueError(f"route poll must be > 0 s, got {self.route_poll_s}")


class NoDecodeWorker(BackendUnavailable):
    """The conductor's ``unavailable``: no live decode worker serves the model now."""


class SubmitFailed(BackendUnavailable):
    """A ``Generate`` that failed on the worker ``route`` chose (it may be gone, frozen
    or stopping; it may also have admitted the request after all)."""

    def __init__(self, message: str, route: RouteReply) -> None:
        super().__init__(message)
        self.route = route


async def wait_for_route(start: Callable[[], Awaitable[T]], settings: FailoverSettings,
                         request_id: str = "") -> T:
    """``start()`` (a first Route and Generate), asked again while it raises
    ``NoDecodeWorker``, for up to ``settings.route_wait_s``, and at once after it
    raises ``SubmitFailed`` (``start`` avoids that worker from then on), for up to
    ``settings.max_failovers`` workers; then BackendUnavailable."""
    deadline = time.monotonic() + settings.route_wait_s
    waited, passed_over = False, 0
    while True:
        try:
            return await start()
        except SubmitFailed as exc:
            passed_over += 1
            log.warning("decode worker did not take a new request, re-routing",
                        request_id=request_id, worker_id=exc.route.decode_id, error=str(exc))
            if passed_over > settings.max_failovers:
                raise BackendUnavailable(
                    f"{passed_over} decode workers did not take the request: {exc}") from exc
            continue
        except NoDecodeWorker as exc:
            if not waited and settings.route_wait_s > 0:
                waited = True
                log.info("waiting for a decode worker", request_id=request_id,
                         up_to_s=settings.route_wait_s, error=str(exc))
            if time.monotonic() + settings.route_poll_s > deadline:
                raise BackendUnavailable(
                    f"{exc} (waited {settings.route_wait_s:g}s for one)") from exc
        await asyncio.sleep(settings.route_poll_s)


def attempt_id(request_id: str, attempt: int) -> str:
    """The request id a worker sees for the ``attempt``-th submission (0: the first)."""
    return request_id if attempt == 0 else f"{request_id}.r{attempt}"


def remaining_tokens(sampling: dict[str, Any], generated: int) -> int:
    """How many tokens a stream of which ``generated`` were sent may still produce."""
    return max(0, int(sampling.get("max_tokens", 16)) - generated)


def moved_route(route: RouteReply, moved: StreamMoved, request_id: str) -> RouteReply:
    """``route`` once its decode worker moved the request, KV and all, to another
    (a planned stop): liveness checks and aborts go there from now on. Not a failover:
    the attempt, its request id and its tokens carry on."""
    log.info("stream moved with its KV", request_id=request_id, worker_id=route.decode_id,
             to=moved.worker_id, position=moved.position)
    return dataclasses.replace(route, decode_id=moved.worker_id,
                               decode_addr=moved.control_addr)


def listed_alive(workers: list[WorkerStatus], worker_id: str, addr: str) -> bool:
    """Whether this very instance (id and control address) is listed alive."""
    return any(w.alive and w.info.worker_id == worker_id and w.info.control_addr == addr
               for w in workers)


class LostWorkers:
    """The decode workers one request has lost, which of them Route must avoid, and how
    many times the request was submitted again (``attempts``, for ``attempt_id``).

    A lost worker is avoided while the conductor still lists that instance alive (its
    heartbeats have not lapsed yet, or it is alive but failed our ``Generate``). Once
    the conductor has listed it dead or under another address, an alive entry under
    its id is a new process (a restart) and may take the request."""

    def __init__(self) -> None:
        self._avoid: dict[str, str] = {}  # worker id -> control address of the lost one
        self.attempts = 0

    def add(self, worker_id: str, addr: str) -> None:
        self._avoid[worker_id] = addr

    def exclude(self, workers: list[WorkerStatus] | None) -> list[str]:
        """The ids to exclude now, given the conductor's list (None: not known)."""
        if workers is not None:
            for wid, addr in list(self._avoid.items()):
                if not listed_alive(workers, wid, addr):
                    del self._avoid[wid]
        return sorted(self._avoid)
