"""What a worker tells the conductor about its KV when it says Hello, and what a refusal
means to it.

The conductor compares these facts with its model's other workers and refuses a worker
whose KV cannot be exchanged with theirs (``services/conductor/compat.py``). A refusal
is final for the process: its settings are wrong and waiting will not fix them, so
registration raises ``WorkerRefused``, which takes the process down with the reason in
its log, instead of retrying forever. It exits with ``EXIT_CONFIG`` (78), not 1, so a
supervisor configured as deploy/ is does not restart it into the same refusal.
"""

from __future__ import annotations

from typing import NamedTuple

from common.block_hash import BLOCK_HASH_ALGORITHM, BLOCK_HASH_SEED
from common.protocol import PROTOCOL_VERSION
from common.service_main import EXIT_CONFIG, ServiceExit

# Error codes answering Hello that no retry can change: "incompatible" (the KV check)
# and "version" (the conductor speaks another control-plane protocol).
REFUSED_CODES = frozenset({"incompatible", "version"})


class WorkerRefused(ServiceExit):
    """The conductor refused this worker at handshake; the message says why."""

    exit_code = EXIT_CONFIG


class KVLayout(NamedTuple):
    """The element type and shape of the worker's KV: what makes two workers' blocks
    the same bytes (besides the block size and the weights)."""

    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int


def kv_layout(engine) -> KVLayout:
    """``engine``'s KV layout; reads the engine, so it runs on the engine thread.

    ``num_kv_heads`` is the model's, not one tensor-parallel rank's share: workers of
    different TP sizes hold the same blocks. The simulated engine has no heads; its
    bytes per block are in its fingerprint."""
    cfg = getattr(engine, "model_config", None)
    if cfg is None:
        return KVLayout("sim", engine.kv_store.num_layers, 0, 0)
    return KVLayout(engine.config.kv_dtype_name, cfg.num_layers, cfg.num_kv_heads,
                    cfg.head_dim)


def hash_and_version() -> dict:
    """The block-hash and protocol facts every worker of this build reports."""
    return {"block_hash": BLOCK_HASH_ALGORITHM, "block_hash_seed": BLOCK_HASH_SEED,
            "protocol_version": PROTOCOL_VERSION}
