"""The planner: how many prefill and decode workers should run, and making it so.

    conductor GetStats --> load.py (per-role load and predicted TTFT/TBT)
                       --> decide.py (a pure policy: hysteresis, cool-down, min/max)
                       --> an actuator (supervisord, Kubernetes, local processes)

``server.py`` is the process (``pdserve planner``); see docs/deploy.md.
"""
