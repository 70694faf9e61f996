"""Prompts whose KV another engine computes: the decode side of a disaggregated prefill.

    reserve ──► waiting_for_kv ──(the KV is written into the reserved blocks)──► complete
                      │                                                             │
                      └── cancel: blocks freed, queued to be computed here          ▼
                                                                    running (decoding)

``reserve`` starts from the longest prefix this engine already caches, so only the
blocks after it (``RemoteSlots.block_ids[num_cached_blocks:]``) need KV from elsewhere.
The engine core validates the request and appends the first token; this part only
moves the sequence between states and holds or frees its blocks.
"""

from __future__ import annotations

from services.engine.kv_manager import KVCacheManager
from services.engine.outputs import RemoteSlots
from services.engine.scheduler import Scheduler
from services.engine.sequence import Sequence, SequenceStatus


class RemotePrefills:
    def __init__(self, kv: KVCacheManager, scheduler: Scheduler,
                 requests: dict[str, Sequence]) -> None:
        self.kv = kv
        self.scheduler = scheduler
        self.requests = requests  # the engine's registry of live requests, shared

    def reserve(self, seq: Sequence, kv_tokens: int | None = None) -> RemoteSlots | None:
        """Hold blocks for the first ``kv_tokens`` tokens of a new ``seq`` (default:
        the whole prompt) and register it as waiting for KV; None, nothing held, if the
        blocks are not free now."""
        kv_tokens = seq.num_prompt_tokens if kv_tokens is None else kv_tokens
        prefix = self.kv.match_prefix(seq, min(kv_tokens, seq.num_tokens - 1))
        start = prefix.num_blocks * self.kv.block_size
        if not self.kv.allocate_slots(seq, kv_tokens - start, prefix):
            return None
        seq.num_cached_tokens = start
        seq.num_computed_tokens = start
        seq.status = SequenceStatus.WAITING_FOR_KV
        self.requests[seq.request_id] = seq
        return RemoteSlots(list(seq.block_table), prefix.num_blocks)

    def _waiting(self, request_id: str) -> Sequence:
        seq = self.requests.get(request_id)
        if seq is None or seq.status is not SequenceStatus.WAITING_FOR_KV:
            raise ValueError(f"request {request_id!r} is not waiting for KV")
        return seq

    def complete(self, request_id: str, kv_tokens: int | None = None) -> Sequence:
        """The KV of its first ``kv_tokens`` tokens (default: the prompt) is in place:
        its blocks enter the prefix cache and it joins the running batch. The caller
        appends a first token if it has none. ValueError if not waiting."""
        seq = self._waiting(request_id)
        seq.num_computed_tokens = seq.num_prompt_tokens if kv_tokens is None else kv_tokens
        self.kv.cache_full_blocks(seq)
        seq.status = SequenceStatus.RUNNING
        self.scheduler.running.append(seq)
        return seq

    def cancel(self, request_id: str) -> None:
        """Free its blocks and queue it to be computed here. ValueError if not waiting."""
        seq = self._waiting(request_id)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        self.scheduler.add(seq)
