"""What the conductor's routing counters are labelled with.

A decision's reason is a sentence for the log (worker ids, predicted times); a metric
label must come from a small fixed set, so ``reason_class`` maps each sentence the
policies write (services/conductor/policy.py, cache_policy.py) to its kind by how it
begins. A sentence no prefix matches is counted as "other", never dropped.
"""

from __future__ import annotations

# Longest prefixes first: "local prefill would stall" must win over "local ".
REASON_CLASSES = (
    ("colocated", "colocated"),
    ("short prompt", "short_prompt"),
    ("no prefill worker", "no_prefill_worker"),
    ("disaggregated", "disaggregated"),
    ("local prefill would stall", "decode_stall"),
    ("local ", "local_faster"),
    ("remote ", "remote_faster"),
    ("no decode worker has room", "no_kv_room"),
    ("predicted TBT", "tbt_slo"),
    ("predicted TTFT", "ttft_slo"),
)


def reason_class(reason: str) -> str:
    """The label for a decision's (or rejection's) reason text."""
    for prefix, label in REASON_CLASSES:
        if reason.startswith(prefix):
            return label
    return "other"
