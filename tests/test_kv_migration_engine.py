"""A running request moved between two engines with its KV (a decode worker's planned
stop): detach in A, copy the KV into B's reserved blocks, adopt in B; B continues
token for token as if nothing happened, without computing the tokens already there."""

from __future__ import annotations

import pytest

from common.sampling_params import SamplingParams
from tests.tiny_models import random_prompts


def _step_until(engine, tokens: list[int], n: int) -> None:
    while len(tokens) < n:
        for out in engine.step():
            tokens.extend(out.new_token_ids)


def _run(engine, rid, prompt, params) -> list[int]:
    engine.add_request(rid, prompt, params)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    return tokens


def _move(a, b, rid: str, skip_blocks_expected: int | None = None):
    moved = a.detach(rid)
    assert moved is not None
    slots = b.reserve_migrated(rid, moved.prompt_token_ids, moved.output_token_ids,
                               moved.params, cached_tokens=moved.num_cached_tokens)
    assert slots is not None and len(slots.block_ids) == len(moved.block_ids)
    if skip_blocks_expected is not None:
        assert slots.num_cached_blocks == skip_blocks_expected
    skip = slots.num_cached_blocks
    for layer in range(a.kv_store.num_layers):
        payload = a.kv_store.export_layer_bytes(layer, moved.block_ids[skip:])
        b.kv_store.import_layer_bytes(layer, slots.block_ids[skip:], payload)
    a.abort(rid)
    b.complete_migrated(rid)
    return moved


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=40, ignore_eos=True,
                   repetition_penalty=1.3, presence_penalty=0.5),
])
def test_moved_request_continues_exactly_without_recompute(tiny_dirs, make_engine, params):
    a = make_engine(tiny_dirs["llama"])
    b = make_engine(tiny_dirs["llama"])
    prompt = random_prompts([37], seed=5)[0]
    want = _run(make_engine(tiny_dirs["llama"]), "ref", prompt, params)
    free_a, free_b = a.block_manager.num_free_blocks, b.block_manager.num_free_blocks
    a.add_request("r", prompt, params)
    tokens: list[int] = []
    _step_until(a, tokens, 13)
    moved = _move(a, b, "r", skip_blocks_expected=0)
    assert moved.output_token_ids == tokens and moved.prompt_token_ids == prompt
    assert len(moved.block_ids) == -(-(37 + 13 - 1) // 16)
    assert "r" not in a.requests and a.block_manager.num_free_blocks == free_a
    computed = []
    while b.has_unfinished_requests():
        for out in b.step():
            tokens.extend(out.new_token_ids)
            assert out.num_output_tokens == len(tokens)  # positions continue
        computed.append(b.last_step)
    assert tokens == want
    # B's first step computed one token (the last one A sampled), not the 49 before it.
    assert computed[0].decode_batch == 1 and not computed[0].prefill
    assert b.block_manager.num_free_blocks == free_b


def test_blocks_the_target_caches_are_not_sent(tiny_dirs, make_engine):
    a = make_engine(tiny_dirs["llama"])
    b = make_engine(tiny_dirs["llama"])
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompt = random_prompts([40], seed=9)[0]
    want = _run(b, "warm", prompt, params)  # B now caches the prompt's 2 full blocks
    a.add_request("r", prompt, params)
    tokens: list[int] = []
    _step_until(a, tokens, 5)
    _move(a, b, "r", skip_blocks_expected=2)
    _step_until(b, tokens, 30)
    assert tokens == want and not b.has_unfinished_requests()


def test_only_a_decoding_request_detaches_and_bad_moves_are_refused(tiny_dirs, make_engine):
    a = make_engine(tiny_dirs["llama"])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a.add_request("q", [1, 2, 3], params)
    assert a.detach("q") is None and a.detach("nope") is None  # queued, unknown
    with pytest.raises(ValueError, match="nothing left"):
        a.reserve_migrated("x", [1, 2, 3], list(range(8)), params)
    with pytest.raises(ValueError, match="output token ids"):
        a.reserve_migrated("x", [1, 2, 3], [10**9], params)
    with pytest.raises(ValueError, match="output token ids"):
        a.reserve_migrated("x", [1, 2, 3], [], params)
    with pytest.raises(ValueError, match="not waiting"):
        a.complete_migrated("x")
    assert "x" not in a.requests
    a.abort("q")
