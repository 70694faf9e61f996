"""The model-free half of an engine: requests, scheduling and paged-KV bookkeeping.

``EngineCore`` owns the request lifecycle (see :mod:`services.engine.engine`); a subclass
supplies the computation by implementing ``_execute``. ``LLMEngine`` runs the model;
the simulated executor (``services/worker/sim_engine.py``) sleeps what a cost profile
says. Both therefore admit, batch, preempt, cache prefixes and hand KV over alike.

Contract of ``_execute(scheduled, layer_hook)``: compute the scheduled tokens (calling
``layer_hook(layer)`` after each layer's KV is written, when given) and return one
``(sequence, token id, logprobs or None)`` per sequence that samples this step, i.e.
whose scheduled tokens reach its last known token. It must not change the sequences:
the core advances them after it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

from common.sampling_params import SamplingParams
from services.engine.block_pool import BlockPool
from services.engine.kv_manager import KVCacheManager
from services.engine.outputs import RemoteSlots, RequestOutput, StepRecord
from services.engine.sampling_state import SamplingState, check_stop
from services.engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig
from services.engine.sequence import Sequence, SequenceStatus

Sampled = tuple[Sequence, int, Any]


class EngineCore:
    def _init_core(self, *, kv_cache: Any, num_blocks: int, block_size: int, fingerprint: str,
                   max_model_len: int, vocab_size: int, eos_token_ids: Seq[int],
                   scheduler: SchedulerConfig, enable_prefix_caching: bool = True,
                   seeded_generators: bool = True) -> None:
        self.kv_cache = kv_cache
        self.fingerprint = fingerprint
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.block_pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self.kv_manager = KVCacheManager(self.block_pool, fingerprint)
        self.scheduler = Scheduler(scheduler, self.kv_manager)
        self.requests: dict[str, Sequence] = {}
        self.last_step: StepRecord | None = None
        self._seeded_generators = seeded_generators
        self._counter = 0
        # Called on the stepping thread as layer_callback(layer, sequences) once each
        # layer's KV is written, for the sequences whose prompt completes this step.
        self.layer_callback: Callable[[int, list[Sequence]], None] | None = None

    def _execute(self, scheduled: list[ScheduledSeq],
                 layer_hook: Callable[[int], None] | None) -> list[Sampled]:
        raise NotImplementedError

    def _encode(self, prompt: str) -> list[int]:
        raise ValueError("this engine takes token ids, not text")

    # ---- requests -------------------------------------------------------------------

    def _new_sequence(self, request_id: str | None, prompt: str | Seq[int],
                      params: SamplingParams | None, cache_salt: str | None) -> Sequence:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        if request_id is None:
            request_id = f"req-{self._counter}"
            self._counter += 1
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = self._encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; this model's context is "
                             f"{self.max_model_len} tokens including at least one generated")
        if self.kv_manager.blocks_for(len(token_ids) + 1) > self.block_pool.num_blocks:
            raise ValueError(f"prompt of {len(token_ids)} tokens cannot fit in the KV cache "
                             f"({self.block_pool.num_blocks} blocks)")
        state = SamplingState.create(params, token_ids,
                                     seeded_generator=self._seeded_generators)
        return Sequence(request_id, token_ids, state, cache_salt=cache_salt)

    def add_request(self, request_id: str | None, prompt: str | Seq[int],
                    params: SamplingParams | None = None, *, cache_salt: str | None = None,
                    hold_blocks: bool = False) -> str:
        """Queue a request; returns its id. ``hold_blocks`` keeps its KV after it ends
        (for :meth:`export_kv`) until :meth:`release`. Bad input raises ``ValueError``."""
        seq = self._new_sequence(request_id, prompt, params, cache_salt)
        seq.hold_blocks = hold_blocks
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq.request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is unknown or already done."""
        seq = self.requests.get(request_id)
        if seq is None or seq.is_finished:
            return False
        self.scheduler.remove(seq)
        self._finish(seq, "abort", keep_blocks=False)
        return True

    def release(self, request_id: str) -> None:
        """Free the blocks of a finished request that was added with ``hold_blocks``."""
        seq = self.requests.get(request_id)
        if seq is not None and seq.is_finished:
            self.kv_manager.free(seq)
            del self.requests[request_id]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def _finish(self, seq: Sequence, reason: str, keep_blocks: bool) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if keep_blocks:
            return
        self.kv_manager.free(seq)
        del self.requests[seq.request_id]

    # ---- stepping -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batched step; report every request that gained a token.

        ``last_step`` then says what the step computed (None after an empty step)."""
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            self.last_step = None
            return []
        self.last_step = StepRecord.of(plan.scheduled)
        hook = None
        if self.layer_callback is not None:
            completing = [seq for seq, n in plan.scheduled
                          if not seq.output_token_ids
                          and seq.num_computed_tokens + n == seq.num_prompt_tokens]
            if completing:
                callback = self.layer_callback
                hook = lambda layer: callback(layer, completing)  # noqa: E731
        sampled = self._execute(plan.scheduled, hook)
        for seq, n in plan.scheduled:
            seq.num_computed_tokens += n
            self.kv_manager.cache_full_blocks(seq)
        return [self._append_token(seq, token, lp) for seq, token, lp in sampled]

    def _append_token(self, seq: Sequence, token: int, logprobs) -> RequestOutput:
        seq.sampling.output_token_ids.append(token)
        seq.logprobs.append(logprobs)
        reason = check_stop(seq.sampling, token, self.eos_token_ids)
        if reason is None and seq.num_tokens >= self.max_model_len:
            reason = "length"
        out = RequestOutput(seq.request_id, [token], len(seq.output_token_ids),
                            num_prompt_tokens=seq.num_prompt_tokens,
                            num_cached_tokens=seq.num_cached_tokens, new_logprobs=[logprobs])
        if len(seq.output_token_ids) == 1 and seq.scheduled_time is not None:
            out.queue_time_s = seq.scheduled_time - seq.arrival_time
        if reason is not None:
            if seq.status is SequenceStatus.RUNNING:
                self.scheduler.remove(seq)
            self._finish(seq, reason, keep_blocks=seq.hold_blocks)
            out.finished, out.finish_reason = True, reason
        return out

    # ---- KV in and out (disaggregated roles) ------------------------------------------

    def kv_block_ids(self, request_id: str) -> list[int]:
        """Blocks holding a request's computed tokens, in token order."""
        seq = self.requests[request_id]
        return seq.block_table[: self.kv_manager.blocks_for(seq.num_computed_tokens)]

    def export_kv(self, request_id: str, layer: int | None = None):
        """The computed KV of a request, all layers or one (see the KV cache's layout)."""
        blocks = self.kv_block_ids(request_id)
        if layer is None:
            return self.kv_cache.export_blocks(blocks)
        return self.kv_cache.export_layer(layer, blocks)

    def import_kv(self, block_ids: Seq[int], buffer, layer: int | None = None) -> None:
        if layer is None:
            self.kv_cache.import_blocks(block_ids, buffer)
        else:
            self.kv_cache.import_layer(layer, block_ids, buffer)

    def reserve_remote_prefill(self, request_id: str, prompt: Seq[int],
                               params: SamplingParams | None = None, *,
                               cache_salt: str | None = None) -> RemoteSlots | None:
        """Reserve blocks for a prompt another engine will prefill; None if full now."""
        seq = self._new_sequence(request_id, prompt, params, cache_salt)
        hits = self.kv_manager.match_prefix(seq)
        start = len(hits) * self.block_pool.block_size
        if not self.kv_manager.allocate_slots(seq, seq.num_prompt_tokens - start, hits):
            return None
        seq.num_cached_tokens = start
        seq.num_computed_tokens = start
        seq.status = SequenceStatus.WAITING_FOR_KV
        self.requests[seq.request_id] = seq
        return RemoteSlots(list(seq.block_table), len(hits))

    def complete_remote_prefill(self, request_id: str, first_token_id: int,
                                first_logprobs=None) -> RequestOutput:
        """The prompt's KV is in place and its first token known: start decoding."""
        seq = self.requests.get(request_id)
        if seq is None or seq.status is not SequenceStatus.WAITING_FOR_KV:
            raise ValueError(f"request {request_id!r} is not waiting for KV")
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.kv_manager.cache_full_blocks(seq)
        seq.status = SequenceStatus.RUNNING
        self.scheduler.running.append(seq)
        return self._append_token(seq, first_token_id, first_logprobs)

    def cancel_remote_prefill(self, request_id: str) -> None:
        """Give up waiting for KV and compute the prompt here instead."""
        seq = self.requests.get(request_id)
        if seq is None or seq.status is not SequenceStatus.WAITING_FOR_KV:
            raise ValueError(f"request {request_id!r} is not waiting for KV")
        self.kv_manager.free(seq)
        seq.num_computed_tokens = 0
        self.scheduler.add(seq)

    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    # ---- the cache pool ---------------------------------------------------------------

    def _chunks(self, token_ids: Seq[int], n: int) -> list[list[int]]:
        bs = self.block_pool.block_size
        return [list(token_ids[i * bs:(i + 1) * bs]) for i in range(n)]

    def cached_prefix_blocks(self, hashes: Seq[int], token_ids: Seq[int]) -> int:
        """How many leading blocks of the chain ``hashes`` (over ``token_ids``) this
        engine's prefix cache holds."""
        hashes = list(hashes)
        return len(self.block_pool.match_prefix(hashes, self._chunks(token_ids, len(hashes))))

    def adopt_blocks(self, hashes: Seq[int], token_ids: Seq[int], start: int,
                     blocks: Seq[Any]) -> int:
        """Put KV blocks fetched from elsewhere (one ``export_block_bytes`` buffer each)
        into the prefix cache as chain blocks ``start, start + 1, …`` of ``hashes`` over
        ``token_ids``, as if computed here: the next request with this prefix hits them.

        Blocks ``0 .. start-1`` must be cached here already (they are held meanwhile, so
        adopting cannot evict them). Adopts fewer when free blocks run short, none when
        the held prefix is shorter than ``start``. Returns how many were adopted; raises
        ValueError, having adopted none, when a buffer is not one block of this layout."""
        hashes = list(hashes)
        if start < 0 or start + len(blocks) > len(hashes):
            raise ValueError(f"blocks {start}..{start + len(blocks)} outside a chain of "
                             f"{len(hashes)}")
        size = self.kv_cache.block_nbytes
        if any(memoryview(b).nbytes != size for b in blocks):
            raise ValueError(f"every adopted block must be {size} bytes")
        pool = self.block_pool
        chunks = self._chunks(token_ids, start + len(blocks))
        held = pool.match_prefix(hashes[:start], chunks[:start])
        if len(held) < start:
            return 0
        pool.acquire(held)
        ids = pool.allocate(min(len(blocks), pool.num_free_blocks))
        try:
            for i, block_id in enumerate(ids):
                self.kv_cache.import_block_bytes(block_id, blocks[i])
                pool.cache_block(block_id, hashes[start + i], chunks[start + i])
        finally:
            pool.free(list(reversed(held + ids)))  # tail first: evicted before the head
        return len(ids)

    def export_cached_blocks(self, hashes: Seq[int]) -> list[Any]:
        """KV bytes (``export_block_bytes``) of the leading blocks of ``hashes`` that
        are still in the prefix cache; stops at the first that is not."""
        out = []
        for h in hashes:
            block_id = self.block_pool.block_for_hash(h)
            if block_id is None:
                break
            out.append(self.kv_cache.export_block_bytes(block_id))
        return out
