"""KV export/import: byte-exact round trips, and continuing in engine B what A prefilled."""

from __future__ import annotations

from common.sampling_params import SamplingParams
from services.engine.core import EngineHooks
from tests.tiny_models import random_prompts


def test_export_import_round_trip_is_byte_exact(tiny_dirs, make_engine):
    a = make_engine(tiny_dirs["llama"])
    b = make_engine(tiny_dirs["llama"])
    prompt = random_prompts([45], seed=7)[0]
    a.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=1), hold_blocks=True)
    while a.has_unfinished_requests():
        a.step()
    blocks = a.requests["r"].block_table[:3]
    assert a.kv_store.num_layers == 2
    # Non-contiguous, out-of-order destination blocks in B.
    dest = [9, 3, 17]
    layers = []
    for layer in range(2):
        exported = a.kv_store.export_layer_bytes(layer, blocks)
        assert exported.nbytes == 2 * 3 * 16 * 2 * 16 * 8  # K|V, blocks, tokens, heads, dim
        b.kv_store.import_layer_bytes(layer, dest, exported)
        assert b.kv_store.export_layer_bytes(layer, dest) == exported
        layers.append(bytes(exported))
    # A block's bytes (the cache pool's unit) are its slices of every layer's export.
    half = 16 * 2 * 16 * 8  # one block's K (or V) in one layer
    for i, block in enumerate(dest):
        want = b"".join(raw[(kv * 3 + i) * half:(kv * 3 + i + 1) * half]
                        for raw in layers for kv in (0, 1))
        assert bytes(b.kv_store.export_block_bytes(block)) == want
        assert b.kv_store.export_block_bytes(block) == a.kv_store.export_block_bytes(blocks[i])
    a.release("r")


def _continue_in_b(a_dir, b, prompt, params, make_engine):
    """Prefill in a new engine A, streaming each layer's KV into B's reserved blocks as
    the layer is computed (as a prefill worker does), then decode in B."""
    slots = b.reserve_remote_prefill("d", prompt, params)

    def on_layer(layer, seqs):
        (seq,) = seqs
        payload = a.kv_store.export_layer_bytes(layer, seq.block_table[:len(slots.block_ids)])
        b.kv_store.import_layer_bytes(layer, slots.block_ids, payload)
    a = make_engine(a_dir, hooks=EngineHooks(on_layer=on_layer))
    a.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=1), hold_blocks=True)
    first = None
    while a.has_unfinished_requests():
        for out in a.step():
            first = out.new_token_ids[0]
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
    b = make_engine(tiny_dirs["qwen2"])
    got = [_continue_in_b(tiny_dirs["qwen2"], b, p, params, make_engine) for p in prompts]
    assert got == want


def test_continuation_with_sampling_seed_equals_single_engine(tiny_dirs, make_engine):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=123, max_tokens=20, ignore_eos=True)
    prompt = random_prompts([29], seed=9)[0]
    alone = make_engine(tiny_dirs["llama"]).generate([prompt], params)[0].token_ids
    b = make_engine(tiny_dirs["llama"])
    # Seeded draws depend on (seed, output position) only, so the decode engine
    # continues exactly where the prefill engine's first draw left off.
    assert _continue_in_b(tiny_dirs["llama"], b, prompt, params, make_engine) == alone


def test_remote_prefill_reuses_decode_side_prefix(tiny_dirs, make_engine):
    b = make_engine(tiny_dirs["llama"])
    shared = random_prompts([48], seed=10)[0]
    b.generate([shared + [5]], SamplingParams(temperature=0, max_tokens=2))
    slots = b.reserve_remote_prefill("d", shared + [6, 7], SamplingParams(max_tokens=1))
    assert slots.num_cached_blocks == 3
    assert len(slots.block_ids) == 4
    b.abort("d")
    assert b.block_manager.num_free_blocks == b.block_manager.num_blocks
