"""Which role may send which message to which endpoint: every receiving socket's table.

The tables apply when the control plane runs with CURVE keys (``common.zmq_auth``): a
request from a role not listed for its type is answered with ``Error("forbidden")``, a
pushed or published message is dropped, logged and counted. Without keys no sender has
a known role and nothing is checked (plain mode: a trusted single host only).

``client`` is the role of local tools and tests: it may read stats, nothing more.
"""

from __future__ import annotations

from types import MappingProxyType

from common.zmq_auth import ROLES, WORKER_ROLES, Policy


def _table(*grants: tuple[tuple[str, ...], tuple[str, ...]]) -> Policy:
    """Union of (roles, message types) grants; every known role may ask for stats."""
    table: dict[str, set[str]] = {role: {"get_stats"} for role in ROLES}
    for roles, types in grants:
        for role in roles:
            table[role].update(types)
    return MappingProxyType({role: frozenset(types) for role, types in table.items()})


# Conductor ROUTER: workers register; gateways route and list workers.
CONDUCTOR_CONTROL = _table(
    (WORKER_ROLES, ("hello", "leaving")),
    # A stopping decode worker looks for one to move its requests to.
    (("gateway", "client", "decode", "unified"), ("list_workers",)),
    (("gateway",), ("route",)),
)

# Conductor SUB (bound): heartbeats and prefix-cache events come from workers only.
CONDUCTOR_EVENTS = _table((WORKER_ROLES, ("heartbeat", "kv_event")))

# Gateway token PULL: token streams come from the workers that produce tokens; a stream
# moves only from a decode-capable worker.
GATEWAY_STREAM = _table((WORKER_ROLES, ("tokens",)), (("decode", "unified"), ("stream_moved",)))

# Worker ROUTER: gateways start and stop requests; a decode-capable worker asks a prefill
# worker for KV (and stops it), or moves a running request to another decode worker;
# the conductor rebuilds its prefix index.
WORKER_CONTROL = _table(
    (("gateway",), ("generate", "abort")),
    (("decode", "unified"), ("prefill", "abort", "migrate", "migrate_done")),
    (("conductor",), ("resync",)),
)

# Cache-pool ROUTER: workers store, fetch, probe and remove blocks; the conductor resyncs
# its index of the pool.
POOL_BLOCK_TYPES = ("pool_put", "pool_commit", "pool_get", "pool_exists", "pool_remove")
CACHE_POOL_CONTROL = _table(
    (WORKER_ROLES, POOL_BLOCK_TYPES),
    (("conductor",), ("resync", "pool_exists")),
)
