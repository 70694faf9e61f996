"""Bookkeeping for the paged KV cache: which block ids are in use, and which are cached.

The manager owns the ids ``0 .. num_blocks-1`` of the per-layer KV tensors; it never touches
the tensors themselves. Each block has a reference count (how many sequences' block tables
hold it) and, once its tokens are known and it is full, may carry a content hash (see
``common.block_hash``) so later requests with the same prefix can reuse it in place.

A block is in exactly one of these states::

    used          ref > 0                  hash optional
    free, plain   ref = 0, no hash         in the plain queue   (reused first)
    free, cached  ref = 0, hash kept       in the cached queue  (evicted LRU)

Free blocks are handed out in this order::

    allocate(n) ─► plain queue, head first ─► then cached queue, head first (evicts)
                   [0, 1, 2, ... never used, in ascending id,
                    then plain blocks in the order they were freed]
                                              [least recently freed ... most recent]

Cached free blocks count as free: ``num_free_blocks`` is everything allocate can return.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence

HashCallback = Callable[[list[int]], None]


class NoFreeBlocksError(RuntimeError):
    """More blocks were asked for than are free; the manager was left unchanged."""


class BlockManager:
    """Fixed set of KV block ids 0..num_blocks-1 with ref counts and a prefix cache.

    Contract:
    - ``allocate`` is check-then-commit: it either returns ``n`` blocks with ref 1 or
      raises ``NoFreeBlocksError`` having changed nothing.
    - ``free`` and ``acquire`` validate every id before changing anything; a misuse
      (double free, acquiring an uncached free block) raises ValueError with the manager
      unchanged.
    - A block's hash is set only by ``cache_block`` and cleared only by eviction in
      ``allocate`` or by ``reset_prefix_cache``; a hash names at most one block.
    - ``on_stored(hashes)`` is called after blocks become findable by hash and
      ``on_removed(hashes)`` after they stop being findable; both run after the manager's
      state is committed, so an exception from a callback reaches the caller but leaves
      the manager consistent.
    - allocate, free and acquire cost O(1) per block.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        *,
        on_stored: HashCallback | None = None,
        on_removed: HashCallback | None = None,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.on_stored = on_stored
        self.on_removed = on_removed
        self._refs = [0] * num_blocks
        self._hashes: list[int | None] = [None] * num_blocks
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._block_by_hash: dict[int, int] = {}
        # OrderedDicts used as ordered sets: O(1) append, pop from head, and removal.
        self._plain_free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref 0, cached or not; all of them can be allocated."""
        return len(self._plain_free) + len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._refs[block_id]

    def cached_hashes(self) -> list[int]:
        """Every hash findable in the prefix cache now (for a resync of the global index)."""
        return list(self._block_by_hash)

    def block_for_hash(self, block_hash: int) -> int | None:
        """The block cached under ``block_hash``, or None."""
        return self._block_by_hash.get(block_hash)

    def block_hash(self, block_id: int) -> int | None:
        """The hash the block is cached under, or None if it is not cached."""
        self._check_id(block_id)
        return self._hashes[block_id]

    def allocate(self, n: int) -> list[int]:
        """Return ``n`` blocks with ref 1, plain free blocks first, then evicting cached ones.

        Evicted blocks lose their hash; their hashes go to ``on_removed`` in one call, in
        eviction order. Raises NoFreeBlocksError (manager unchanged) if ``n`` exceeds
        ``num_free_blocks``, ValueError if ``n`` is negative.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks: {n}")
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {n} blocks, {self.num_free_blocks} free")
        blocks: list[int] = []
        evicted: list[int] = []
        for _ in range(n):
            if self._plain_free:
                block_id, _ = self._plain_free.popitem(last=False)
            else:
                block_id, _ = self._cached_free.popitem(last=False)
                evicted.append(self._uncache(block_id))
            self._refs[block_id] = 1
            blocks.append(block_id)
        if evicted and self.on_removed is not None:
            self.on_removed(evicted)
        return blocks

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per listed id (an id listed twice drops two).

        Blocks reaching ref 0 join the tail of their free queue in the order given:
        cached blocks the LRU queue, plain blocks the plain queue. Callers free a
        sequence's blocks in reverse so that its tail blocks, the least likely to be
        shared by another prompt, are evicted before its head blocks.
        Raises ValueError, manager unchanged, if any block would drop below ref 0.
        """
        for block_id, count in Counter(block_ids).items():
            self._check_id(block_id)
            if count > self._refs[block_id]:
                raise ValueError(
                    f"double free of block {block_id}: ref {self._refs[block_id]}, "
                    f"freed {count} time(s)"
                )
        for block_id in block_ids:
            self._refs[block_id] -= 1
            if self._refs[block_id] == 0:
                queue = self._plain_free if self._hashes[block_id] is None else self._cached_free
                queue[block_id] = None

    def match_prefix(
        self, block_hashes: Sequence[int], token_blocks: Sequence[Sequence[int]]
    ) -> list[int]:
        """Return the blocks caching the longest prefix of ``block_hashes``.

        A hit counts only if the cached block's tokens equal ``token_blocks[i]``, so a
        hash collision ends the match instead of returning a wrong block. The search
        stops at the first miss. Takes no references and leaves LRU order alone: call
        ``acquire`` on the result before anything else can allocate.
        Raises ValueError if the two sequences differ in length.
        """
        if len(block_hashes) != len(token_blocks):
            raise ValueError(f"{len(block_hashes)} hashes but {len(token_blocks)} token blocks")
        hits: list[int] = []
        if not self.enable_prefix_caching:
            return hits
        for block_hash, tokens in zip(block_hashes, token_blocks, strict=True):
            block_id = self._block_by_hash.get(block_hash)
            if block_id is None or self._tokens[block_id] != tuple(tokens):
                break
            hits.append(block_id)
        return hits

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Take one reference per listed id; a cached free block leaves the free queue.

        Raises ValueError, manager unchanged, for a free block with no hash: its contents
        are meaningless, so it must come from ``allocate`` instead.
        """
        for block_id in block_ids:
            self._check_id(block_id)
            if self._refs[block_id] == 0 and self._hashes[block_id] is None:
                raise ValueError(f"block {block_id} is free and uncached; allocate it instead")
        for block_id in block_ids:
            if self._refs[block_id] == 0:
                del self._cached_free[block_id]
            self._refs[block_id] += 1

    def cache_block(self, block_id: int, block_hash: int, token_ids: Sequence[int]) -> None:
        """Make a full, used block findable by ``block_hash``.

        If another block already holds ``block_hash`` the existing mapping is kept and
        this block stays uncached (two copies of the same content; the older one wins so
        that blocks already handed out by ``match_prefix`` stay valid). Caching a block
        again under the same hash and tokens does nothing. No-op when prefix caching is
        disabled. Raises ValueError if the block is free, ``token_ids`` is not exactly
        ``block_size`` long, or the block is already cached under different content.
        """
        self._check_id(block_id)
        if self._refs[block_id] == 0:
            raise ValueError(f"block {block_id} is free; only used blocks can be cached")
        tokens = tuple(token_ids)
        if len(tokens) != self.block_size:
            raise ValueError(f"block holds {len(tokens)} tokens, expected {self.block_size}")
        if not self.enable_prefix_caching:
            return
        current = self._hashes[block_id]
        if current is not None:
            if current != block_hash or self._tokens[block_id] != tokens:
                raise ValueError(f"block {block_id} is already cached under other content")
            return
        if block_hash in self._block_by_hash:
            return
        self._hashes[block_id] = block_hash
        self._tokens[block_id] = tokens
        self._block_by_hash[block_hash] = block_id
        if self.on_stored is not None:
            self.on_stored([block_hash])

    def reset_prefix_cache(self) -> int:
        """Forget the hashes of all free blocks; return how many were dropped.

        Dropped blocks join the plain queue's tail in LRU order and their hashes go to
        ``on_removed`` in one call. Used blocks keep their hashes.
        """
        dropped = [self._uncache(block_id) for block_id in self._cached_free]
        self._plain_free.update(self._cached_free)
        self._cached_free.clear()
        if dropped and self.on_removed is not None:
            self.on_removed(dropped)
        return len(dropped)

    def check_invariants(self) -> None:
        """Raise RuntimeError describing the first inconsistency found, if any."""
        problems: list[str] = []
        plain, cached = set(self._plain_free), set(self._cached_free)
        zero_ref = {b for b, ref in enumerate(self._refs) if ref == 0}
        if any(ref < 0 for ref in self._refs):
            problems.append("negative ref count")
        if plain & cached:
            problems.append(f"blocks in both free queues: {sorted(plain & cached)}")
        if plain | cached != zero_ref:
            problems.append(
                f"free queues {sorted(plain | cached)} != ref-0 blocks {sorted(zero_ref)}"
            )
        if any(self._hashes[b] is not None for b in plain):
            problems.append("a plain free block has a hash")
        if any(self._hashes[b] is None for b in cached):
            problems.append("a cached free block has no hash")
        for block_id, block_hash in enumerate(self._hashes):
            tokens = self._tokens[block_id]
            if block_hash is None:
                if tokens is not None:
                    problems.append(f"block {block_id} keeps tokens without a hash")
            elif self._block_by_hash.get(block_hash) != block_id:
                problems.append(f"block {block_id}'s hash does not map back to it")
            elif tokens is None or len(tokens) != self.block_size:
                problems.append(f"block {block_id} is cached without a full token block")
        if len(self._block_by_hash) != sum(h is not None for h in self._hashes):
            problems.append("hash map holds entries for blocks that lost their hash")
        if not self.enable_prefix_caching and self._block_by_hash:
            problems.append("blocks cached while prefix caching is disabled")
        if problems:
            raise RuntimeError("BlockManager inconsistent: " + "; ".join(problems))

    def _uncache(self, block_id: int) -> int:
        block_hash = self._hashes[block_id]
        if block_hash is None:
            raise RuntimeError(f"block {block_id} is in the cached queue without a hash")
        del self._block_by_hash[block_hash]
        self._hashes[block_id] = None
        self._tokens[block_id] = None
        return block_hash

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} outside 0..{self.num_blocks - 1}")
