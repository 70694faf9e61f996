"""The model engine: ``EngineCore`` composed with the model, its torch KV cache and the
sampler. ``LLMEngine(EngineConfig(...))`` is the offline entry (``generate``); the
prefill and decode services drive the same object step by step (see
:mod:`services.engine.core` for the request lifecycle).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from functools import cached_property

import torch

from common.sampling_params import SamplingParams
from services.engine.attention_backends import make_attention_backend
from services.engine.config import EngineConfig
from services.engine.core import NO_HOOKS, EngineCore, EngineHooks
from services.engine.executor import LayerHook, Sampled
from services.engine.kv_cache import KVCache
from services.engine.model import LlamaModel
from services.engine.model_runner import ModelRunner
from services.engine.outputs import Completion
from services.engine.sampler import Sampler
from services.engine.scheduler import ScheduledSeq, SchedulerConfig
from services.engine.tokenizer import Tokenizer
from services.engine.weights import LoadedWeights, load_weights, release_freed_memory
from services.engine.weights.quantize import quantize_model


class ModelExecutor:
    """The ``Executor`` that runs the model: a forward pass, then the sampler."""

    def __init__(self, runner: ModelRunner, sampler: Sampler) -> None:
        self.runner = runner
        self.sampler = sampler

    def execute(self, scheduled: list[ScheduledSeq],
                layer_hook: LayerHook | None) -> list[Sampled]:
        logits, sampling = self.runner.run(scheduled, layer_hook)
        if not sampling:
            return []
        result = self.sampler.sample(logits, [s.sampling for s in sampling])
        return [Sampled(*t) for t in
                zip(sampling, result.token_ids, result.logprobs, strict=True)]


class LLMEngine(EngineCore):
    def __init__(self, config: EngineConfig | None = None,
                 weights: LoadedWeights | None = None, *,
                 hooks: EngineHooks = NO_HOOKS) -> None:
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        owned = weights is None
        weights = weights or load_weights(config.model)
        self.model_config = cfg = weights.config
        self.device = config.torch_device
        dtype = config.torch_dtype

        max_model_len = min(config.max_model_len or cfg.max_position_embeddings,
                            cfg.max_position_embeddings)
        model = LlamaModel.from_hf_weights(
            cfg, make_attention_backend(config.attention_backend, self.device),
            weights.tensors, consume=owned)
        # The model holds the weights now; keep what identifies them, not a second copy.
        self.weights = dataclasses.replace(weights, tensors={})
        quantize_model(model, config.quantization)
        self.model = model.to(device=self.device, dtype=dtype).eval()
        release_freed_memory()  # what loading, fusing and casting freed

        per_block = KVCache.bytes_per_block(cfg.num_layers, config.block_size,
                                            cfg.num_kv_heads, cfg.head_dim, dtype)
        useful = config.max_num_seqs * -(-max_model_len // config.block_size)
        num_blocks = config.num_kv_blocks or max(1, min(config.kv_cache_bytes // per_block,
                                                        useful))
        kv_cache = KVCache(cfg.num_layers, num_blocks, config.block_size,
                           cfg.num_kv_heads, cfg.head_dim, dtype, self.device)
        executor = ModelExecutor(ModelRunner(self.model, kv_cache, self.device),
                                 Sampler(tuple(cfg.eos_token_ids)))
        super().__init__(
            executor, kv_cache,
            fingerprint=cfg.fingerprint(self.weights.digest, config.precision, config.block_size),
            max_model_len=max_model_len, vocab_size=cfg.vocab_size,
            eos_token_ids=cfg.eos_token_ids,
            scheduler=SchedulerConfig(max_num_seqs=config.max_num_seqs,
                                      max_num_batched_tokens=config.max_num_batched_tokens,
                                      prefill_chunk_size=config.prefill_chunk_size),
            enable_prefix_caching=config.enable_prefix_caching, hooks=hooks,
            encode=lambda text: self.tokenizer.encode(text))

    @cached_property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer(self.weights.tokenizer_dir, self.weights.gguf_file)

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
