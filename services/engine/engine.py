"""The engine: requests in, tokens out, one batched model step at a time.

Lifecycle of a request::

    add_request ──► waiting ──► running (prefill chunks, then one token per step) ──► finished
                        ▲            │ blocks ran out
                        └─preempted──┘ (recomputed later, from its cached prefix)

For disaggregated serving the prompt's KV may come from another engine instead::

    reserve_remote_prefill ──► waiting_for_kv ──(import_kv …)──► complete_remote_prefill ──► running

The prefill and decode services wrap this class; ``generate`` is the offline entry.
The lifecycle itself lives in :class:`~services.engine.core.EngineCore`; this class adds
the model, the tokenizer and the sampler.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq
from functools import cached_property

import torch

from common.sampling_params import SamplingParams
from services.engine.attention import TorchAttention
from services.engine.config import EngineConfig
from services.engine.core import EngineCore, Sampled
from services.engine.kv_cache import KVCache
from services.engine.model import LlamaModel
from services.engine.model_runner import ModelRunner
from services.engine.outputs import Completion
from services.engine.sampler import Sampler
from services.engine.scheduler import ScheduledSeq, SchedulerConfig
from services.engine.tokenizer import Tokenizer
from services.engine.weights import LoadedWeights, load_weights


class LLMEngine(EngineCore):
    def __init__(self, config: EngineConfig | None = None,
                 weights: LoadedWeights | None = None) -> None:
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.weights = weights or load_weights(config.model)
        self.model_config = cfg = self.weights.config
        self.device = torch.device(config.device)
        dtype = config.torch_dtype

        max_model_len = min(config.max_model_len or cfg.max_position_embeddings,
                            cfg.max_position_embeddings)
        model = LlamaModel(cfg, TorchAttention())
        model.load_hf_weights(self.weights.tensors)
        self.model = model.to(device=self.device, dtype=dtype).eval()

        per_block = KVCache.bytes_per_block(cfg.num_layers, config.block_size,
                                            cfg.num_kv_heads, cfg.head_dim, dtype)
        useful = config.max_num_seqs * -(-max_model_len // config.block_size)
        num_blocks = config.num_kv_blocks or max(1, min(config.kv_cache_bytes // per_block,
                                                        useful))
        kv_cache = KVCache(cfg.num_layers, num_blocks, config.block_size,
                           cfg.num_kv_heads, cfg.head_dim, dtype, self.device)
        self._init_core(
            kv_cache=kv_cache, num_blocks=num_blocks, block_size=config.block_size,
            fingerprint=cfg.fingerprint(self.weights.digest, config.dtype, config.block_size),
            max_model_len=max_model_len, vocab_size=cfg.vocab_size,
            eos_token_ids=cfg.eos_token_ids,
            scheduler=SchedulerConfig(max_num_seqs=config.max_num_seqs,
                                      max_num_batched_tokens=config.max_num_batched_tokens,
                                      prefill_chunk_size=config.prefill_chunk_size),
            enable_prefix_caching=config.enable_prefix_caching)
        self.runner = ModelRunner(self.model, self.kv_cache, self.device)
        self.sampler = Sampler(self.eos_token_ids)

    @cached_property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer(self.weights.tokenizer_dir, self.weights.gguf_file)

    def _encode(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)

    def _execute(self, scheduled: list[ScheduledSeq], layer_hook) -> list[Sampled]:
        logits, sampling = self.runner.run(scheduled, layer_hook)
        if not sampling:
            return []
        result = self.sampler.sample(logits, [s.sampling for s in sampling])
        return list(zip(sampling, result.token_ids, result.logprobs, strict=True))

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
