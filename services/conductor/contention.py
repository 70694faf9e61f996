"""Host contention as the conductor counts it: workers that share a host's cores slow
each other's steps by the profile's factor ``contention[k-1]``, k the workers busy on
that host (the one stepping counted). One count and one factor for the two sides that
need them, so they cannot drift apart:

* the routing policy (``cache_policy.py``) multiplies the cost model's predictions by
  the factor of the host as it stands at the decision;
* the cost model's fit (``cost_model.py``, fed by ``router.fit_step_samples``) divides
  each reported step by the factor it ran under, so the model stays in "one worker
  alone" units and the factor is counted once, not once measured and once applied.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.conductor.registry import WorkerView


def host_factor(factors: Sequence[float], busy: int) -> float:
    """The step factor with ``busy`` workers busy on one host (at least one), the last
    measured beyond the list; 1.0 with no factors (not measured)."""
    if not factors:
        return 1.0
    return factors[min(max(busy, 1), len(factors)) - 1]


def busy_by_host(workers: Iterable[WorkerView]) -> dict[str, set[str]]:
    """Per host id, the live workers with work: running, queued or routed there."""
    busy: dict[str, set[str]] = {}
    for w in workers:
        if w.alive and (w.load or w.queued_prefill_tokens or w.pending_tokens):
            busy.setdefault(w.host_id, set()).add(w.worker_id)
    return busy


def busy_on_host(busy: dict[str, set[str]], worker: WorkerView) -> int:
    """k for ``worker``'s compute: the busy workers on its host (``busy_by_host``), it
    counted busy whatever its last heartbeat said (it is the one stepping)."""
    on_host = busy.get(worker.host_id, ())
    return len(on_host) + (worker.worker_id not in on_host)
