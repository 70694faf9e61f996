"""Simulated worker profiles: what a prefill, a decode step and moving KV cost, and how
many KV blocks a worker has.

The costs come from a cost profile file (``deploy/profiles/<name>.json``, the file the
conductor loads with ``cost_profile``; ``common/cost_profile.py``): the simulator runs
those true costs (with optional noise, ``Simulator(noise=...)``) and the policy's cost
model starts from the same calibration and refits from the timings the simulated workers
report in their heartbeats. A worker's prefix cache is its KV blocks, nothing else: the
profile's ``kv_capacity_tokens`` in blocks of the trace's hash block.

``LLAMA70B_H100X4`` -- a Llama-2-70B-shaped model (80 layers, hidden 8192, 64 query heads,
8 KV heads of dimension 128) in bf16 on one 4 x H100 SXM 80 GB tensor-parallel group.
Public figures used: H100 SXM dense bf16 989 TFLOP/s and HBM3 3.35 TB/s per GPU
(NVIDIA datasheet); one ConnectX-7 400 Gb/s NIC per GPU.

* KV per token: 80 layers x 8 heads x 128 x 2 (K and V) x 2 bytes = 327,680 B (320 KiB).
* Prefill matmuls: 2 x 70e9 FLOP/token over 4 x 989 TFLOP/s at an assumed 45 % MFU
  (1.78 PFLOP/s) -> 79 us/token, about 12,700 tok/s per group.
* Prefill attention: 4 x 8192 x 80 = 2.6 MFLOP per (query, key) pair at the same rate
  -> 1.5 ns/pair (an 8k-token prompt: 0.65 s of matmuls + 0.05 s of attention).
* Decode step: weights 140 GB read at 70 % of 4 x 3.35 TB/s -> 15 ms; 0.1 ms per
  sequence (matmul FLOPs and sampling); KV read 327,680 B/token at the same 9.4 TB/s
  -> 35 ns per context token. Batch 32 at 12k tokens each: 15 + 3 + 13.6 = 32 ms.
* KV capacity: 320 GB HBM - 140 GB weights - ~20 GB activations and workspace = 160 GB
  -> 488k tokens -> 950 blocks of 512 tokens.
* Link: 4 x 400 Gb/s = 200 GB/s raw, 100 GB/s assumed achieved -> 12k tokens of KV
  (3.9 GB) in 39 ms.

The file is ``deploy/profiles/llama70b-h100x4.json``. ``SMALL_CPU`` is this machine's
calibration of the default small model (``smollm2-cpu.json``, ``bench/calibrate.py``)
with 2048 blocks of 16 tokens.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from common.cost_profile import (
    CostProfile,
    cost,
    decode_terms,
    load_profile,
    prefill_step_terms,
    prefill_terms,
)
from common.records import CostCoefficients

NEIGHBOURS = ("decode", "short prefill", "long prefill")
# Prompt tokens in a step from which it computes more than it reads: the two live loads'
# prompts (48-80 and 577-960 tokens, batched up to 1,777) fall well either side.
LONG_PREFILL_TOKENS = 256


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    cost: CostCoefficients
    kv_bytes_per_token: int
    block_size: int  # tokens per KV block (the prefix-hash block of the trace)
    kv_blocks: int  # a worker's KV capacity in blocks: also its whole prefix cache
    link_bandwidth: float  # bytes/s, prefill -> decode
    pool_bandwidth: float  # bytes/s, pool tier -> worker
    # On one shared host (Simulator(shared_host=True)): the step factor with k workers
    # busy, and the serving path's seconds per sequence per decode step (cost_profile.py).
    contention: tuple[float, ...] = ()
    token_overhead_s: float = 0.0
    # (batch, measured / fitted step) from the calibration's decode points, by batch:
    # the three-term fit is a compromise over batches 1-64 (on smollm2-cpu 10 % high at
    # B = 1, 10-15 % low at B = 4-16), and the simulator runs what the engine measured.
    decode_shape: tuple[tuple[int, float], ...] = ()
    # The host's factors per kind of step where the calibration measured them apart
    # (``fit.host``, bench/calibrate_host.py): a decode step reads memory and a prefill
    # computes, and a busy neighbour slows the two unequally; () uses ``contention``.
    decode_contention: tuple[float, ...] = ()
    prefill_contention: tuple[float, ...] = ()
    # How much of a busy process a neighbour counts as, by what it runs
    # ((step kind, neighbour's NEIGHBOURS class, weight); ``fit.host.neighbour_weights``,
    # services/sim/trace_factors.py): live, a decode step beside a long prompt's prefill
    # ran as if alone, beside another decode at the two-busy factor. Absent: 1.
    neighbour_weights: tuple[tuple[str, str, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("kv_bytes_per_token", "block_size", "kv_blocks", "link_bandwidth"):
            if getattr(self, name) <= 0:
                raise ValueError(f"profile {self.name}: {name} must be > 0")
        if self.pool_bandwidth < 0:
            raise ValueError(f"profile {self.name}: pool_bandwidth must be >= 0")

    @classmethod
    def from_cost_profile(cls, cp: CostProfile, *, block_size: int | None = None,
                          kv_blocks: int | None = None) -> Profile:
        """The simulated worker of a cost profile. ``block_size`` (default the profile's)
        is the hash block of the trace the simulator replays; ``kv_blocks`` (default the
        profile's ``kv_capacity_tokens`` in such blocks) its KV capacity."""
        bs = cp.block_size if block_size is None else block_size
        blocks = cp.kv_capacity_tokens // bs if kv_blocks is None else kv_blocks
        if blocks <= 0:
            raise ValueError(f"profile {cp.name}: no KV capacity (kv_capacity_tokens "
                             f"{cp.kv_capacity_tokens}); give kv_blocks")
        return cls(name=cp.name, cost=CostCoefficients(*cp.coefficients()),
                   kv_bytes_per_token=cp.kv_bytes_per_token, block_size=bs,
                   kv_blocks=blocks, link_bandwidth=cp.link_bandwidth,
                   pool_bandwidth=cp.pool_bandwidth, contention=cp.contention,
                   token_overhead_s=cp.token_overhead_s, decode_shape=decode_shape(cp),
                   neighbour_weights=neighbour_weights(cp),
                   **{f"{kind}_contention": host_factors(cp, kind)
                      for kind in ("decode", "prefill")})

    @classmethod
    def load(cls, spec: str, **kw) -> Profile:
        """``from_cost_profile`` of a profile file (a path or a name in deploy/profiles)."""
        return cls.from_cost_profile(load_profile(spec), **kw)

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.kv_bytes_per_token

    def prefill_s(self, n: int, c: int) -> float:
        """True seconds to prefill ``n`` new tokens after ``c`` cached ones."""
        if n <= 0:
            return 0.0
        k = self.cost
        return cost((k.prefill_fixed_s, k.prefill_per_token_s, k.prefill_per_pair_s),
                    prefill_terms(n, c))

    def prefill_step_s(self, chunks: list[tuple[int, int]]) -> float:
        """True seconds of one step prefilling ``chunks`` ``(n, c)``: the fixed cost once."""
        if not any(n > 0 for n, _ in chunks):
            return 0.0
        k = self.cost
        return cost((k.prefill_fixed_s, k.prefill_per_token_s, k.prefill_per_pair_s),
                    prefill_step_terms(chunks))

    def chunk_ends(self, n: int, c: int, step_tokens: int) -> list[float]:
        """Where a prefill of ``n`` tokens after ``c`` cached, chunked ``step_tokens``
        at a time as the live scheduler runs it, ends each chunk but the last: fractions
        of the whole (later chunks attend to more context and take longer)."""
        parts = [self.prefill_s(min(step_tokens, n - i), c + i)
                 for i in range(0, n, step_tokens)]
        total, done, ends = sum(parts), 0.0, []
        for p in parts[:-1]:
            done += p
            ends.append(done / total)
        return ends

    def contended(self, busy: float, kind: str = "") -> float:
        """The step factor with ``busy`` processes busy on one host (cost_profile.py),
        linear between whole numbers: the serving processes are a fraction of one
        (``Simulator.contention``); the last factor beyond the list. ``kind``
        ("decode" or "prefill") picks that kind's factors where measured."""
        c = getattr(self, f"{kind}_contention", ()) if kind else ()
        c = c or self.contention
        if not c:
            return 1.0
        k = min(max(busy, 1.0), float(len(c)))
        lo = int(k)
        return c[lo - 1] if lo == len(c) else c[lo - 1] + (k - lo) * (c[lo] - c[lo - 1])

    def weight(self, kind: str, neighbour: str) -> float:
        """The share of a busy process a neighbour running a ``neighbour`` step
        (NEIGHBOURS) adds to the busy count a ``kind`` step is charged at; 1.0 unless
        the profile measured it."""
        return next((w for k, n, w in self.neighbour_weights
                     if k == kind and n == neighbour), 1.0)

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """True seconds of one decode step."""
        if batch <= 0:
            return 0.0
        k = self.cost
        return cost((k.decode_fixed_s, k.decode_per_seq_s, k.decode_per_ctx_token_s),
                    decode_terms(batch, context_tokens)) * self.shape(batch)

    def served_decode_step_s(self, batch: float, context_tokens: float,
                             busy: float = 1.0) -> float:
        """One decode step as the simulator charges it on one shared host with ``busy``
        processes busy (``Simulator(shared_host=True)``): the engine's step at the
        measured shape times the host's decode factor, plus the serving path's overhead
        per sequence. ``batch`` may be a mean (a fraction): the shape is linear in
        log(batch) between calibrated batches."""
        if batch <= 0:
            return 0.0
        return self.decode_step_s(batch, context_tokens) * self.contended(busy, "decode") \
            + batch * self.token_overhead_s

    def shape(self, batch: int) -> float:
        """Measured over fitted decode step at ``batch``: linear in log(batch) between
        the calibrated batches, the nearest one's beyond them; 1.0 without points."""
        pts = self.decode_shape
        if not pts:
            return 1.0
        if batch <= pts[0][0]:
            return pts[0][1]
        for (b0, r0), (b1, r1) in zip(pts, pts[1:], strict=False):
            if batch <= b1:
                return r0 + (r1 - r0) * math.log(batch / b0) / math.log(b1 / b0)
        return pts[-1][1]


def decode_shape(cp: CostProfile) -> tuple[tuple[int, float], ...]:
    """Per calibrated batch, the median of measured / fitted step over its context
    lengths (``fit.decode`` rows [B, K, seconds, error]); () without such rows."""
    rows = cp.fit.get("decode", []) if isinstance(cp.fit, dict) else []
    by_batch: dict[int, list[float]] = {}
    for row in rows:
        if not (isinstance(row, list | tuple) and len(row) >= 3):
            continue
        b, k, seconds = row[:3]
        fitted = cp.decode_step_s(int(b), int(k))
        if int(b) >= 1 and fitted > 0 and isinstance(seconds, int | float) and seconds > 0:
            by_batch.setdefault(int(b), []).append(seconds / fitted)
    return tuple((b, statistics.median(r)) for b, r in sorted(by_batch.items()))


def neighbour_class(prefill_tokens: int) -> str:
    """What a busy neighbour runs, as a step's factor depends on it: "decode" (no
    prompt), a "short prefill" (memory- and launch-bound like a decode step) or a "long
    prefill" (compute-bound) from ``LONG_PREFILL_TOKENS`` prompt tokens in the step."""
    if prefill_tokens <= 0:
        return "decode"
    return "long prefill" if prefill_tokens >= LONG_PREFILL_TOKENS else "short prefill"


def neighbour_weights(cp: CostProfile) -> tuple[tuple[str, str, float], ...]:
    """``fit.host.neighbour_weights`` ({kind: {neighbour class: weight in [0, 1]}}) as
    ``Profile.neighbour_weights``; () where absent, malformed entries left out."""
    host = cp.fit.get("host") if isinstance(cp.fit, dict) else None
    table = host.get("neighbour_weights") if isinstance(host, dict) else None
    if not isinstance(table, dict):
        return ()
    return tuple((kind, n, float(w)) for kind, row in sorted(table.items())
                 if kind in ("decode", "prefill") and isinstance(row, dict)
                 for n, w in sorted(row.items())
                 if n in NEIGHBOURS and isinstance(w, int | float)
                 and not isinstance(w, bool) and 0 <= w <= 1)


def host_factors(cp: CostProfile, kind: str) -> tuple[float, ...]:
    """The host's step factors for ``kind`` ("decode" or "prefill") from the profile's
    ``fit.host`` (``<kind>_contention``, one per number of busy processes), as
    bench/calibrate_host.py writes them; () where absent or not factors >= 1 that do
    not fall."""
    host = cp.fit.get("host") if isinstance(cp.fit, dict) else None
    f = host.get(f"{kind}_contention") if isinstance(host, dict) else None
    if not (isinstance(f, list | tuple) and f and all(
            isinstance(x, int | float) and not isinstance(x, bool) and x >= 1 for x in f)
            and all(b >= a for a, b in zip(f, f[1:], strict=False))):
        return ()
    return tuple(float(x) for x in f)


LLAMA70B_H100X4 = Profile.load("llama70b-h100x4", block_size=512)
SMALL_CPU = Profile.load("smollm2-cpu", kv_blocks=2048)

PROFILES = {p.name: p for p in (LLAMA70B_H100X4, SMALL_CPU)}
