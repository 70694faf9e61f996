"""The engine: requests in, tokens out, one batched step at a time.

``EngineCore`` owns the request lifecycle, scheduling and the paged-KV bookkeeping; it
is composed of an :class:`~services.engine.executor.Executor` (the computation) and a
:class:`~services.engine.kv_store.KVStore` (the memory the KV blocks live in).
``LLMEngine`` composes it with the model and its torch KV cache; ``SimEngine``
(``services/engine/sim.py``) with a cost profile's sleep and a simulated store. Both
therefore admit, batch, preempt, cache prefixes and hand KV over alike.

Lifecycle of a request::

    add_request ──► waiting ──► running (prefill chunks, then one token per step) ──► finished
                        ▲            │ blocks ran out
                        └─preempted──┘ (recomputed later, from its cached prefix)

For disaggregated serving the prompt's KV may come from another engine instead
(see :mod:`services.engine.remote_prefill`)::

    reserve_remote_prefill ──► waiting_for_kv ──(KV written into its blocks)──►
        complete_remote_prefill ──► running

Blocks move to and from the cache pool through ``pool_blocks``
(:mod:`services.engine.pool_blocks`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from common.sampling_params import SamplingParams
from services.engine.block_manager import BlockManager, HashCallback
from services.engine.executor import Executor, LayerHook, completing_prompts
from services.engine.kv_manager import KVCacheManager
from services.engine.kv_store import KVStore
from services.engine.outputs import Detached, RemoteSlots, RequestOutput, StepRecord
from services.engine.pool_blocks import PoolBlocks
from services.engine.remote_prefill import RemotePrefills
from services.engine.sampling_state import SamplingState, TokenLogprobs, check_stop
from services.engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig
from services.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class EngineHooks:
    """Calls from the engine to its owner, all on the thread that steps the engine.

    ``on_layer(layer, sequences)``: layer ``layer``'s KV is written, in the step that
    completes the prompts of ``sequences`` (for streaming KV out while the next layer
    computes). ``on_stored(hashes)`` / ``on_removed(hashes)``: blocks became findable in
    the prefix cache / stopped being findable (see ``BlockManager``).
    """

    on_layer: Callable[[int, list[Sequence]], None] | None = None
    on_stored: HashCallback | None = None
    on_removed: HashCallback | None = None


NO_HOOKS = EngineHooks()


def _token_ids_only(prompt: str) -> list[int]:
    raise ValueError("this engine takes token ids, not text")


class EngineCore:
    def __init__(self, executor: Executor, kv_store: KVStore, *, fingerprint: str,
                 max_model_len: int, vocab_size: int, eos_token_ids: Seq[int],
                 scheduler: SchedulerConfig, enable_prefix_caching: bool = True,
                 seeded_generators: bool = True, hooks: EngineHooks = NO_HOOKS,
                 encode: Callable[[str], list[int]] = _token_ids_only) -> None:
        self.executor = executor
        self.kv_store = kv_store
        self.fingerprint = fingerprint
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.block_manager = BlockManager(kv_store.num_blocks, kv_store.block_size,
                                          enable_prefix_caching, on_stored=hooks.on_stored,
                                          on_removed=hooks.on_removed)
        self.kv_manager = KVCacheManager(self.block_manager, fingerprint)
        self.scheduler = Scheduler(scheduler, self.kv_manager)
        self.pool_blocks = PoolBlocks(self.block_manager, kv_store)
        self.requests: dict[str, Sequence] = {}
        self._remote = RemotePrefills(self.kv_manager, self.scheduler, self.requests)
        self.last_step: StepRecord | None = None
        self._on_layer = hooks.on_layer
        self._encode = encode
        self._seeded_generators = seeded_generators
        self._counter = 0

    # ---- requests -------------------------------------------------------------------

    def _new_sequence(self, request_id: str | None, prompt: str | Seq[int],
                      params: SamplingParams | None, cache_salt: str | None,
                      resumed: int = 0) -> Sequence:
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
        if self.kv_manager.blocks_for(len(token_ids) + 1) > self.block_manager.num_blocks:
            raise ValueError(f"prompt of {len(token_ids)} tokens cannot fit in the KV cache "
                             f"({self.block_manager.num_blocks} blocks)")
        if not isinstance(resumed, int) or not 0 <= resumed < len(token_ids):
            raise ValueError(f"resumed must be an integer in [0, {len(token_ids)}), "
                             f"got {resumed!r}")
        # A resumed request's last ``resumed`` tokens are output it already produced:
        # kept as output, penalties, min/max_tokens and seeded draws count them.
        cut = len(token_ids) - resumed
        state = SamplingState.create(params, token_ids[:cut],
                                     seeded_generator=self._seeded_generators)
        if resumed and resumed >= params.max_tokens:
            raise ValueError(f"the request has nothing left to generate: {resumed} of "
                             f"max_tokens={params.max_tokens} already produced")
        state.output_token_ids.extend(token_ids[cut:])
        seq = Sequence(request_id, token_ids[:cut], state, cache_salt=cache_salt)
        seq.logprobs.extend([None] * resumed)
        return seq

    def add_request(self, request_id: str | None, prompt: str | Seq[int],
                    params: SamplingParams | None = None, *, cache_salt: str | None = None,
                    hold_blocks: bool = False, resumed: int = 0) -> str:
        """Queue a request; returns its id. ``hold_blocks`` keeps its KV after it ends
        (for sending it elsewhere) until :meth:`release`. ``resumed``: the last that many
        tokens of ``prompt`` are this request's output so far (a stream continued after
        its worker was lost), recomputed like a preempted request's. Bad input raises
        ``ValueError``."""
        seq = self._new_sequence(request_id, prompt, params, cache_salt, resumed)
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
        scheduled = self.scheduler.schedule()
        if not scheduled:
            self.last_step = None
            return []
        self.last_step = StepRecord.of(scheduled)
        sampled = self.executor.execute(scheduled, self._layer_hook(scheduled))
        for seq, n in scheduled:
            seq.num_computed_tokens += n
            self.kv_manager.cache_full_blocks(seq)
        return [self._append_token(seq, token, lp) for seq, token, lp in sampled]

    def _layer_hook(self, scheduled: list[ScheduledSeq]) -> LayerHook | None:
        """``on_layer`` bound to the prompts this step completes; None when there are none."""
        on_layer = self._on_layer
        if on_layer is None:
            return None
        completing = completing_prompts(scheduled)
        if not completing:
            return None
        return lambda layer: on_layer(layer, completing)

    def _append_token(self, seq: Sequence, token: int,
                      logprobs: TokenLogprobs | None) -> RequestOutput:
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

    # ---- KV from another engine (disaggregated decode) --------------------------------

    def reserve_remote_prefill(self, request_id: str, prompt: Seq[int],
                               params: SamplingParams | None = None, *,
                               cache_salt: str | None = None) -> RemoteSlots | None:
        """Reserve blocks for a prompt another engine will prefill; None if full now."""
        seq = self._new_sequence(request_id, prompt, params, cache_salt)
        return self._remote.reserve(seq)

    def complete_remote_prefill(self, request_id: str, first_token_id: int,
                                first_logprobs: TokenLogprobs | None = None) -> RequestOutput:
        """The prompt's KV is in place and its first token known: start decoding."""
        seq = self._remote.complete(request_id)
        return self._append_token(seq, first_token_id, first_logprobs)

    def cancel_remote_prefill(self, request_id: str) -> None:
        """Give up waiting for KV and compute the prompt here instead."""
        self._remote.cancel(request_id)

    # ---- a running request moved to another engine, KV and all ---------------------

    def detach(self, request_id: str) -> Detached | None:
        """Stop stepping a decoding request, keeping its blocks, so that its KV can be
        sent elsewhere; None (nothing changed) unless it runs with a token generated
        and every token but the last computed. ``abort`` frees it afterwards."""
        seq = self.requests.get(request_id)
        if (seq is None or seq.status is not SequenceStatus.RUNNING
                or not seq.output_token_ids or seq.num_computed_tokens != seq.num_tokens - 1):
            return None
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.DETACHED
        kv_blocks = self.kv_manager.blocks_for(seq.num_computed_tokens)
        return Detached(list(seq.prompt_token_ids), list(seq.output_token_ids), seq.params,
                        seq.cache_salt, seq.block_table[:kv_blocks], seq.num_cached_tokens)

    def reserve_migrated(self, request_id: str, prompt: Seq[int], output: Seq[int],
                         params: SamplingParams, *, cache_salt: str | None = None,
                         cached_tokens: int = 0) -> RemoteSlots | None:
        """Reserve blocks for the KV of a request another engine ``detach``-ed (every
        token of ``prompt`` + ``output`` but the last); None if full now. ValueError
        for a request that cannot go on here."""
        seq = self._new_sequence(request_id, prompt, params, cache_salt)
        output = list(output)
        if not output or not all(isinstance(t, int) and 0 <= t < self.vocab_size
                                 for t in output):
            raise ValueError(f"output token ids must be integers in [0, {self.vocab_size})")
        total = len(seq.prompt_token_ids) + len(output)
        if len(output) >= seq.params.max_tokens or total >= self.max_model_len:
            raise ValueError("the request has nothing left to generate")
        if self.kv_manager.blocks_for(total + 1) > self.block_manager.num_blocks:
            raise ValueError(f"{total} tokens cannot fit in the KV cache")
        seq.sampling.output_token_ids.extend(output)
        seq.logprobs.extend([None] * len(output))
        slots = self._remote.reserve(seq, total - 1)
        if slots is not None:
            seq.num_cached_tokens = cached_tokens
        return slots

    def complete_migrated(self, request_id: str) -> None:
        """A migrated request's KV is in place: it decodes its next token in the next step."""
        seq = self.requests.get(request_id)
        if seq is None:
            raise ValueError(f"request {request_id!r} is not waiting for KV")
        self._remote.complete(request_id, kv_tokens=seq.num_tokens - 1)
        seq.scheduled_time = time.monotonic()
