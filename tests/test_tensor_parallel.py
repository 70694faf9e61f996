"""Tensor parallelism on the CPU (gloo): a TP=2 engine equals TP=1 token for token, its
cache holds its heads' slice, and a follower that dies makes the engine fail fast."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from common.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.tp import EngineDeadError, shard_shape
from tests.tiny_models import make_tiny_model, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# Chunked prefill, a block budget small enough to preempt, prefix caching on.
TIGHT = dict(dtype="float64", prefill_chunk_size=7, max_num_batched_tokens=12,
             num_kv_blocks=12)


@pytest.fixture
def tp_engines():
    """Build engines (TP or not); every one closed after the test, its followers gone."""
    from services.engine.engine import LLMEngine

    made: list[LLMEngine] = []

    def build(model, **kw):
        made.append(LLMEngine(EngineConfig(model=str(model), **kw)))
        return made[-1]

    yield build
    for engine in made:
        engine.close()
        if engine.tp_leader is not None:
            assert all(p.poll() is not None for p in engine.tp_leader.procs)


def run_workload(engine):
    """Mixed prompts that preempt under TIGHT, then two sharing a 40-token prefix."""
    out = [c.token_ids for c in engine.generate(random_prompts([20, 30, 25, 18], seed=5),
                                                 GREEDY)]
    shared = random_prompts([40], seed=3)[0]
    a = engine.generate([shared + [7, 8, 9]], GREEDY)[0]
    b = engine.generate([shared + [11, 12]], GREEDY)[0]
    return out + [a.token_ids, b.token_ids], b.num_cached_tokens


def test_tp2_equals_tp1_with_chunks_preemption_and_prefix_hit(tiny_dirs, tp_engines):
    one = tp_engines(tiny_dirs["llama"], **TIGHT)
    two = tp_engines(tiny_dirs["llama"], tensor_parallel_size=2, **TIGHT)
    want, _ = run_workload(one)
    got, cached = run_workload(two)
    assert got == want
    assert two.scheduler.num_preemptions > 0
    assert cached == 32  # two full 16-token blocks of the shared prefix
    # Each rank holds half of the 4 query heads and one of the 2 KV heads.
    assert two.kv_store.local.k.shape[3] == 1 and one.kv_store.k.shape[3] == 2
    attn = two.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    assert two.fingerprint == one.fingerprint  # KV moves in the all-heads layout

    # Rank 0's cache holds KV head 0 of the whole model's blocks.
    prompt = random_prompts([35], seed=9)[0]
    blocks = []
    for engine in (one, two):
        rid = engine.add_request(None, prompt, GREEDY, hold_blocks=True)
        while engine.has_unfinished_requests():
            engine.step()
        blocks.append(list(engine.requests[rid].block_table))
        engine.release(rid)
    assert blocks[0] == blocks[1]
    full = one.kv_store.k[1, blocks[0]]
    mine = two.kv_store.local.k[1, blocks[1]]
    torch.testing.assert_close(mine, full[:, :, 0:1], rtol=1e-9, atol=1e-9)
    assert two.kv_store.block_nbytes == one.kv_store.block_nbytes


def test_replicated_kv_head_tied_padded_vocab_with_bias(tmp_path, tp_engines):
    """One KV head on two ranks (replicated), a tied embedding over a vocabulary that
    does not split evenly (255 rows), and q/k/v biases: still equal to TP=1."""
    model = make_tiny_model(tmp_path / "mqa", "qwen2", seed=4, num_key_value_heads=1,
                            tie_word_embeddings=True, vocab_size=255)
    prompts = random_prompts([9, 26, 40], vocab=255, seed=6)
    one = tp_engines(model, dtype="float64")
    two = tp_engines(model, dtype="float64", tensor_parallel_size=2)
    want = [c.token_ids for c in one.generate(prompts, GREEDY)]
    assert [c.token_ids for c in two.generate(prompts, GREEDY)] == want
    assert two.model.shard.vocab == 128 and two.model.shard.num_kv_heads == 1


def test_shard_shapes_and_refusals(tiny_dirs):
    from services.engine.engine import LLMEngine
    from services.engine.weights import load_weights

    cfg = load_weights(str(tiny_dirs["llama"])).config  # 4 heads, 2 KV heads, 128 MLP
    shapes = [shard_shape(cfg, r, 4) for r in range(4)]
    assert [s.head_start for s in shapes] == [0, 1, 2, 3]
    assert [s.kv_head_start for s in shapes] == [0, 0, 1, 1]  # each KV head on 2 ranks
    assert [s.inter_start for s in shapes] == [0, 32, 64, 96]
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        LLMEngine(EngineConfig(model=str(tiny_dirs["llama"]), tensor_parallel_size=3))
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)


def test_follower_killed_engine_fails_fast_and_leaves_nothing(tiny_dirs, tp_engines):
    engine = tp_engines(tiny_dirs["llama"], dtype="float64", tensor_parallel_size=2)
    for prompt in random_prompts([12, 30], seed=7):
        engine.add_request(None, prompt, GREEDY)
    engine.step()
    follower = engine.tp_leader.procs[0]
    os.kill(follower.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank 1"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < 30
    assert engine.tp_failed.is_set()
    assert follower.wait(timeout=5) == -signal.SIGKILL
    with pytest.raises(EngineDeadError):  # and stays dead
        engine.step()
    for rid in list(engine.requests):
        engine.abort(rid)
