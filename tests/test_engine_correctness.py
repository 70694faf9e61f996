"""The engine's greedy output, token for token, against transformers on the same weights."""

from __future__ import annotations

import pytest

from common.sampling_params import SamplingParams
from tests.tiny_models import random_prompts, reference_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def expected(ref, prompts, n=40):
    return [reference_greedy(ref, p, n) for p in prompts]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama3"])
def test_batch_of_mixed_lengths_matches_transformers(arch, tiny_dirs, references, make_engine):
    prompts = random_prompts([5, 17, 33, 64, 2], seed=1)
    engine = make_engine(tiny_dirs[arch])
    got = [c.token_ids for c in engine.generate(prompts, GREEDY)]
    assert got == expected(references[arch], prompts)


def test_chunked_prefill_matches(tiny_dirs, references, make_engine):
    prompts = random_prompts([50, 23], seed=2)
    engine = make_engine(tiny_dirs["llama"], prefill_chunk_size=7, max_num_batched_tokens=12)
    got = [c.token_ids for c in engine.generate(prompts, GREEDY)]
    assert got == expected(references["llama"], prompts)


def test_prefix_cache_hit_matches(tiny_dirs, references, make_engine):
    ref = references["llama"]
    shared = random_prompts([40], seed=3)[0]
    first, second = shared + [7, 8, 9], shared + [11, 12]
    engine = make_engine(tiny_dirs["llama"])
    a = engine.generate([first], GREEDY)[0]
    b = engine.generate([second], GREEDY)[0]
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == 32  # two full 16-token blocks of the shared 40
    assert [a.token_ids, b.token_ids] == expected(ref, [first, second])


def test_whole_prompt_cached_recomputes_last_token(tiny_dirs, references, make_engine):
    prompt = random_prompts([32], seed=4)[0]
    engine = make_engine(tiny_dirs["llama"])
    engine.generate([prompt], GREEDY)
    again = engine.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens == 16  # the last block holds the token to recompute
    assert again.token_ids == expected(references["llama"], [prompt])[0]


def test_preemption_under_tiny_block_budget_matches(tiny_dirs, references, make_engine):
    prompts = random_prompts([20, 30, 25, 18], seed=5)
    engine = make_engine(tiny_dirs["llama"], num_kv_blocks=12)
    got = [c.token_ids for c in engine.generate(prompts, GREEDY)]
    assert engine.scheduler.num_preemptions > 0
    assert got == expected(references["llama"], prompts)
