"""The KVStore contract: the torch cache and the simulated store implement the same
methods with the same signatures, and both keep the contract's byte rules."""

from __future__ import annotations

import inspect

import pytest
import torch

from services.engine.kv_cache import KVCache
from services.engine.kv_store import KVStore
from services.engine.sim import SimKVStore

METHODS = ["export_layer_bytes", "import_layer_bytes", "export_block_bytes",
           "import_block_bytes"]


def stores() -> list[KVStore]:
    return [KVCache(3, 8, 4, 2, 8, torch.bfloat16), SimKVStore(3, 8, 4, 40)]


@pytest.mark.parametrize("impl", [KVCache, SimKVStore])
def test_implementations_have_the_protocol_signatures(impl):
    for name in METHODS:
        want = inspect.signature(getattr(KVStore, name))
        assert inspect.signature(getattr(impl, name)) == want, name
    assert isinstance(impl.block_nbytes, property)


@pytest.mark.parametrize("store", stores(), ids=["torch", "sim"])
def test_store_keeps_the_byte_contract(store):
    assert isinstance(store, KVStore)
    per_layer = store.block_nbytes // store.num_layers
    for layer in range(store.num_layers):
        data = bytes((layer * 7 + i) % 251 for i in range(2 * per_layer))
        store.import_layer_bytes(layer, [5, 2], data)
    first = store.export_layer_bytes(1, [5, 2])
    assert isinstance(first, memoryview) and first.nbytes == 2 * per_layer
    copy = bytes(first)
    store.import_layer_bytes(1, [5], bytes(per_layer))  # a later write ...
    assert bytes(first) == copy  # ... leaves an earlier export alone
    block = store.export_block_bytes(2)
    assert isinstance(block, memoryview) and block.nbytes == store.block_nbytes
    store.import_block_bytes(7, block)
    assert store.export_block_bytes(7) == block
    for layer in range(store.num_layers):
        assert store.export_layer_bytes(layer, [7]) == store.export_layer_bytes(layer, [2])
    with pytest.raises(ValueError):
        store.import_layer_bytes(0, [1], memoryview(bytes(per_layer - 1)))
    with pytest.raises(ValueError):
        store.import_block_bytes(1, bytes(10))
    with pytest.raises(ValueError):
        store.export_layer_bytes(0, [store.num_blocks])
    with pytest.raises(ValueError):
        store.export_block_bytes(-1)


def test_a_store_without_batches_moves_pool_blocks_one_by_one():
    """The simulated (and tensor-parallel) store has no batched block calls: pool blocks
    are exported at once and imported one at a time, checked first all the same."""
    from services.engine.kv_store import BlockBatches, import_blocks, start_block_export

    store = SimKVStore(num_layers=2, num_blocks=4, block_size=4, block_bytes=3)
    assert not isinstance(store, BlockBatches)
    store.write(0, 1, b"abc")
    store.write(1, 2, b"xyz")
    started = start_block_export(store, [2, 1])
    assert started.ready() and started.count == 2
    assert [bytes(v) for v in started.wait()] == [b"\0\0\0xyz", b"abc\0\0\0"]
    with pytest.raises(ValueError, match="6 bytes"):
        import_blocks(store, [0, 3], [b"123456", b"12345"])
    assert bytes(store.export_block_bytes(0)) == bytes(6)  # nothing written
    import_blocks(store, [0, 3], [b"123456", b"uvwxyz"])
    assert [bytes(store.export_block_bytes(b)) for b in (0, 3)] == [b"123456", b"uvwxyz"]
