"""Re-export of ``services.sim.profiles``."""

from services.sim.profiles import LLAMA70B_H100X4, PROFILES, SMALL_CPU, Profile  # noqa: F401
