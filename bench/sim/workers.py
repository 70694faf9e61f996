"""Re-export of ``services.sim.workers``."""

from services.sim.workers import DecodeWorker, PrefillWorker  # noqa: F401
