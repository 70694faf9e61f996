"""Re-export of ``services.sim.workers`` and ``services.sim.prefill_worker``."""

from services.sim.prefill_worker import PrefillWorker  # noqa: F401
from services.sim.workers import DecodeWorker  # noqa: F401
