"""The TTFT correction: what the live path takes beyond what the cost model predicts.

The cost model predicts compute from engine step timings; a request's first token also
waits on hops, the decode worker's steps, the KV's last layers, a loaded host. So the
conductor sets each admitted request's predicted TTFT beside the one its decode worker
measured (``TtftSample`` in the worker's heartbeat: from the Generate's arrival to the
KV landing, or to the first token prefilled there), and learns their ratio::

    key       = ("remote", prefill worker id) | ("local", decode worker id)
    ratio     = observed / predicted,  clamped to [1 / max_ratio, max_ratio]
    window    = the key's last ``window`` ratios (and one window per path, all workers)
    factor    = the window's ``quantile``  once it holds ``min_samples``; else the
                path's, once that does; else 1.0

A policy multiplies a prediction by its key's factor; admission then also multiplies by
``margin`` (what the correction still leaves out: the gateway's own time, the
dispersion within a window). Only durations of work that has run enter: a prediction
is recorded when a request is routed, and learnt from only when its decode worker
reports the request's first token. A sample counts only for a request this conductor
routed to the worker reporting it, and only once; any other is counted as unmatched
and dropped. Memory is bounded: ``max_pending`` predictions (the oldest go first: a
request refused downstream never reports) and one window per worker.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from common.records import TtftSample

ALL = "*"  # the path-wide window's worker id
_MIN_PREDICTED_S = 1e-3  # below this a ratio measures noise, not the model


@dataclass(frozen=True, slots=True)
class CorrectionConfig:
    enabled: bool = True
    min_samples: int = 5
    window: int = 32
    quantile: float = 0.9
    max_ratio: float = 4.0  # a ratio is clamped to [1 / max_ratio, max_ratio]
    margin: float = 1.0  # admission's factor on the corrected prediction
    max_pending: int = 4096

    def __post_init__(self) -> None:
        if not 1 <= self.min_samples <= self.window:
            raise ValueError(f"need 1 <= min_samples <= window, got {self.min_samples}, "
                             f"{self.window}")
        if not 0 < self.quantile <= 1:
            raise ValueError(f"quantile must be in (0, 1], got {self.quantile}")
        if not 1 <= self.max_ratio < math.inf:
            raise ValueError(f"max_ratio must be >= 1, got {self.max_ratio}")
        if not 1 <= self.margin < math.inf:
            raise ValueError(f"margin must be >= 1, got {self.margin}")
        if self.max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {self.max_pending}")


class Expected(NamedTuple):
    decode_id: str
    prefill_id: str | None  # None: prefilled on the decode worker
    predicted_s: float  # before any correction


class Factor(NamedTuple):
    path: str
    worker_id: str
    factor: float  # what predictions there are multiplied by now
    samples: int


class TtftCorrection:
    """Per path and worker, the factor that makes predicted TTFTs honest."""

    def __init__(self, config: CorrectionConfig | None = None) -> None:
        self.config = config or CorrectionConfig()
        self._pending: OrderedDict[str, Expected] = OrderedDict()
        self._windows: dict[tuple[str, str], deque[float]] = {}
        self._factors: dict[tuple[str, str], float] = {}
        self.used = self.clamped = self.unmatched = 0

    def factor(self, path: str, worker_id: str) -> float:
        """What a prediction on ``path`` ("remote": of prefill worker ``worker_id``;
        "local": of decode worker ``worker_id``) is multiplied by."""
        if not self.config.enabled:
            return 1.0
        f = self._factors.get((path, worker_id))
        return f if f is not None else self._factors.get((path, ALL), 1.0)

    def expect(self, request_id: str, decision: Expected) -> None:
        """Remember what was predicted for ``request_id`` (routed now; a re-route of the
        same id replaces it)."""
        if not (decision.predicted_s >= _MIN_PREDICTED_S and math.isfinite(decision.predicted_s)):
            return
        pending = self._pending
        pending.pop(request_id, None)
        pending[request_id] = decision
        while len(pending) > self.config.max_pending:
            pending.popitem(last=False)

    def observe(self, worker_id: str, samples: Iterable[TtftSample]) -> int:
        """Learn from a decode worker's first-token times; returns how many were used."""
        used = 0
        for s in samples:
            want = self._pending.get(s.request_id)
            seconds = s.seconds
            if (want is None or want.decode_id != worker_id
                    or s.remote != (want.prefill_id is not None)
                    or isinstance(seconds, bool) or not isinstance(seconds, int | float)
                    or not 0 <= seconds < math.inf):
                self.unmatched += 1
                continue
            del self._pending[s.request_id]
            ratio = seconds / want.predicted_s
            top = self.config.max_ratio
            if not 1 / top <= ratio <= top:
                self.clamped += 1
                ratio = min(top, max(1 / top, ratio))
            path, key = ("remote", want.prefill_id) if want.prefill_id else ("local", worker_id)
            for k in ((path, key), (path, ALL)):
                self._learn(k, ratio)
            used += 1
        self.used += used
        return used

    def _learn(self, key: tuple[str, str], ratio: float) -> None:
        cfg = self.config
        window = self._windows.get(key)
        if window is None:
            window = self._windows[key] = deque(maxlen=cfg.window)
        window.append(ratio)
        if len(window) >= cfg.min_samples:
            ordered = sorted(window)
            self._factors[key] = ordered[max(0, math.ceil(cfg.quantile * len(ordered)) - 1)]

    def forget(self, worker_id: str) -> None:
        """Drop a worker's windows (it died; a new process starts afresh)."""
        for key in [k for k in self._windows if k[1] == worker_id]:
            del self._windows[key]
            self._factors.pop(key, None)

    def factors(self) -> list[Factor]:
        """Every window, for stats and metrics."""
        return [Factor(path, wid, self._factors.get((path, wid), 1.0), len(w))
                for (path, wid), w in sorted(self._windows.items())]

    @property
    def pending(self) -> int:
        return len(self._pending)
