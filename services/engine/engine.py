"""The engine: requests in, tokens out, one batched model step at a time.

Lifecycle of a request::

    add_request ──► waiting ──► running (prefill chunks, then one token per step) ──► finished
                        ▲            │ blocks ran out
                        └─preempted──┘ (recomputed later, from its cached prefix)

For disaggregated serving the prompt's KV may come from another engine instead::

    reserve_remote_prefill ──► waiting_for_kv ──(import_kv …)──► complete_remote_prefill ──► running

The prefill and decode services wrap this class; ``generate`` is the offline entry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from functools import cached_property

import torch

from services.engine.attention import TorchAttention
from services.engine.block_pool import BlockPool
from services.engine.config import EngineConfig
from services.engine.kv_cache import KVCache
from services.engine.kv_manager import KVCacheManager
from services.engine.model import LlamaModel
from services.engine.model_runner import ModelRunner
from services.engine.outputs import Completion, RemoteSlots, RequestOutput
from services.engine.sampler import Sampler, SamplingState, check_stop
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import Scheduler, SchedulerConfig
from services.engine.sequence import Sequence, SequenceStatus
from services.engine.tokenizer import Tokenizer
from services.engine.weights import LoadedWeights, load_weights


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None,
                 weights: LoadedWeights | None = None) -> None:
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.weights = weights or load_weights(config.model)
        self.model_config = cfg = self.weights.config
        self.device = torch.device(config.device)
        dtype = config.torch_dtype

        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings,
                                 cfg.max_position_embeddings)
        model = LlamaModel(cfg, TorchAttention())
        model.load_hf_weights(self.weights.tensors)
        self.model = model.to(device=self.device, dtype=dtype).eval()

        per_block = KVCache.bytes_per_block(cfg.num_layers, config.block_size,
                                            cfg.num_kv_heads, cfg.head_dim, dtype)
        useful = config.max_num_seqs * -(-self.max_model_len // config.block_size)
        num_blocks = config.num_kv_blocks or max(1, min(config.kv_cache_bytes // per_block,
                                                        useful))
        self.kv_cache = KVCache(cfg.num_layers, num_blocks, config.block_size,
                                cfg.num_kv_heads, cfg.head_dim, dtype, self.device)
        self.fingerprint = cfg.fingerprint(self.weights.digest, config.dtype, config.block_size)
        self.block_pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching)
        self.kv_manager = KVCacheManager(self.block_pool, self.fingerprint)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            prefill_chunk_size=config.prefill_chunk_size), self.kv_manager)
        self.runner = ModelRunner(self.model, self.kv_cache, self.device)
        self.eos_token_ids = tuple(cfg.eos_token_ids)
        self.sampler = Sampler(self.eos_token_ids)
        self.requests: dict[str, Sequence] = {}
        self._counter = 0
        # Called on the stepping thread as layer_callback(layer, sequences) once each
        # layer's KV is written, for the sequences whose prompt completes this step.
        self.layer_callback: Callable[[int, list[Sequence]], None] | None = None

    @cached_property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer(self.weights.tokenizer_dir, self.weights.gguf_file)

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
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; this model's context is "
                             f"{self.max_model_len} tokens including at least one generated")
        if self.kv_manager.blocks_for(len(token_ids) + 1) > self.block_pool.num_blocks:
            raise ValueError(f"prompt of {len(token_ids)} tokens cannot fit in the KV cache "
                             f"({self.block_pool.num_blocks} blocks)")
        return Sequence(request_id, token_ids, SamplingState.create(params, token_ids),
                        cache_salt=cache_salt)

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
        """Run one batched forward pass; report every request that gained a token."""
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return []
        hook = None
        if self.layer_callback is not None:
            completing = [seq for seq, n in plan.scheduled
                          if not seq.output_token_ids
                          and seq.num_computed_tokens + n == seq.num_prompt_tokens]
            if completing:
                callback = self.layer_callback
                hook = lambda layer: callback(layer, completing)  # noqa: E731
        logits, sampling = self.runner.run(plan.scheduled, hook)
        for seq, n in plan.scheduled:
            seq.num_computed_tokens += n
            self.kv_manager.cache_full_blocks(seq)
        if not sampling:
            return []
        result = self.sampler.sample(logits, [s.sampling for s in sampling])
        outputs = []
        for seq, token, lp in zip(sampling, result.token_ids, result.logprobs, strict=True):
            outputs.append(self._append_token(seq, token, lp))
        return outputs

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

    def generate(self, prompts: Iterable[str | Seq[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None) -> list[Completion]:
        """Run prompts to completion (offline use); results in the order given."""
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        ids = [self.add_request(None, p, sp) for p, sp in zip(prompts, params, strict=True)]
        seqs = {rid: self.requests[rid] for rid in ids}
        while self.has_unfinished_requests():
            self.step()
        has_text = any(isinstance(p, str) for p in prompts)
        return [Completion(
            rid, s.prompt_token_ids, list(s.output_token_ids),
            self.tokenizer.decode(s.output_token_ids) if has_text else None,
            s.finish_reason or "abort", s.num_cached_tokens, list(s.logprobs))
            for rid, s in seqs.items()]

    # ---- KV in and out (disaggregated roles) ------------------------------------------

    def kv_block_ids(self, request_id: str) -> list[int]:
        """Blocks holding a request's computed tokens, in token order."""
        seq = self.requests[request_id]
        return seq.block_table[: self.kv_manager.blocks_for(seq.num_computed_tokens)]

    def export_kv(self, request_id: str, layer: int | None = None) -> torch.Tensor:
        """The computed KV of a request, all layers or one (see :mod:`kv_cache` layout)."""
        blocks = self.kv_block_ids(request_id)
        if layer is None:
            return self.kv_cache.export_blocks(blocks)
        return self.kv_cache.export_layer(layer, blocks)

    def import_kv(self, block_ids: Seq[int], buffer: torch.Tensor,
                  layer: int | None = None) -> None:
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
