"""What the planner acts through: one interface, built by ``actuators.make_actuator``.

Contract:

- ``start()`` checks that the actuator can do its job (the programs, Deployments or
  command it was given exist and answer) and raises ``ActuatorError`` if not: a planner
  that cannot act must not start.
- ``count(role)`` is the number of workers of ``role`` the actuator runs or has asked for
  (started and starting; not those stopping). The planner's decisions are made on it, so
  a worker still loading is counted and not asked for twice.
- ``scale(role, n)`` asks for ``n`` workers of ``role`` and returns at once, without
  waiting for a worker to come up or to finish draining. Scaling in stops a worker with
  SIGTERM (a supervisor's stop, a pod's termination): the worker tells the conductor it
  is leaving and hands back or finishes what it runs before it exits, so no request
  fails. Raises ``ActuatorError`` when the request was not carried out; a failed call
  leaves the planner running (the next look tries again).
- ``close()`` releases what the actuator holds; the local actuator stops its workers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class ActuatorError(RuntimeError):
    """The actuator could not read or change a role's workers."""


class Actuator(ABC):
    name: str = ""

    async def start(self) -> None:  # noqa: B027 - nothing to check by default
        """Check the actuator can act; ``ActuatorError`` if not."""

    @abstractmethod
    async def count(self, role: str) -> int:
        """Workers of ``role`` running or starting."""

    @abstractmethod
    async def scale(self, role: str, n: int) -> None:
        """Ask for ``n`` workers of ``role``."""

    async def close(self) -> None:  # noqa: B027 - nothing held by default
        """Release what the actuator holds."""


class NoActuator(Actuator):
    """Decide, log and count, act on nothing: counts are what was decided."""

    name = "none"

    def __init__(self, initial: dict[str, int]) -> None:
        self._counts = dict(initial)

    async def count(self, role: str) -> int:
        return self._counts[role]

    async def scale(self, role: str, n: int) -> None:
        self._counts[role] = n
