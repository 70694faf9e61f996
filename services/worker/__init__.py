"""Model workers: the prefill, decode and unified roles.

Every worker entry point (``python -m services.prefill|decode|unified``, ``pdserve
prefill|decode|unified``, supervisord and Kubernetes alike) imports this package before
anything imports torch, so what is set here reaches the OpenMP runtime torch loads.

``OMP_WAIT_POLICY=PASSIVE`` unless the environment already sets it: torch's CPU build
runs its intra-op threads on libgomp, whose idle threads by default spin for a while
before sleeping. On a host whose cores are busy with other processes a spinning thread
holds a core that the thread it waits for needs, and a 2-thread worker's steps grew
several-fold; passive threads sleep at once (docs/benchmarks.md, "Intra-op threads on
a loaded host"). The runtime reads the variable once, when it loads, so this cannot be
a worker setting read after the imports; set ``OMP_WAIT_POLICY`` (or
``GOMP_SPINCOUNT``) in the worker's environment to choose otherwise.
"""

import os

OMP_WAIT_POLICY_DEFAULT = "PASSIVE"

os.environ.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY_DEFAULT)
