"""Chunked CPU decode attention against the gathering path it replaced."""

from __future__ import annotations

import pytest
import torch

from common.sampling_params import SamplingParams
from services.engine import attention_decode
from services.engine.attention import AttentionMetadata, DecodeGroup, TorchAttention
from services.engine.attention_decode import attend, plan_decodes

BS, KVH, HEADS, DIM = 4, 2, 6, 8


def _batch(lens: list[list[int]], dtype=torch.float64, seed=0):
    """Decode groups of the given context lengths over a shuffled cache, plus q/k/v."""
    g = torch.Generator().manual_seed(seed)
    n = sum(len(x) for x in lens)
    num_blocks = sum(-(-c // BS) for x in lens for c in x) + 3
    free = torch.randperm(num_blocks, generator=g).tolist()
    groups, start = [], 0
    for members in lens:
        width = -(-max(members) // BS)
        tables = torch.zeros(len(members), width, dtype=torch.long)
        for i, c in enumerate(members):
            for j in range(-(-c // BS)):
                tables[i, j] = free.pop()
        groups.append(DecodeGroup(start, len(members), tables, torch.tensor(members),
                                  max(members)))
        start += len(members)
    k_cache = torch.randn(num_blocks, BS, KVH, DIM, generator=g, dtype=dtype)
    v_cache = torch.randn(num_blocks, BS, KVH, DIM, generator=g, dtype=dtype)
    slots = []
    for grp in groups:  # each query's own token is the last of its context
        for t, c in zip(grp.block_tables.tolist(), grp.context_lens.tolist(), strict=True):
            slots.append(t[(c - 1) // BS] * BS + (c - 1) % BS)
    q = torch.randn(n, HEADS, DIM, generator=g, dtype=dtype)
    k = torch.randn(n, KVH, DIM, generator=g, dtype=dtype)
    v = torch.randn(n, KVH, DIM, generator=g, dtype=dtype)
    meta = AttentionMetadata(torch.tensor(slots), groups, [])
    return q, k, v, k_cache, v_cache, meta


def _run(decode, batch):
    q, k, v, k_cache, v_cache, meta = batch
    meta = AttentionMetadata(meta.slot_mapping, meta.decode_groups, [])
    return TorchAttention(decode).forward(q, k, v, k_cache.clone(), v_cache.clone(), meta)


@pytest.mark.parametrize("lens", [
    [[1]],
    [[3, 17, 4]],                          # unsorted within a group
    [[70, 2, 33], [129, 64, 65, 1]],       # several chunks, contexts on chunk edges
    [[200, 5], [9]],                       # groups not in context order
])
@pytest.mark.parametrize("chunk_tokens", [4, 8, 64])
def test_chunked_decode_matches_the_gather_path(lens, chunk_tokens, monkeypatch):
    monkeypatch.setattr(attention_decode, "CHUNK_TOKENS", chunk_tokens)
    monkeypatch.setattr(attention_decode, "CHUNK_ROWS", 1)
    batch = _batch(lens)
    torch.testing.assert_close(_run("chunked", batch), _run("gather", batch),
                               rtol=1e-12, atol=1e-12)


def test_plan_walks_only_the_contexts_that_reach_each_chunk(monkeypatch):
    monkeypatch.setattr(attention_decode, "CHUNK_TOKENS", 8)  # 2 blocks of 4
    monkeypatch.setattr(attention_decode, "CHUNK_ROWS", 1)
    q, k, v, k_cache, v_cache, meta = _batch([[20, 3], [9, 8]])
    plan = plan_decodes(meta.decode_groups, BS, q.dtype, q.device)
    # Context order 3, 8, 9, 20 is rows 1, 3, 2, 0 of the step.
    assert plan.rows.tolist() == [1, 3, 2, 0]
    assert [c.first for c in plan.chunks] == [0, 2, 3]  # tokens 0-7, 8-15, 16-23
    # Rows times blocks; the last chunk stops at the widest table (5 blocks).
    assert [c.blocks.numel() for c in plan.chunks] == [8, 4, 1]
    assert plan.chunks[0].mask is not None  # the 3-token context ends inside chunk 0
    assert plan.chunks[1].mask[:, 0, 0].isinf().tolist() == [
        [False, True, True, True, True, True, True, True], [False] * 8]
    assert plan_decodes([], BS, q.dtype, q.device) is None


def test_small_batches_take_longer_chunks(monkeypatch):
    monkeypatch.setattr(attention_decode, "CHUNK_TOKENS", 8)
    monkeypatch.setattr(attention_decode, "CHUNK_ROWS", 4)
    one = _batch([[70]])
    plan = plan_decodes(one[5].decode_groups, BS, torch.float64, one[0].device)
    # 4 rows' worth of 8-token chunks for a lone sequence: 32 tokens (8 blocks) a chunk.
    assert [c.blocks.numel() for c in plan.chunks] == [8, 8, 2]
    four = _batch([[70, 70, 70, 70]])
    plan = plan_decodes(four[5].decode_groups, BS, torch.float64, four[0].device)
    assert len(plan.chunks) == 9  # 70 tokens in 8-token chunks
    torch.testing.assert_close(_run("chunked", one), _run("gather", one),
                               rtol=1e-12, atol=1e-12)


def test_contiguous_decodes_are_a_slice_not_a_copy():
    q, *_, meta = _batch([[5, 9, 30]])
    assert plan_decodes(meta.decode_groups, BS, q.dtype, q.device).rows == slice(0, 3)


def test_matmul_fallback_gives_the_fused_kernels_figures():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 2, 3, DIM, generator=g, dtype=torch.float64)
    keys = torch.randn(3, 2, 10, DIM, generator=g, dtype=torch.float64)
    values = torch.randn(3, 2, 10, DIM, generator=g, dtype=torch.float64)
    mask = torch.zeros(3, 1, 1, 10, dtype=torch.float64)
    mask[0, ..., 4:] = float("-inf")
    fused = attend(q, keys, values, mask)
    plain = attend(q, keys, values, mask, use_flash=False)
    torch.testing.assert_close(plain, fused, rtol=1e-12, atol=1e-12)
    probs = torch.softmax((q @ keys.transpose(-1, -2)) * DIM ** -0.5 + mask, -1)
    torch.testing.assert_close(plain[0], probs @ values, rtol=1e-12, atol=1e-12)


def test_unknown_decode_path_is_refused():
    with pytest.raises(ValueError, match="auto, paged, chunked or gather"):
        TorchAttention("flash")


def test_engine_greedy_tokens_equal_on_both_paths(tiny_dirs, make_engine, monkeypatch):
    monkeypatch.setattr(attention_decode, "CHUNK_TOKENS", 8)  # several chunks per decode
    monkeypatch.setattr(attention_decode, "CHUNK_ROWS", 1)
    prompts = [[1, 5, 9, 200, 17, 3, 3, 8, 40, 41, 42, 7, 6, 5, 4, 3, 2, 100, 101],
               [1, 77], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = {}
    for path in ("gather", "chunked"):
        engine = make_engine(tiny_dirs["llama"], dtype="float32", block_size=4,
                             num_kv_blocks=64)
        engine.model.backend = TorchAttention(path)
        tokens[path] = [c.token_ids for c in engine.generate(prompts, params)]
    assert tokens["chunked"] == tokens["gather"]
    assert all(len(t) == 12 for t in tokens["chunked"])
