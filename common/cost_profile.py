"""Cost profiles: what prefill, one decode step and moving KV cost on one kind of worker.

The conductor starts its cost model from a profile (its calibration, refitted online
from what workers report); the simulated executor sleeps what a profile says. The terms
are those of ``services/conductor/cost_model.py``::

    prefill(n uncached tokens, c cached prefix) = a + b*n + d*n*(n/2 + c)
    decode step(B sequences, K context tokens)  = e + f*B + g*K

On disk a profile is one JSON object (``deploy/profiles/<name>.json``) with every field
below; ``pool_bandwidth`` and ``kv_capacity_tokens`` default to 0, and ``notes`` (how
it was made) and ``fit`` (the measurements behind it) are optional. ``load_profile``
takes a path or the name of a profile in that folder.

Contract: coefficients are > 0 (a cost that is really zero is written as a tiny number),
``kv_bytes_per_token`` and ``block_size`` are > 0 integers, bandwidths in bytes/s with
``link_bandwidth`` > 0 and ``pool_bandwidth`` >= 0 (0: no pool). Anything else is a
``ValueError`` naming the field and the file. No torch, no numpy.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROFILE_DIR = Path(__file__).resolve().parents[1] / "deploy" / "profiles"
COEFFICIENTS = ("prefill_fixed_s", "prefill_per_token_s", "prefill_per_pair_s",
                "decode_fixed_s", "decode_per_seq_s", "decode_per_ctx_token_s")


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
        if not self.link_bandwidth > 0 or not self.pool_bandwidth >= 0:
            raise ValueError(f"profile {self.name!r}: link_bandwidth must be > 0 and "
                             f"pool_bandwidth >= 0")

    def coefficients(self) -> tuple[float, ...]:
        """The six cost terms in ``COEFFICIENTS`` order (``Calibration``'s order)."""
        return tuple(getattr(self, name) for name in COEFFICIENTS)

    def prefill_s(self, n: int, c: int = 0) -> float:
        """Seconds to prefill ``n`` new tokens after ``c`` cached ones (0 for n <= 0)."""
        if n <= 0:
            return 0.0
        return self.prefill_fixed_s + self.prefill_per_token_s * n + \
            self.prefill_per_pair_s * n * (n / 2 + c)

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """Seconds of one decode step (0 for an empty batch)."""
        if batch <= 0:
            return 0.0
        return self.decode_fixed_s + self.decode_per_seq_s * batch + \
            self.decode_per_ctx_token_s * context_tokens

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
