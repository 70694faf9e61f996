"""KV export/import: byte-exact round trips, and continuing in engine B what A prefilled."""

from __future__ import annotations

import torch

from common.sampling_params import SamplingParams
from tests.tiny_models import random_prompts


def test_export_import_round_trip_is_byte_exact(tiny_dirs, make_engine):
    a = make_engine(tiny_dirs["llama"])
    b = make_engine(tiny_dirs["llama"])
    prompt = random_prompts([45], seed=7)[0]
    a.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=1), hold_blocks=True)
    while a.has_unfinished_requests():
        a.step()
    exported = a.export_kv("r")
    assert exported.shape == (2, 2, 3, 16, 2, 16)  # layers, K|V, blocks, tokens, heads, dim
    # Non-contiguous, out-of-order destination blocks in B.
    dest = [9, 3, 17]
    b.import_kv(dest, exported)
    back = b.kv_cache.export_blocks(dest)
    assert back.dtype == exported.dtype
    assert torch.equal(back.view(torch.uint8), exported.view(torch.uint8))
    per_layer = a.export_kv("r", layer=1)
    assert torch.equal(per_layer, exported[1])
    a.release("r")


def _continue_in_b(a, b, prompt, params):
    a.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=1), hold_blocks=True)
    first = None
    while a.has_unfinished_requests():
        for out in a.step():
            first = out.new_token_ids[0]
    slots = b.reserve_remote_prefill("d", prompt, params)
    for layer in range(a.model_config.num_layers):  # layer by layer, as a transfer would
        b.import_kv(slots.block_ids, a.export_kv("p", layer=layer), layer=layer)
    a.release("p")
    b.complete_remote_prefill("d", first)
    tokens = [first]
    while b.has_unfinished_requests():
        for out in b.step():
            tokens.extend(out.new_token_ids)
    return tokens


def test_continuation_from_imported_kv_equals_single_engine(tiny_dirs, make_engine):
    params = SamplingParams(temperature=0, max_tokens=36, ignore_eos=True)
    prompts = random_prompts([37, 16, 5], seed=8)
    alone = make_engine(tiny_dirs["qwen2"])
    want = [c.token_ids for c in alone.generate(prompts, params)]
    a = make_engine(tiny_dirs["qwen2"])
    b = make_engine(tiny_dirs["qwen2"])
    got = [_continue_in_b(a, b, p, params) for p in prompts]
    assert got == want


def test_continuation_with_sampling_seed_equals_single_engine(tiny_dirs, make_engine):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=123, max_tokens=20, ignore_eos=True)
    prompt = random_prompts([29], seed=9)[0]
    alone = make_engine(tiny_dirs["llama"]).generate([prompt], params)[0].token_ids
    a = make_engine(tiny_dirs["llama"])
    b = make_engine(tiny_dirs["llama"])
    # Seeded draws depend on (seed, output position) only, so the decode engine
    # continues exactly where the prefill engine's first draw left off.
    assert _continue_in_b(a, b, prompt, params) == alone


def test_remote_prefill_reuses_decode_side_prefix(tiny_dirs, make_engine):
    b = make_engine(tiny_dirs["llama"])
    shared = random_prompts([48], seed=10)[0]
    b.generate([shared + [5]], SamplingParams(temperature=0, max_tokens=2))
    slots = b.reserve_remote_prefill("d", shared + [6, 7], SamplingParams(max_tokens=1))
    assert slots.num_cached_blocks == 3
    assert len(slots.block_ids) == 4
    b.abort("d")
    assert b.num_free_blocks() == b.block_pool.num_blocks
