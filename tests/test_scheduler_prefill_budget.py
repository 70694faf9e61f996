"""The scheduler's prompt-token cap while sequences decode (max_prefill_tokens_with_decode)."""

from __future__ import annotations

import dataclasses

import pytest

from common.sampling_params import SamplingParams
from services.engine.block_manager import BlockManager
from services.engine.kv_manager import KVCacheManager
from services.engine.sampling_state import SamplingState
from services.engine.scheduler import Scheduler, SchedulerConfig, is_decoding
from services.engine.sequence import Sequence

BS = 16


def seq(rid: str, prompt_len: int) -> Sequence:
    tokens = [100 + (hash(rid) + i) % 1000 for i in range(prompt_len)]
    state = SamplingState.create(SamplingParams(), tokens, seeded_generator=False)
    return Sequence(rid, tokens, state)


def scheduler(cap: int | None, *, chunk: int | None = None, budget: int = 2048,
              blocks: int = 512) -> Scheduler:
    kv = KVCacheManager(BlockManager(blocks, BS, enable_prefix_caching=False), "test")
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, prefill_chunk_size=chunk,
                                     max_prefill_tokens_with_decode=cap), kv)


def step(s: Scheduler) -> list[tuple[str, int]]:
    """Schedule one step and apply it as the engine does: computed tokens advance, and a
    sequence whose tokens are all computed samples one."""
    out = s.schedule()
    for sq, n in out:
        sq.num_computed_tokens += n
        if sq.num_computed_tokens == sq.num_tokens:
            sq.output_token_ids.append(7)
    return [(sq.request_id, n) for sq, n in out]


def decoding(s: Scheduler, *rids_lens: tuple[str, int]) -> None:
    """Admit and prefill these sequences so that each is decoding."""
    for rid, n in rids_lens:
        s.add(seq(rid, n))
    while s.waiting or not all(is_decoding(x) for x in s.running):
        step(s)


def test_without_a_cap_a_whole_prompt_joins_the_decode_step():
    s = scheduler(None)
    decoding(s, ("a", 20), ("b", 30))
    s.add(seq("c", 300))
    assert step(s) == [("a", 1), ("b", 1), ("c", 300)]


def test_the_cap_chunks_a_prompt_across_decode_steps():
    s = scheduler(64)
    decoding(s, ("a", 20), ("b", 30))
    s.add(seq("c", 200))
    steps = [step(s) for _ in range(4)]
    assert steps == [[("a", 1), ("b", 1), ("c", 64)], [("a", 1), ("b", 1), ("c", 64)],
                     [("a", 1), ("b", 1), ("c", 64)], [("a", 1), ("b", 1), ("c", 8)]]
    assert step(s) == [("a", 1), ("b", 1), ("c", 1)]  # c decodes with the others


def test_with_nothing_decoding_prompts_take_the_full_budget():
    s = scheduler(32, budget=300)
    s.add(seq("a", 100))
    s.add(seq("b", 150))
    s.add(seq("c", 120))
    assert step(s) == [("a", 100), ("b", 150), ("c", 50)]
    # a and b now decode: c's remaining 70 tokens come 32 at a time
    assert step(s) == [("a", 1), ("b", 1), ("c", 32)]
    assert step(s) == [("a", 1), ("b", 1), ("c", 32)]
    assert step(s) == [("a", 1), ("b", 1), ("c", 6)]


def test_the_cap_is_shared_by_every_prompt_of_the_step_and_the_chunk_still_applies():
    s = scheduler(100, chunk=48)
    decoding(s, ("a", 10))
    s.add(seq("b", 60))
    s.add(seq("c", 60))
    s.add(seq("d", 60))
    assert step(s) == [("a", 1), ("b", 48), ("c", 48), ("d", 4)]
    assert step(s) == [("a", 1), ("b", 12), ("c", 12), ("d", 48)]
    assert step(s) == [("a", 1), ("b", 1), ("c", 1), ("d", 8)]


def test_a_zero_cap_runs_decodes_only_and_skips_a_prefilling_sequence_between_them():
    s = scheduler(None, chunk=64)
    s.add(seq("a", 10))
    s.add(seq("p", 200))
    s.add(seq("z", 10))
    assert step(s) == [("a", 10), ("p", 64), ("z", 10)]
    s.config = dataclasses.replace(s.config, max_prefill_tokens_with_decode=0)
    s.add(seq("w", 10))
    # a and z decode; p's prompt and w's admission wait for a step without decodes
    assert step(s) == [("a", 1), ("z", 1)]
    assert [x.request_id for x in s.waiting] == ["w"]
    assert [x.num_computed_tokens for x in s.running] == [11, 64, 11]
    s.remove(s.running[0])
    s.remove(s.running[-1])
    assert step(s) == [("p", 64), ("w", 10)]  # nothing decodes: prompts go again


def test_the_cap_applies_only_while_a_running_sequence_decodes():
    s = scheduler(16, chunk=64)
    s.add(seq("a", 100))
    s.add(seq("b", 100))
    # two prompts, nobody decoding yet: chunks of 64, not 16
    assert step(s) == [("a", 64), ("b", 64)]
    assert step(s) == [("a", 36), ("b", 36)]
    s.add(seq("c", 40))
    assert step(s) == [("a", 1), ("b", 1), ("c", 16)]


@pytest.mark.parametrize("bad", [-1, -64])
def test_a_negative_cap_is_refused(bad):
    with pytest.raises(ValueError, match="max_prefill_tokens_with_decode"):
        SchedulerConfig(max_prefill_tokens_with_decode=bad)


def test_engine_and_worker_settings_refuse_a_negative_cap():
    from services.engine.config import EngineConfig
    from services.worker.settings import WorkerSettings

    with pytest.raises(ValueError, match="max_prefill_tokens_with_decode"):
        EngineConfig(max_prefill_tokens_with_decode=-1)
    with pytest.raises(ValueError, match="max_prefill_tokens_with_decode"):
        WorkerSettings(max_prefill_tokens_with_decode=-1)
    with pytest.raises(ValueError, match="log_level"):
        WorkerSettings(log_level="chatty")


def test_capped_prompts_beside_decodes_give_the_reference_tokens(tiny_dirs, references,
                                                                 make_engine):
    from tests.tiny_models import random_prompts, reference_greedy

    prompts = random_prompts([9, 45, 30], seed=11)
    engine = make_engine(tiny_dirs["llama"], max_prefill_tokens_with_decode=8)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    engine.add_request("first", prompts[0], params)
    prefill_per_step = []
    while engine.has_unfinished_requests():
        if len(tokens.get("first", ())) == 2:  # "first" decodes: the others join now
            engine.add_request("second", prompts[1], params)
            engine.add_request("third", prompts[2], params)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        step = engine.last_step
        if step is not None and step.decode_batch:
            prefill_per_step.append(sum(n for n, _ in step.prefill))
    assert max(prefill_per_step) == 8  # the cap held in every step beside a decode
    assert sum(prefill_per_step) == 45 + 30  # both later prompts went in capped pieces
    assert [tokens[r] for r in ("first", "second", "third")] == \
        [reference_greedy(references["llama"], p, 24) for p in prompts]
