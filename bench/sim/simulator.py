"""Re-export of ``services.sim.simulator``."""

from services.sim.simulator import (  # noqa: F401
    Router,
    SimRequest,
    Simulator,
    load_trace,
    percentile,
)
