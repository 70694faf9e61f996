"""bench/cache.py's TTFT part on the harness, its cluster simulated: the four paths run
as interleaved sides, each round on a fresh prefix drawn from its own seed, every path
checked, and the ratios start from ``pooled`` so that "pooled vs cold" is cold ÷ pooled.

The real run (two unified workers of the default model and a pool process) takes
minutes; this isolates the benchmark's bookkeeping with a stand-in that behaves as the
cluster does: round robin over two workers, each with its own prefix cache, a pool the
workers write back to and fetch from, and the counters the benchmark reads."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import pytest

from bench.harness import Session
from tests.cluster import ROOT

sys.path.insert(0, str(ROOT / "bench"))  # bench/cache.py imports its sibling as top level
from bench import cache  # noqa: E402

BS = cache.BLOCK_SIZE
TIMES = {"cold": 4.0, "pooled": 0.8, "local": 0.5, "local_adopted": 0.5}


@dataclass(frozen=True)
class Pool:
    written_blocks: int = 0
    write_back_queued: int = 0
    write_back_dropped: int = 0
    fetches: int = 0
    fetched_blocks: int = 0
    fetch_bytes: int = 0
    fetch_seconds: float = 0.0
    adopt_seconds: float = 0.0


@dataclass
class FakeCluster:
    """Round robin over two workers with prefix caches, and a shared pool."""

    pool_works: bool = True
    procs: dict = field(default_factory=lambda: {"unified-0": 0, "unified-1": 0})
    pools: dict = field(default_factory=lambda: {"unified-0": Pool(), "unified-1": Pool()})
    local: dict = field(default_factory=lambda: {"unified-0": set(), "unified-1": set()})
    pooled: set = field(default_factory=set)
    turn: int = 0
    prefixes: list = field(default_factory=list)

    def worker_stats(self, name):
        return SimpleNamespace(pool=self.pools[name])

    def serve(self, prompt: list[int]) -> tuple[float, int]:
        name = sorted(self.procs)[self.turn % 2]
        self.turn += 1
        blocks = [tuple(prompt[: (i + 1) * BS]) for i in range(len(prompt) // BS)]
        hit_local = sum(1 for b in blocks if b in self.local[name])
        hit_pool = 0 if hit_local else sum(1 for b in blocks if b in self.pooled)
        p = self.pools[name]
        if hit_pool:
            p = replace(p, fetches=p.fetches + 1, fetched_blocks=p.fetched_blocks + hit_pool,
                        fetch_bytes=p.fetch_bytes + hit_pool * 46080 * BS,
                        fetch_seconds=p.fetch_seconds + 0.02)
        self.pools[name] = replace(p, written_blocks=p.written_blocks + len(blocks)
                                   - max(hit_local, hit_pool))
        self.local[name].update(blocks)
        if self.pool_works:
            self.pooled.update(blocks)
        cached = max(hit_local, hit_pool) * BS
        path = ("cold" if not cached else "pooled" if hit_pool else
                "local" if name == "unified-0" else "local_adopted")
        if not cached:
            self.prefixes.append(tuple(prompt[:BS]))
        return TIMES[path], cached


def fake_ttft(cluster):
    def ttft(client, prompt):
        return cluster.serve(prompt)
    return ttft


def run(monkeypatch, cluster, trials=3):
    monkeypatch.setattr(cache, "ttft", fake_ttft(cluster))
    rounds = cache.Round(cluster, prompt_len=10 * BS, shared_len=9 * BS)
    session = Session("cache_ttft", {}, seed=1234, log=lambda line: None)
    runs = session.run({p: rounds.side(p) for p in cache.PATHS}, repeats=trials, warmup=1)
    return session, {p: runs[p] for p in cache.RATIO_ORDER}


def test_paths_run_interleaved_on_a_fresh_prefix_each_round(monkeypatch):
    cluster = FakeCluster()
    session, runs = run(monkeypatch, cluster)
    assert list(runs) == ["pooled", "cold", "local", "local_adopted"]
    assert [len(r) for r in runs.values()] == [3, 3, 3, 3]
    # One cold prompt a round (warm-up included), each on a prefix never seen before.
    assert len(cluster.prefixes) == 4 and len(set(cluster.prefixes)) == 4
    assert [r["pool_fetched_blocks"] for r in runs["pooled"]] == [9, 9, 9]
    assert all(r["pool_fetches"] == 0 for p in ("cold", "local", "local_adopted")
               for r in runs[p])
    report = session.finish(cache.METRICS, runs)
    # pooled first: the ratio against cold is cold's TTFT over pooled's.
    assert report["ratios"]["pooled/cold"]["ttft_s"]["median"] == pytest.approx(4.0 / 0.8)
    assert report["ratios"]["pooled/local"]["ttft_s"]["median"] == pytest.approx(0.5 / 0.8)
    assert report["sides"]["cold"]["ttft_s"]["median"] == 4.0


def test_a_path_not_taken_stops_the_run(monkeypatch):
    cluster = FakeCluster(pool_works=False)  # B cannot fetch: it computes the prefix again
    with pytest.raises(cache.PathError, match=r"expected one worker to write 1 blocks, got "
                       r"\{'unified-0': 0, 'unified-1': 10\} \(dropped: \[0, 0\]\)"):
        run(monkeypatch, cluster)


def test_a_side_out_of_order_stops_the_run(monkeypatch):
    cluster = FakeCluster()
    monkeypatch.setattr(cache, "ttft", fake_ttft(cluster))
    rounds = cache.Round(cluster, prompt_len=10 * BS, shared_len=9 * BS)
    session = Session("cache_ttft", {}, seed=1, log=lambda line: None)
    with pytest.raises(cache.PathError, match="pooled ran before this round's cold prompt"):
        session.run({"pooled": rounds.side("pooled"), "cold": rounds.side("cold")},
                    repeats=1, warmup=0)
