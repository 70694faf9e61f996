"""Request sets for ``bench/serve.py``: what to send and when.

Every builder returns ``RequestSpec``s whose prompts are token ids, so prompt lengths are
exact without a tokenizer, and whose ``arrival_s`` says when the request is due, measured
from the start of the run. Everything is a pure function of its arguments and seed.

- ``random_requests``: lengths drawn uniformly from ``len × [1 - r, 1 + r]``.
- ``shared_prefix_requests``: ``num_groups`` random prefixes; request ``i`` is group
  ``i % num_groups``'s prefix followed by its own random suffix.
- ``trace_requests``: Mooncake trace replay. Each hash id names one 512-token block of the
  original trace; here it becomes ``block_size`` tokens that depend only on the id (and the
  vocabulary), so requests that shared a block in the trace share identical tokens here.
- ``poisson_arrivals``: arrival times for the synthetic sets.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TRACE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake traces
MIN_TOKEN_ID = 100  # below this sit the special tokens of most vocabularies


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to send: ``prompt`` token ids, ``output_len`` tokens to generate, due
    ``arrival_s`` seconds after the run starts."""

    prompt: tuple[int, ...]
    output_len: int
    arrival_s: float = 0.0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


def _check_vocab(vocab_size: int) -> None:
    if vocab_size <= MIN_TOKEN_ID:
        raise ValueError(f"vocab_size must exceed {MIN_TOKEN_ID}, got {vocab_size}")


def random_tokens(rng: np.random.Generator, n: int, vocab_size: int) -> tuple[int, ...]:
    _check_vocab(vocab_size)
    return tuple(rng.integers(MIN_TOKEN_ID, vocab_size, size=n).tolist())


def poisson_arrivals(n: int, rate: float, rng: np.random.Generator) -> list[float]:
    """``n`` arrival times (seconds) of a Poisson process with ``rate`` requests/s, the
    first at 0. ``rate = inf`` sends everything at once."""
    if not rate > 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if math.isinf(rate) or n == 0:
        return [0.0] * n
    gaps = rng.exponential(1.0 / rate, size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def _length_range(length: int, range_ratio: float) -> tuple[int, int]:
    lo = max(1, int(length * (1 - range_ratio)))
    hi = max(lo, int(length * (1 + range_ratio)))
    return lo, hi


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                    vocab_size: int, request_rate: float, seed: int) -> list[RequestSpec]:
    """Prompt and output lengths uniform in ``[int(len·(1-r)), int(len·(1+r))]`` (at least 1)."""
    if input_len < 1 or output_len < 1:
        raise ValueError(f"input_len and output_len must be >= 1, got {input_len}, {output_len}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    in_lo, in_hi = _length_range(input_len, range_ratio)
    out_lo, out_hi = _length_range(output_len, range_ratio)
    in_lens = rng.integers(in_lo, in_hi + 1, size=num_prompts).tolist()
    out_lens = rng.integers(out_lo, out_hi + 1, size=num_prompts).tolist()
    arrivals = poisson_arrivals(num_prompts, request_rate, rng)
    return [RequestSpec(random_tokens(rng, n_in, vocab_size), n_out, t)
            for n_in, n_out, t in zip(in_lens, out_lens, arrivals, strict=True)]


def shared_prefix_requests(num_prompts: int, num_groups: int, prefix_len: int, suffix_len: int,
                           output_len: int, vocab_size: int, request_rate: float,
                           seed: int) -> list[RequestSpec]:
    """Request ``i`` = prefix of group ``i % num_groups`` + ``suffix_len`` fresh tokens."""
    if num_groups < 1 or prefix_len < 0 or suffix_len < 1 or output_len < 1:
        raise ValueError("need num_groups >= 1, prefix_len >= 0, suffix_len >= 1, "
                         f"output_len >= 1; got {num_groups}, {prefix_len}, {suffix_len}, "
                         f"{output_len}")
    rng = np.random.default_rng(seed)
    prefixes = [random_tokens(rng, prefix_len, vocab_size) for _ in range(num_groups)]
    arrivals = poisson_arrivals(num_prompts, request_rate, rng)
    return [RequestSpec(prefixes[i % num_groups] + random_tokens(rng, suffix_len, vocab_size),
                        output_len, arrivals[i])
            for i in range(num_prompts)]


def block_tokens(hash_id: int, block_size: int, vocab_size: int) -> tuple[int, ...]:
    """The ``block_size`` tokens standing for trace block ``hash_id``.

    SHAKE-128 of the id, read as little-endian uint32s: the same on every platform and
    Python version, and a shorter block is a prefix of a longer one.
    """
    _check_vocab(vocab_size)
    digest = hashlib.shake_128(int(hash_id).to_bytes(8, "little", signed=True))
    words = np.frombuffer(digest.digest(4 * block_size), dtype="<u4")
    return tuple((words % (vocab_size - MIN_TOKEN_ID) + MIN_TOKEN_ID).tolist())


def read_trace(path: str | Path, max_requests: int | None = None) -> list[dict]:
    """The first ``max_requests`` records of a Mooncake JSONL trace, validated."""
    records = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if max_requests is not None and len(records) >= max_requests:
                break
            if not line.strip():
                continue
            rec = json.loads(line)
            missing = {"timestamp", "input_length", "output_length", "hash_ids"} - rec.keys()
            if missing:
                raise ValueError(f"{path}:{lineno}: missing {sorted(missing)}")
            records.append(rec)
    return records


def trace_requests(path: str | Path, block_size: int = TRACE_BLOCK_TOKENS,
                   time_scale: float = 1.0, vocab_size: int = 49152,
                   max_input_len: int | None = None, max_output_len: int | None = None,
                   max_requests: int | None = None) -> list[RequestSpec]:
    """Replay a Mooncake trace.

    Prompt: the blocks of the record's hash ids, concatenated, cut to
    ``round(input_length × block_size / 512)`` tokens (at least 1), then to
    ``max_input_len``. Output: ``output_length`` capped by ``max_output_len``. Arrival:
    ``(timestamp - earliest timestamp) × time_scale`` milliseconds, so replay starts at once.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not time_scale >= 0:
        raise ValueError(f"time_scale must be >= 0, got {time_scale}")
    records = read_trace(path, max_requests)
    if not records:
        return []
    t0 = min(rec["timestamp"] for rec in records)
    blocks: dict[int, tuple[int, ...]] = {}
    specs = []
    for i, rec in enumerate(records):
        n_in = max(1, round(rec["input_length"] * block_size / TRACE_BLOCK_TOKENS))
        if n_in > len(rec["hash_ids"]) * block_size:
            raise ValueError(f"trace record {i}: input_length {rec['input_length']} exceeds "
                             f"its {len(rec['hash_ids'])} blocks of {TRACE_BLOCK_TOKENS}")
        if max_input_len is not None:
            n_in = min(n_in, max_input_len)
        prompt: list[int] = []
        for h in rec["hash_ids"]:
            if len(prompt) >= n_in:
                break
            if h not in blocks:
                blocks[h] = block_tokens(h, block_size, vocab_size)
            prompt.extend(blocks[h])
        n_out = max(1, rec["output_length"])
        if max_output_len is not None:
            n_out = min(n_out, max_output_len)
        arrival_s = (rec["timestamp"] - t0) * time_scale / 1000.0
        specs.append(RequestSpec(tuple(prompt[:n_in]), n_out, arrival_s))
    return specs
