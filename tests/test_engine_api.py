"""The in-process API: abort, held KV, and clear errors for bad input."""

from __future__ import annotations

import pytest

from common.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from tests.tiny_models import random_prompts


def test_abort_frees_blocks_at_once(tiny_dirs, make_engine):
    engine = make_engine(tiny_dirs["llama"])
    total = engine.block_manager.num_blocks
    engine.add_request("a", random_prompts([40], seed=11)[0], SamplingParams(max_tokens=50))
    # ignore_eos: b must run its 50 tokens whatever a random model happens to sample.
    engine.add_request("b", random_prompts([20], seed=12)[0],
                       SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks == total - 3 - 2  # 41 tokens → 3 blocks, 21 → 2
    assert engine.abort("a") is True
    assert engine.block_manager.num_free_blocks == total - 2
    assert engine.abort("a") is False
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert {o.request_id for o in outs} == {"b"}
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 50


def test_abort_waiting_request(tiny_dirs, make_engine):
    engine = make_engine(tiny_dirs["llama"], max_num_seqs=1)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=5))
    engine.add_request("b", [5, 6, 8], SamplingParams(max_tokens=5))
    engine.step()
    assert engine.abort("b") is True
    while engine.has_unfinished_requests():
        engine.step()


def test_stop_token_and_max_model_len(tiny_dirs, make_engine):
    engine = make_engine(tiny_dirs["llama"], max_model_len=30)
    prompt = random_prompts([10], seed=13)[0]
    free = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=100,
                                                    ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 20  # 10 + 20 = 30
    stop_at = free.token_ids[4]
    stopped = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=100,
                                                       stop_token_ids=[stop_at]))[0]
    first = free.token_ids.index(stop_at)
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.finish_reason == "stop"


@pytest.mark.parametrize("prompt, message", [
    ([], "prompt must not be empty"),
    ([1, 2, 10_000], "prompt token ids"),
    ([-1], "prompt token ids"),
    (list(range(3, 253)) * 3, "context"),
])
def test_bad_prompts(tiny_dirs, make_engine, prompt, message):
    engine = make_engine(tiny_dirs["llama"])
    with pytest.raises(ValueError, match=message):
        engine.add_request(None, prompt, SamplingParams())
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_k": -7}, "top_k"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
])
def test_bad_sampling_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_duplicate_request_id(tiny_dirs, make_engine):
    engine = make_engine(tiny_dirs["llama"])
    engine.add_request("x", [4, 5], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", [4, 5], SamplingParams(max_tokens=2))
    engine.abort("x")


def test_prompt_larger_than_kv_cache(tiny_dirs, make_engine):
    engine = make_engine(tiny_dirs["llama"], num_kv_blocks=2)
    with pytest.raises(ValueError, match="KV cache"):
        engine.add_request(None, list(range(3, 60)), SamplingParams())


def test_missing_and_corrupt_model_files(tmp_path):
    from services.engine.engine import LLMEngine

    with pytest.raises(FileNotFoundError, match="nowhere"):
        LLMEngine(EngineConfig(model=str(tmp_path / "nowhere.gguf")))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)
    with pytest.raises(ValueError, match="bad.gguf"):
        LLMEngine(EngineConfig(model=str(bad)))


@pytest.mark.parametrize("kwargs, field", [
    ({"dtype": "int8"}, "dtype"),
    ({"block_size": 0}, "block_size"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
])
def test_bad_engine_config(tiny_dirs, kwargs, field):
    from services.engine.engine import LLMEngine

    with pytest.raises(ValueError, match=field):
        LLMEngine(EngineConfig(model=str(tiny_dirs["llama"]), **kwargs))


def test_queue_time_reported_on_first_token_only(tiny_dirs, make_engine):
    engine = make_engine(tiny_dirs["llama"], max_num_seqs=1)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3))
    engine.add_request("b", [5, 6, 8], SamplingParams(max_tokens=3))
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    first = {o.request_id: o for o in reversed(outs)}  # earliest output of each
    assert [o.queue_time_s is not None for o in outs] == [
        o.num_output_tokens == 1 for o in outs]
    assert first["b"].queue_time_s > first["a"].queue_time_s >= 0  # b waited for a


def test_different_cache_salts_never_share_a_block(tiny_dirs, make_engine):
    engine = make_engine(tiny_dirs["llama"])
    prompt = random_prompts([40], seed=15)[0]
    params = SamplingParams(temperature=0, max_tokens=2)

    def cached(salt):
        engine.add_request("r", prompt, params, cache_salt=salt)
        outs = []
        while engine.has_unfinished_requests():
            outs.extend(engine.step())
        return outs[-1].num_cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") == 32  # same salt: two full blocks reused
    assert cached("tenant-b") == 0  # another salt: nothing shared
    assert cached(None) == 0
