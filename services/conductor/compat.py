"""Which workers can exchange KV: the conductor's check at handshake.

Workers of one model hand KV to each other (prefill to decode over the data plane),
share it through the cache pool, and are matched by the global prefix index. All of it
assumes that a block's name (its chained hash) and its bytes mean the same on every
worker. A worker whose settings break that would not fail at once: its transfers would
be refused one by one, or worse its blocks would be taken for someone else's. So the
conductor compares every Hello with the model's reference worker and refuses a worker
that differs in any of ``CHECKED``, naming the first field that differs and both values.

The reference is the first registered of the model's live workers (registry order), not
counting the worker's own earlier registration: when the first two disagree, the one
that came first wins, and once every worker of the old settings is gone a worker of new
settings is accepted and becomes the reference.

Not checked, because KV still moves between workers that differ in them: ``tp_size``
(a tensor-parallel engine exports and imports all heads, the TP=1 layout, and its
fingerprint carries no TP size; ``num_kv_heads`` is the model's, not a rank's share),
``num_blocks``, the role, the host and the addresses.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.protocol import WorkerInfo

# In the order they are checked: the most basic first, so the reason names the cause
# (a block size differs, and so therefore does the fingerprint, which covers it).
CHECKED: tuple[str, ...] = (
    "protocol_version",  # control-plane records the worker reads and writes
    "block_size",  # tokens per block: hashes and block tables
    "block_hash",  # hash function and layout of the hashed bytes
    "block_hash_seed",
    "kv_dtype",  # bytes per element
    "num_layers",  # the KV layout: bytes per block and their order
    "num_kv_heads",
    "head_dim",
    "fingerprint",  # the rest: weights and model config (same name, other weights)
)


@dataclass(frozen=True, slots=True)
class Mismatch:
    """``field`` is ``got`` on the new worker but ``expected`` on ``reference_id``."""

    field: str
    expected: object
    got: object
    reference_id: str

    @property
    def reason(self) -> str:
        return (f"{self.field} {self.got!r} differs from {self.expected!r} of "
                f"{self.reference_id}, the first registered worker of the model")


def mismatch(reference: WorkerInfo, info: WorkerInfo) -> Mismatch | None:
    """The first field of ``CHECKED`` in which ``info`` differs from ``reference``;
    None when the two can exchange KV."""
    for name in CHECKED:
        expected, got = getattr(reference, name), getattr(info, name)
        if expected != got:
            return Mismatch(name, expected, got, reference.worker_id)
    return None
