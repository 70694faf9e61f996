"""Per-sequence block bookkeeping on top of the block manager: prefix hits, growth, release."""

from __future__ import annotations

from typing import NamedTuple

from common.block_hash import ROOT_PARENT_HASH, hash_block, hash_blocks
from services.engine.block_manager import BlockManager
from services.engine.sequence import Sequence


class PrefixMatch(NamedTuple):
    """Cached blocks holding a sequence's leading tokens, and their chain hashes."""

    block_ids: list[int]
    block_hashes: list[int]

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


NO_MATCH = PrefixMatch([], [])


class KVCacheManager:
    def __init__(self, blocks: BlockManager, fingerprint: str) -> None:
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.fingerprint = fingerprint

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence, max_tokens: int | None = None) -> PrefixMatch:
        """Cached blocks holding the longest prefix of ``seq``'s tokens.

        At most ``max_tokens`` tokens are matched (default: all but the last token, which
        must be computed to produce logits). Changes nothing: neither ``seq`` nor any
        reference count; hand the result to :meth:`allocate_slots` to take the blocks.
        """
        tokens = seq.token_ids()
        limit = len(tokens) - 1 if max_tokens is None else max_tokens
        usable = tokens[: (limit // self.block_size) * self.block_size]
        hashes = hash_blocks(usable, self.block_size, self.fingerprint, seq.cache_salt)
        bs = self.block_size
        chunks = [usable[i * bs:(i + 1) * bs] for i in range(len(hashes))]
        hits = self.blocks.match_prefix(hashes, chunks)
        return PrefixMatch(hits, hashes[: len(hits)])

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       prefix: PrefixMatch = NO_MATCH) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``seq``; all or nothing.

        ``prefix`` (only for a sequence that holds no blocks yet) holds cache hits to
        adopt as the start of its block table; their tokens count as computed::

            block_table:  [hit][hit][new ][new ]
            tokens:        0-15 16-31 32.. ..new

        When it returns False, ``seq`` and every block are as they were.
        """
        hits = prefix.block_ids
        if hits and seq.block_table:
            raise ValueError("prefix blocks can only start an empty block table")
        computed = len(hits) * self.block_size if hits else seq.num_computed_tokens
        need = self.blocks_for(computed + num_new_tokens) - len(seq.block_table) - len(hits)
        need = max(need, 0)
        free_hits = sum(1 for b in hits if self.blocks.ref_count(b) == 0)
        if need > self.blocks.num_free_blocks - free_hits:
            return False
        if hits:
            self.blocks.acquire(hits)
            seq.block_table.extend(hits)
            seq.block_hashes = list(prefix.block_hashes)
            seq.num_computed_tokens = computed
        if need:
            seq.block_table.extend(self.blocks.allocate(need))
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register every block that is full and computed but not yet in the prefix cache."""
        full = seq.num_computed_tokens // self.block_size
        if full <= len(seq.block_hashes):
            return
        tokens = seq.token_ids()
        bs = self.block_size
        for i in range(len(seq.block_hashes), full):
            parent = seq.block_hashes[i - 1] if i else ROOT_PARENT_HASH
            chunk = tokens[i * bs:(i + 1) * bs]
            h = hash_block(parent, chunk, self.fingerprint, seq.cache_salt)
            self.blocks.cache_block(seq.block_table[i], h, chunk)
            seq.block_hashes.append(h)

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks, tail first, so its last blocks are evicted first."""
        if seq.block_table:
            self.blocks.free(list(reversed(seq.block_table)))
        seq.block_table = []
        seq.block_hashes = []
