"""Blocks leaving one engine as cache-pool bytes and adopted into another's prefix cache."""

from __future__ import annotations

import pytest

from common.block_hash import hash_blocks
from common.sampling_params import SamplingParams
from tests.tiny_models import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def chain(engine, prompt, salt=None):
    """The hashes of the prompt's full blocks, as the worker computes them."""
    bs = engine.block_manager.block_size
    return hash_blocks(prompt[: len(prompt) // bs * bs], bs, engine.fingerprint, salt)


def cached_prefix_blocks(engine, hashes, prompt):
    """How many leading blocks of the chain (over ``prompt``) the prefix cache holds."""
    bs = engine.block_manager.block_size
    chunks = [prompt[i * bs:(i + 1) * bs] for i in range(len(hashes))]
    return len(engine.block_manager.match_prefix(hashes, chunks))


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_adopted_blocks_are_hits_and_continue_token_exact(tiny_dirs, make_engine, dtype):
    shared, tail = random_prompts([48, 9], seed=31)
    prompt = shared + tail  # 57 tokens: three full blocks, a partial one
    cold = make_engine(tiny_dirs["llama"], dtype=dtype)
    want = cold.generate([prompt], GREEDY)[0].token_ids
    hashes = chain(cold, prompt)
    assert len(hashes) == 3
    data = cold.pool_blocks.export(hashes)
    assert [len(d) for d in data] == [cold.kv_store.block_nbytes] * 3

    warm = make_engine(tiny_dirs["llama"], dtype=dtype)
    assert cached_prefix_blocks(warm, hashes, prompt) == 0
    assert warm.pool_blocks.adopt(hashes, prompt, 0, data[:2]) == 2
    assert cached_prefix_blocks(warm, hashes, prompt) == 2
    # Blocks arrive in two batches; the second continues the chain.
    assert warm.pool_blocks.adopt(hashes, prompt, 2, data[2:]) == 1
    assert [bytes(b) for b in warm.pool_blocks.export(hashes)] == [bytes(d) for d in data]
    rid = warm.add_request(None, prompt, GREEDY)
    seq = warm.requests[rid]
    got = []
    while warm.has_unfinished_requests():
        for out in warm.step():
            got.extend(out.new_token_ids)
            cached = out.num_cached_tokens
    assert seq.num_cached_tokens == cached == 48
    assert got == want


def test_adopting_needs_the_held_prefix_and_checks_sizes(tiny_dirs, make_engine):
    prompt = random_prompts([40], seed=32)[0]
    a = make_engine(tiny_dirs["llama"])
    a.generate([prompt], GREEDY)
    hashes = chain(a, prompt)
    data = a.pool_blocks.export(hashes)
    b = make_engine(tiny_dirs["llama"])
    free = b.block_manager.num_free_blocks
    assert b.pool_blocks.adopt(hashes, prompt, 1, data[1:]) == 0  # block 0 missing here
    with pytest.raises(ValueError, match="bytes"):
        b.pool_blocks.adopt(hashes, prompt, 0, [data[0], bytes(10)])
    with pytest.raises(ValueError, match="outside"):
        b.pool_blocks.adopt(hashes, prompt, 1, data)
    assert cached_prefix_blocks(b, hashes, prompt) == 0
    assert b.block_manager.num_free_blocks == free
    # The chain stops at the first block the cache no longer holds.
    assert len(a.pool_blocks.export([hashes[0], 12345, hashes[1]])) == 1


def test_adopting_stops_when_the_cache_is_full(tiny_dirs, make_engine):
    prompt = random_prompts([80], seed=33)[0]
    a = make_engine(tiny_dirs["llama"])
    a.generate([prompt], GREEDY)
    hashes = chain(a, prompt)
    data = a.pool_blocks.export(hashes)
    assert len(data) == 5
    b = make_engine(tiny_dirs["llama"])
    held = b.block_manager.allocate(b.block_manager.num_blocks - 2)  # leave two free blocks
    assert b.pool_blocks.adopt(hashes, prompt, 0, data) == 2
    assert cached_prefix_blocks(b, hashes, prompt) == 2
    b.block_manager.free(held)
