"""``pdserve advise``: which deployment of N workers serves a workload best under its
SLOs, found by replaying the workload on the cluster simulator (``services/sim/``) under
the conductor's own routing (``workload.py``: the load; ``search.py``: the deployments
and their outcomes; ``config.py``: the chosen one as a deploy/configs file; ``report.py``:
table, progress and plot; ``cli.py``: the command)."""
