"""The load ``pdserve advise`` replays: a Mooncake-format trace, or lengths and a rate.

Mooncake JSONL rows carry ``timestamp`` (ms), ``input_length``, ``output_length`` and
``hash_ids``, one id per ``block_tokens`` tokens of prompt (512 in the published traces):
requests sharing a leading id share that prefix. A synthetic workload draws lengths
uniform in ``[L(1-r), L(1+r)]`` and Poisson arrivals at ``rate`` per second, as
``bench/serve.py --dataset random`` does; ``shared_prefix`` tokens (in whole blocks) at
the start of every prompt are common to all of them, the rest is its own.

A workload is a recipe: ``requests()`` makes fresh ``SimRequest`` records for every
simulated deployment (a run fills them in).
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, replace

from services.sim.request import SimRequest
from services.sim.simulator import load_trace, percentile


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    block_tokens: int  # tokens per hash id
    base: tuple[SimRequest, ...]

    def __post_init__(self) -> None:
        if not self.base:
            raise ValueError(f"workload {self.name}: no requests")
        if self.block_tokens <= 0:
            raise ValueError(f"workload {self.name}: block_tokens must be > 0")

    def requests(self) -> list[SimRequest]:
        return [replace(r, hashes=list(r.hashes)) for r in self.base]

    def stats(self) -> WorkloadStats:
        prompts = [r.prompt for r in self.base]
        outputs = [r.output for r in self.base]
        arrivals = [r.arrival for r in self.base]
        span = max(arrivals) - min(arrivals)
        return WorkloadStats(
            requests=len(self.base), rate=(len(self.base) - 1) / span if span > 0 else math.inf,
            prompt_mean=statistics.fmean(prompts), prompt_p50=percentile(prompts, 50),
            prompt_p90=percentile(prompts, 90), prompt_max=max(prompts),
            output_mean=statistics.fmean(outputs), output_p50=percentile(outputs, 50),
            output_p90=percentile(outputs, 90))


@dataclass(frozen=True, slots=True)
class WorkloadStats:
    requests: int
    rate: float  # requests/s between the first and the last arrival
    prompt_mean: float
    prompt_p50: float
    prompt_p90: float
    prompt_max: int
    output_mean: float
    output_p50: float
    output_p90: float

    def line(self) -> str:
        return (f"{self.requests} requests at {self.rate:.3g}/s; prompt mean "
                f"{self.prompt_mean:.0f} (p50 {self.prompt_p50:.0f}, p90 {self.prompt_p90:.0f}, "
                f"max {self.prompt_max}), output mean {self.output_mean:.0f} "
                f"(p90 {self.output_p90:.0f}) tokens")


def from_trace(path: str, *, block_tokens: int = 512, speed: float = 1.0,
               limit: int | None = None) -> Workload:
    """A Mooncake-format trace; ``speed`` > 1 compresses its time."""
    try:
        reqs = load_trace(path, speed=speed, limit=limit)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot read trace {path}: {exc!r}") from None
    for r in reqs:
        if r.prompt <= 0 or len(r.hashes) > -(-r.prompt // block_tokens) + 1:
            raise ValueError(f"trace {path}: request {r.rid} has {r.prompt} prompt tokens "
                             f"and {len(r.hashes)} hash ids of {block_tokens} tokens")
    t0 = min((r.arrival for r in reqs), default=0.0)
    return Workload(path, block_tokens, tuple(replace(r, arrival=r.arrival - t0)
                                              for r in reqs))


def synthetic(*, requests: int, rate: float, input_len: int, output_len: int,
              range_ratio: float = 0.5, shared_prefix: int = 0, block_tokens: int = 16,
              seed: int = 0) -> Workload:
    if requests < 1 or input_len < 1 or output_len < 1 or not rate > 0:
        raise ValueError("need requests, input_len, output_len >= 1 and rate > 0")
    if not 0 <= range_ratio < 1 or shared_prefix < 0:
        raise ValueError("need 0 <= range_ratio < 1 and shared_prefix >= 0")
    rng = random.Random(seed)
    shared = shared_prefix // block_tokens
    reqs, t = [], 0.0
    for i in range(requests):
        prompt = max(1, rng.randint(int(input_len * (1 - range_ratio)),
                                    int(input_len * (1 + range_ratio))))
        prompt = max(prompt, shared * block_tokens + 1)
        output = max(1, rng.randint(int(output_len * (1 - range_ratio)),
                                    int(output_len * (1 + range_ratio))))
        full = prompt // block_tokens
        hashes = list(range(min(shared, full))) + [(i + 1) << 32 | j
                                                   for j in range(shared, full)]
        reqs.append(SimRequest(i, t, prompt, output, hashes))
        t += rng.expovariate(rate)
    name = (f"random in {input_len}, out {output_len} (+-{range_ratio:.0%}), "
            f"{rate:g}/s" + (f", {shared * block_tokens}-token shared prefix" if shared else ""))
    return Workload(name, block_tokens, tuple(reqs))
