"""An online-fitted cost model of one model on one kind of worker.

Two linear models, each a sum of physically motivated terms, the formula of
``common/cost_profile.py`` (its ``prefill_terms``, ``prefill_step_terms``,
``decode_terms``; written only there)::

    prefill(n uncached tokens, c cached prefix)  = a + b*n + d*n*(n/2 + c)
    decode step(B sequences, K context tokens)   = e + f*B + g*K

Fitting. The calibration coefficients are the prior. Each observation is rescaled by
what the prior predicts for it, so the fit minimises *relative* error (a 20 ms prefill
counts as much as a 20 s one) and every normalised coefficient is "true / prior", 1.0
at the start. Recursive least squares on the normal equations with exponential
forgetting (old observations fade, so the model follows a worker that slows down). The
calibration counts as ``prior_weight`` observations and fades like the rest; a tiny
constant pull towards it keeps the 3x3 system solvable when the observations do not span
all three terms (every prompt the same length, say). Pure Python.

Units: one worker alone on its host. Where the profile measured its host
(``contention``: ``contention[k-1]`` with k workers busy on it), each observation is
divided by the factor of the ``busy`` count it ran under (``contention.py``), so that
the policy, which multiplies predictions by the factor of the host as it stands, counts
contention once; a model refitted on contended steps without it predicted them slowed
twice. Without factors (the default) nothing is divided.

Contract: inputs are non-negative, and an observed time is within ``MAX_RATIO`` times
of what the calibration predicts for it (``ValueError`` otherwise: nothing is fitted);
predictions are never negative (a fitted coefficient below zero is clamped to zero).
"""

from __future__ import annotations

import math

from common.cost_profile import (
    cost,
    decode_terms,
    prefill_step_terms,
    prefill_terms,
)
from common.records import CostCoefficients
from services.conductor.contention import host_factor


def transfer_time(nbytes: float, bandwidth: float) -> float:
    """Seconds to move ``nbytes`` over a link of ``bandwidth`` bytes/s."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be > 0 bytes/s, got {bandwidth!r}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    return nbytes / bandwidth


def pool_fetch_time(blocks: int, bytes_per_block: float, bandwidth: float) -> float:
    """Seconds to fetch ``blocks`` KV blocks from a pool tier at ``bandwidth`` bytes/s."""
    if blocks < 0:
        raise ValueError(f"blocks must be >= 0, got {blocks!r}")
    return transfer_time(blocks * bytes_per_block, bandwidth)


_FLOOR = 1e-6
# An observation this many times off what the calibration predicts for it, either way
# (or a time of 0), measures a bug or a lie, not the worker: a run of such samples from
# a broken or hostile worker dragged the fit to predicting 0 s. Refused, and
# counted as a bad sample (``router.fit_step_samples``); contention, a slower machine
# of the same kind and a worker that slows down stay well inside it.
MAX_RATIO = 100.0


class _RelativeRLS:
    """Least squares of y ~ sum(theta_j * x_j), fitted relative to a positive prior."""

    def __init__(self, prior: tuple[float, ...], forgetting: float, prior_weight: float):
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting!r}")
        if prior_weight <= 0:
            raise ValueError(f"prior_weight must be > 0, got {prior_weight!r}")
        self.prior = prior
        self.lam = forgetting
        k = len(prior)
        # The prior enters as prior_weight pseudo-observations of "true = prior" on each
        # term and fades with the data; _FLOOR keeps unexcited terms near the prior.
        self.ata = [[prior_weight if i == j else 0.0 for j in range(k)] for i in range(k)]
        self.aty = [prior_weight] * k
        self.count = 0
        self._theta: list[float] | None = list(prior)

    def observe(self, x: tuple[float, ...], y: float) -> None:
        if y < 0:
            raise ValueError(f"observed time must be >= 0, got {y!r}")
        terms = [p * xi for p, xi in zip(self.prior, x, strict=True)]
        scale = sum(terms)
        if scale <= 0:
            return  # the prior predicts no cost: the observation carries no shape
        z = [t / scale for t in terms]
        target = y / scale
        if not 1 / MAX_RATIO <= target <= MAX_RATIO:
            raise ValueError(f"observed {y!r} s is not within {MAX_RATIO:g}x of the "
                             f"calibration's {scale:.3g} s")
        lam, ata, aty = self.lam, self.ata, self.aty
        for i, zi in enumerate(z):
            row = ata[i]
            for j, zj in enumerate(z):
                row[j] = lam * row[j] + zi * zj
            aty[i] = lam * aty[i] + zi * target
        self.count += 1
        self._theta = None

    def theta(self) -> list[float]:
        if self._theta is None:
            k = len(self.prior)
            m = [[self.ata[i][j] + (_FLOOR if i == j else 0.0) for j in range(k)]
                 + [self.aty[i] + _FLOOR] for i in range(k)]
            u = _solve(m)
            self._theta = [max(0.0, ui * p) for ui, p in zip(u, self.prior, strict=True)]
        return self._theta


def _solve(m: list[list[float]]) -> list[float]:
    """Gauss-Jordan with partial pivoting on an augmented k x (k+1) matrix."""
    k = len(m)
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            raise ArithmeticError("singular normal equations")
        m[col], m[pivot] = m[pivot], m[col]
        p = m[col][col]
        row = [v / p for v in m[col]]
        m[col] = row
        for r in range(k):
            if r != col and m[r][col] != 0.0:
                f = m[r][col]
                m[r] = [a - f * b for a, b in zip(m[r], row, strict=True)]
    return [m[r][k] for r in range(k)]


def _check(**values: float) -> None:
    for name, v in values.items():
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v!r}")


class CostModel:
    """Predicts prefill and decode-step seconds; refits as workers report timings."""

    def __init__(self, calibration: CostCoefficients, *, forgetting: float = 0.999,
                 prior_weight: float = 1.0, contention: tuple[float, ...] = ()) -> None:
        if not all(1.0 <= f < math.inf for f in contention):
            raise ValueError(f"contention factors must be >= 1, got {contention!r}")
        self.contention = tuple(contention)
        c = calibration
        self._prefill = _RelativeRLS(
            (c.prefill_fixed_s, c.prefill_per_token_s, c.prefill_per_pair_s),
            forgetting, prior_weight)
        self._decode = _RelativeRLS(
            (c.decode_fixed_s, c.decode_per_seq_s, c.decode_per_ctx_token_s),
            forgetting, prior_weight)

    # ``busy``: the workers busy on the reporting worker's host while the step ran (it
    # counted), as the policy counts them; the step is divided by its factor.
    def observe_prefill(self, n: int, c: int, seconds: float, busy: int = 1) -> None:
        _check(uncached=n, cached=c, busy=busy)
        if n > 0:
            self._prefill.observe(prefill_terms(n, c), self._alone(seconds, busy))

    def observe_prefill_step(self, chunks: list[tuple[int, int]], seconds: float,
                             busy: int = 1) -> None:
        """One engine step that prefilled several prompt chunks at once, each ``(n, c)``:
        its fixed cost counts once, the token and pair terms of the chunks add up."""
        for n, c in chunks:
            _check(uncached=n, cached=c)
        _check(busy=busy)
        x = prefill_step_terms(chunks)
        if x[1] > 0:
            self._prefill.observe(x, self._alone(seconds, busy))

    def observe_decode(self, batch: int, context_tokens: int, seconds: float,
                       busy: int = 1) -> None:
        _check(batch=batch, context_tokens=context_tokens, busy=busy)
        if batch > 0:
            self._decode.observe(decode_terms(batch, context_tokens),
                                 self._alone(seconds, busy))

    def _alone(self, seconds: float, busy: int) -> float:
        return seconds / host_factor(self.contention, busy)

    # The three predictors below run per candidate per routing decision: no kwargs
    # checks on their path, and nothing built but the terms' one small tuple.
    def predict_prefill(self, n: int, c: int = 0) -> float:
        """Seconds to prefill ``n`` uncached tokens after a cached prefix of ``c``."""
        if n < 0 or c < 0:
            _check(uncached=n, cached=c)
        if n <= 0:
            return 0.0
        return cost(self._prefill.theta(), prefill_terms(n, c))

    def predict_decode(self, batch: int, context_tokens: int) -> float:
        """Seconds of one decode step of ``batch`` sequences holding ``context_tokens``."""
        if batch < 0 or context_tokens < 0:
            _check(batch=batch, context_tokens=context_tokens)
        if batch <= 0:
            return 0.0
        return cost(self._decode.theta(), decode_terms(batch, context_tokens))

    def prefill_queue_time(self, requests: int, tokens: int) -> float:
        """Seconds to drain a FIFO of ``requests`` prompts totalling ``tokens`` uncached
        tokens, taken as equal-length prompts with no cached prefix: a workers' heartbeat
        carries only the two totals."""
        if requests < 0 or tokens < 0:
            _check(requests=requests, tokens=tokens)
        if tokens <= 0:
            return 0.0
        r = max(1, requests)
        return r * cost(self._prefill.theta(), prefill_terms(tokens / r, 0))

    def coefficients(self) -> CostCoefficients:
        """The current fit, as a calibration (for logging, or to seed another model)."""
        p, q = self._prefill.theta(), self._decode.theta()
        floor = 1e-15  # a clamped coefficient is reported as tiny, not zero
        return CostCoefficients(*(max(v, floor) for v in (*p, *q)))

    @property
    def observations(self) -> tuple[int, int]:
        return self._prefill.count, self._decode.count
