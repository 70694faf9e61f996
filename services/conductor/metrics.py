"""What the conductor's routing counters are labelled with, and its TTFT correction's
collector.

A decision's reason is a sentence for the log (worker ids, predicted times); a metric
label must come from a small fixed set, so ``reason_class`` maps each sentence the
policies write (services/conductor/policy.py, cache_policy.py) to its kind by how it
begins. A sentence no prefix matches is counted as "other", never dropped.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

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


class CorrectionMetrics:
    """A prometheus collector of the TTFT correction (``ttft_correction.py``): each
    window's factor and sample count, and how many first-token times were used,
    clamped or unmatched. Read at scrape time, so nothing is kept twice."""

    def __init__(self, correction) -> None:
        self.correction = correction

    def collect(self):
        c = self.correction
        factor = GaugeMetricFamily(
            "pdserve:ttft_correction_factor", "What predicted TTFTs on a path and worker "
            "are multiplied by (worker '*': the path's, for workers with few samples)",
            labels=["path", "worker"])
        samples = GaugeMetricFamily(
            "pdserve:ttft_correction_window", "First-token times in the window",
            labels=["path", "worker"])
        for f in c.factors():
            factor.add_metric([f.path, f.worker_id], f.factor)
            samples.add_metric([f.path, f.worker_id], f.samples)
        seen = CounterMetricFamily(
            "pdserve:ttft_samples", "Decode workers' first-token times by what became of "
            "them (clamped ones are also used)", labels=["outcome"])
        for outcome, n in (("used", c.used), ("clamped", c.clamped),
                           ("unmatched", c.unmatched)):
            seen.add_metric([outcome], n)
        return [factor, samples, seen]
