"""Cost profiles: what prefill, one decode step and moving KV cost on one kind of worker.

The conductor starts its cost model from a profile (its calibration, refitted online
from what workers report); the simulated executor sleeps what a profile says. The cost
formula is written once, here, as its terms (``prefill_terms``, ``prefill_step_terms``,
``decode_terms``); a cost is the dot product of coefficients and terms (``cost``), and
the conductor's cost model fits the same terms::

    prefill(n uncached tokens, c cached prefix) = a + b*n + d*n*(n/2 + c)
    decode step(B sequences, K context tokens)  = e + f*B + g*K

``b`` is the per-token matmul cost, ``d`` the cost of one (query, key) pair of causal
attention (n new queries see c cached keys and on average n/2 new ones), ``e`` the
weight read of one step, ``f`` the per-sequence cost, ``g`` the per-context-token KV
read. An engine step that prefills several chunks pays ``a`` once.

Two optional fields say what serving on a host costs beyond the engine's own steps,
for a simulator that runs a deployment's workers on one host (they share its cores):
``contention[k-1]`` multiplies a step run while ``k`` processes on the host are busy at
once (a simulator counts the workers busy, and the serving processes' share of a core;
``[]``: not measured, 1.0; ``contention[0]``, one busy process against the fitted
steps, is near 1 on the machine and load they were fitted on), and
``token_overhead_s`` is added to a decode step per sequence in it (the serving path's
work per streamed token: the worker's streaming, the gateway, the client). Neither
changes ``prefill_s`` or ``decode_step_s``, which stay the engine's step alone (what
workers report and the conductor fits); ``contended`` and ``served_decode_step_s`` apply them.

On disk a profile is one JSON object (``deploy/profiles/<name>.json``) with every field
below; ``pool_bandwidth`` and ``kv_capacity_tokens`` default to 0, and ``notes`` (how
it was made), ``fit`` (the measurements behind it), ``contention`` and
``token_overhead_s`` are optional. ``load_profile``
takes a path or the name of a profile in that folder.

Contract: coefficients are > 0 (a cost that is really zero is written as a tiny number),
``kv_bytes_per_token`` and ``block_size`` are > 0 integers, bandwidths in bytes/s with
``link_bandwidth`` > 0 and ``pool_bandwidth`` >= 0 (0: no pool), ``contention``
factors >= 1 that do not fall as ``k`` grows, ``token_overhead_s`` >= 0. Anything else is a
``ValueError`` naming the field and the file. No torch, no numpy.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

PROFILE_DIR = Path(__file__).resolve().parents[1] / "deploy" / "profiles"
COEFFICIENTS = ("prefill_fixed_s", "prefill_per_token_s", "prefill_per_pair_s",
                "decode_fixed_s", "decode_per_seq_s", "decode_per_ctx_token_s")


Terms = tuple[float, float, float]


def prefill_terms(n: float, c: float) -> Terms:
    """The prefill cost's terms for ``n`` new tokens after ``c`` cached ones:
    (fixed, tokens, attention pairs)."""
    return (1.0, n, n * (n / 2 + c))


def prefill_step_terms(chunks: Iterable[tuple[float, float]]) -> Terms:
    """The terms of one engine step that prefills several chunks, each ``(n, c)``: its
    fixed cost counts once, the token and pair terms of the chunks add up."""
    tokens = pairs = 0.0
    for n, c in chunks:
        _, t, p = prefill_terms(n, c)
        tokens += t
        pairs += p
    return (1.0, tokens, pairs)


def decode_terms(batch: float, context_tokens: float) -> Terms:
    """The decode step cost's terms for ``batch`` sequences holding ``context_tokens``:
    (fixed, sequences, context tokens)."""
    return (1.0, batch, context_tokens)


def cost(coefficients: Terms, terms: Terms) -> float:
    """Seconds: coefficients (a, b, d) or (e, f, g) times their terms."""
    a, b, d = coefficients
    x, y, z = terms
    return a * x + b * y + d * z


@dataclass(frozen=True, slots=True)
class CostProfile:
    name: str
    prefill_fixed_s: float
    prefill_per_token_s: float
    prefill_per_pair_s: float
    decode_fixed_s: float
    decode_per_seq_s: float
    decode_per_ctx_token_s: float
    kv_bytes_per_token: int
    block_size: int
    link_bandwidth: float
    pool_bandwidth: float = 0.0
    kv_capacity_tokens: int = 0  # a worker's KV cache in tokens; 0: unknown
    contention: tuple[float, ...] = ()  # step factor with k workers busy on one host
    token_overhead_s: float = 0.0  # serving path, per sequence per decode step
    notes: str = ""
    fit: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in COEFFICIENTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"profile {self.name!r}: {name} must be > 0, got {value!r}")
        if isinstance(self.kv_capacity_tokens, bool) or not isinstance(
                self.kv_capacity_tokens, int) or self.kv_capacity_tokens < 0:
            raise ValueError(f"profile {self.name!r}: kv_capacity_tokens must be an int >= 0")
        for name in ("kv_bytes_per_token", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"profile {self.name!r}: {name} must be an int > 0, "
                                 f"got {value!r}")
        factors = tuple(self.contention) if isinstance(self.contention, tuple | list) else (0,)
        if any(isinstance(f, bool) or not isinstance(f, int | float) or not f >= 1
               for f in factors) or any(b < a for a, b in pairwise(factors)):
            raise ValueError(f"profile {self.name!r}: contention must be factors >= 1 "
                             f"that do not fall, got {self.contention!r}")
        object.__setattr__(self, "contention", tuple(float(f) for f in factors))
        if isinstance(self.token_overhead_s, bool) or not isinstance(
                self.token_overhead_s, int | float) or not self.token_overhead_s >= 0:
            raise ValueError(f"profile {self.name!r}: token_overhead_s must be >= 0")
        if not self.link_bandwidth > 0 or not self.pool_bandwidth >= 0:
            raise ValueError(f"profile {self.name!r}: link_bandwidth must be > 0 and "
                             f"pool_bandwidth >= 0")

    def coefficients(self) -> tuple[float, ...]:
        """The six cost terms in ``COEFFICIENTS`` order (``CostCoefficients``'s order)."""
        return tuple(getattr(self, name) for name in COEFFICIENTS)

    @property
    def prefill_coefficients(self) -> Terms:
        return (self.prefill_fixed_s, self.prefill_per_token_s, self.prefill_per_pair_s)

    @property
    def decode_coefficients(self) -> Terms:
        return (self.decode_fixed_s, self.decode_per_seq_s, self.decode_per_ctx_token_s)

    def prefill_s(self, n: int, c: int = 0) -> float:
        """Seconds to prefill ``n`` new tokens after ``c`` cached ones (0 for n <= 0)."""
        if n <= 0:
            return 0.0
        return cost(self.prefill_coefficients, prefill_terms(n, c))

    def prefill_step_s(self, chunks: Iterable[tuple[int, int]]) -> float:
        """Seconds of one engine step prefilling ``chunks``, each ``(n, c)`` (0 for none)."""
        chunks = list(chunks)
        if not chunks:
            return 0.0
        return cost(self.prefill_coefficients, prefill_step_terms(chunks))

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """Seconds of one decode step (0 for an empty batch)."""
        if batch <= 0:
            return 0.0
        return cost(self.decode_coefficients, decode_terms(batch, context_tokens))

    def contended(self, busy: int) -> float:
        """The step factor with ``busy`` worker processes busy on one host (counting
        the one stepping; at least one), the last measured beyond the list; 1.0 when
        not measured."""
        if not self.contention:
            return 1.0
        return self.contention[min(max(busy, 1), len(self.contention)) - 1]

    def served_decode_step_s(self, batch: int, context_tokens: int, busy: int = 1) -> float:
        """A decode step as a client sees it on a shared host: the engine's step under
        ``busy`` workers' contention plus the serving path's per-token overhead."""
        if batch <= 0:
            return 0.0
        return self.decode_step_s(batch, context_tokens) * self.contended(busy) + \
            batch * self.token_overhead_s

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def profile_from_dict(values: dict[str, Any], source: str = "<dict>") -> CostProfile:
    """A profile from its JSON object; ``ValueError`` for missing or unknown keys."""
    if not isinstance(values, dict):
        raise ValueError(f"{source}: a cost profile must be a JSON object")
    names = {f.name for f in dataclasses.fields(CostProfile)}
    required = {f.name for f in dataclasses.fields(CostProfile)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    unknown, missing = set(values) - names, required - set(values)
    if unknown or missing:
        raise ValueError(f"{source}: cost profile has unknown keys {sorted(unknown)} "
                         f"and lacks {sorted(missing)}")
    if isinstance(values.get("contention"), list):
        values = {**values, "contention": tuple(values["contention"])}
    try:
        return CostProfile(**values)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: {exc}") from None


def load_profile(spec: str) -> CostProfile:
    """A profile from a JSON file path, or by name from ``deploy/profiles/``."""
    if not spec:
        raise ValueError("no cost profile given")
    path = Path(spec)
    if not (spec.endswith(".json") or path.exists()):
        path = PROFILE_DIR / f"{spec}.json"
    try:
        values = json.loads(path.read_text())
    except FileNotFoundError:
        known = sorted(p.stem for p in PROFILE_DIR.glob("*.json"))
        raise ValueError(f"cost profile {spec!r} not found (no {path}); "
                         f"shipped profiles: {known}") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read cost profile {path}: {exc}") from None
    return profile_from_dict(values, str(path))


def save_profile(profile: CostProfile, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile.to_json(), indent=2) + "\n")
    return path
