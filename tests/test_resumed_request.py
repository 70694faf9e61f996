"""A stream continued after its decode worker was lost: the new worker gets the prompt
plus the tokens already streamed, and ``resumed`` says how many of them are output.
It recomputes their KV and goes on token for token as the undisturbed run, seeded
draws and penalties included (they count the output so far)."""

from __future__ import annotations

import dataclasses

import pytest

from common.sampling_params import SamplingParams
from tests.tiny_models import random_prompts


def _run(engine, rid, prompt, params, resumed=0) -> list[int]:
    engine.add_request(rid, prompt, params, resumed=resumed)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            assert out.num_output_tokens == resumed + len(tokens)  # positions continue
    return tokens


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.95, seed=7, max_tokens=30, ignore_eos=True,
                   repetition_penalty=1.3, presence_penalty=0.7, frequency_penalty=0.4,
                   min_tokens=20),
])
def test_resumed_request_continues_exactly(tiny_dirs, make_engine, params):
    engine = make_engine(tiny_dirs["llama"])
    prompt = random_prompts([29], seed=3)[0]
    want = _run(engine, "ref", prompt, params)
    assert len(want) == 30
    free = engine.block_manager.num_free_blocks
    for k in (1, 11, 29):  # the first token, mid-way, the last one still owed
        got = _run(engine, f"r{k}", prompt + want[:k], params, resumed=k)
        assert got == want[k:], k
    assert engine.block_manager.num_free_blocks == free
    # Without ``resumed`` the streamed tokens are prompt: a seeded draw goes elsewhere.
    if params.seed is not None:
        naive = dataclasses.replace(params, max_tokens=19, min_tokens=9)
        assert _run(engine, "naive", prompt + want[:11], naive) != want[11:]


def test_resumed_bounds_are_refused(tiny_dirs, make_engine):
    engine = make_engine(tiny_dirs["llama"])
    prompt = random_prompts([10], seed=4)[0]
    params = SamplingParams(temperature=0, max_tokens=5)
    for bad in (-1, 10, 11, 1.5):
        with pytest.raises(ValueError, match="resumed"):
            engine.add_request("x", prompt, params, resumed=bad)
    with pytest.raises(ValueError, match="nothing left"):
        engine.add_request("x", prompt, params, resumed=5)
    assert not engine.requests and not engine.has_unfinished_requests()
