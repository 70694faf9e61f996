"""Continuing a request whose decode worker was lost (DESIGN.md, failure rules).

A decode worker is lost when its stream goes quiet and the conductor no longer lists it
alive (its heartbeats stopped), when it hands the request back because it is stopping
(``WORKER_LEAVING``), or when a ``Generate`` to it fails. The gateway then
submits the request again, excluding that worker: the prompt plus the tokens already
streamed as the new prompt, the same sampling with ``max_tokens`` / ``min_tokens``
reduced by what was generated, and ``start_position`` at the first token still owed
(seeded draws are keyed by position, so a seeded stream continues exactly). The new
worker recomputes the KV of what it is given; moving the lost worker's KV instead is
not done (that worker is usually gone).

Each attempt runs under a request id of its own (``attempt_id``): whatever a lost
worker still delivers (tokens in flight, a frozen process that resumes) finds no queue
and is dropped, so two streams never mix. The lost worker is also sent an abort.

With no live decode worker, the gateway asks the conductor again every ``poll_s`` for
up to ``wait_s`` (a restarted worker counts as soon as the conductor lists it alive),
then fails the request with an error event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.protocol import WorkerStatus


@dataclass(frozen=True, slots=True)
class FailoverSettings:
    """``wait_s``: how long one failover may wait for a live decode worker to take the
    request; ``poll_s``: the pause between attempts; ``max_failovers``: how many lost
    workers one request survives."""

    wait_s: float = 30.0
    poll_s: float = 1.0
    max_failovers: int = 3

    def __post_init__(self) -> None:
        if not 0 <= self.wait_s < float("inf"):
            raise ValueError(f"decode failover wait must be >= 0 s, got {self.wait_s}")
        if not 0 < self.poll_s < float("inf"):
            raise ValueError(f"decode failover poll must be > 0 s, got {self.poll_s}")
        if self.max_failovers < 0:
            raise ValueError(f"max failovers must be >= 0, got {self.max_failovers}")


def attempt_id(request_id: str, attempt: int) -> str:
    """The request id a worker sees for the ``attempt``-th submission (0: the first)."""
    return request_id if attempt == 0 else f"{request_id}.r{attempt}"


def resumed_sampling(sampling: dict[str, Any], generated: int) -> dict[str, Any]:
    """``sampling`` for the rest of a stream of which ``generated`` tokens were sent."""
    if not generated:
        return dict(sampling)
    return {**sampling, "max_tokens": sampling.get("max_tokens", 16) - generated,
            "min_tokens": max(0, sampling.get("min_tokens", 0) - generated)}


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
