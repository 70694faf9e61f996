"""The model engine: ``EngineCore`` composed with the model, its torch KV cache and the
sampler. ``LLMEngine(EngineConfig(...))`` is the offline entry (``generate``); the
prefill and decode services drive the same object step by step (see
:mod:`services.engine.core` for the request lifecycle).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from functools import cached_property

import msgpack
import torch

from common.sampling_params import SamplingParams
from services.engine.attention_backends import make_attention_backend
from services.engine.config import EngineConfig
from services.engine.core import NO_HOOKS, EngineCore, EngineHooks
from services.engine.cuda_graphs import make_decode_graphs
from services.engine.executor import LayerHook, Sampled, completing_prompts
from services.engine.kv_cache import KVCache
from services.engine.model import LlamaModel
from services.engine.model_config import ModelConfig
from services.engine.model_runner import ModelRunner, StepInputs
from services.engine.outputs import Completion
from services.engine.sampler import Sampler
from services.engine.scheduler import ScheduledSeq, SchedulerConfig
from services.engine.tokenizer import Tokenizer
from services.engine.tp import SINGLE, ParallelContext, check_shardable, shard_shape
from services.engine.tp_direct import direct_sends
from services.engine.tp_group import STEP_EXPORT, Leader
from services.engine.tp_kv import ShardedKVStore
from services.engine.tp_shard import shard_hf_tensors
from services.engine.weights import LoadedWeights, release_freed_memory
from services.engine.weights.quantize import quantize_model
from services.engine.weights.source import weights_for


class ModelExecutor:
    """The ``Executor`` that runs the model: a forward pass, then the sampler. With
    tensor parallelism (``leader`` given) each step's inputs go to the followers first,
    after the KV imports waiting for them; in a step with a layer hook every rank
    gathers each layer of the completing prompts' blocks for it (``tp_kv.py``); and a
    broken collective makes the engine dead (``EngineDeadError``)."""

    def __init__(self, runner: ModelRunner, sampler: Sampler,
                 leader: Leader | None = None, kv: ShardedKVStore | None = None) -> None:
        self.runner = runner
        self.sampler = sampler
        self.leader = leader
        self.kv = kv

    def execute(self, scheduled: list[ScheduledSeq],
                layer_hook: LayerHook | None) -> list[Sampled]:
        inputs, sampling = self.runner.prepare(scheduled)
        if self.leader is None:
            logits = self.runner.forward(inputs, layer_hook)
        else:
            logits = self._execute_tp(inputs, scheduled, layer_hook)
        if not sampling:
            return []
        result = self.sampler.sample(logits, [s.sampling for s in sampling])
        return [Sampled(*t) for t in
                zip(sampling, result.token_ids, result.logprobs, strict=True)]

    def _execute_tp(self, inputs: StepInputs, scheduled: list[ScheduledSeq],
                    layer_hook: LayerHook | None):
        self.kv.flush()
        bs = self.runner.block_size
        completing = [] if layer_hook is None else completing_prompts(scheduled)
        routes = self.kv.routes
        # Prompts with a route: every rank sends its slice (tp_direct.py); the rest are
        # gathered on rank 0.
        direct = direct_sends(completing, routes, bs)
        export = sorted({b for seq in completing if seq.request_id not in routes
                         for b in seq.block_table[:-(-seq.num_prompt_tokens // bs)]})
        if export or direct:
            self.leader.send_step(msgpack.packb(
                [export, inputs.to_msgpack(), direct, self.kv.heads_by_rank],
                use_bin_type=True), STEP_EXPORT)
            self.kv.begin_step(export)
            if export:
                layer_hook = self.kv.staging_hook(layer_hook)
        else:
            self.leader.send_step(inputs.to_msgpack())
            self.kv.begin_step([])
        try:
            logits = self.runner.forward(inputs, layer_hook)
            self.kv.end_step(deliver=True)  # the last layer's gather ends after the forward
            return logits
        except RuntimeError as exc:  # a collective that lost a rank
            raise self.leader.broken("a tensor-parallel collective", exc) from exc
        finally:
            self.kv.end_step()


def set_threads(config: EngineConfig) -> None:
    """Torch's intra-op threads: as asked; with several CPU ranks and no ask, this
    process's CPUs shared out among them (each rank is its own process)."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    elif config.tensor_parallel_size > 1 and config.torch_device.type == "cpu":
        cpus = len(os.sched_getaffinity(0))
        torch.set_num_threads(max(1, cpus // config.tensor_parallel_size))


def build_runner(config: EngineConfig, cfg: ModelConfig, tensors: dict[str, torch.Tensor],
                 tp: ParallelContext, *, consume: bool = False) -> tuple[ModelRunner, int]:
    """This rank's model shard and KV cache (its KV heads); and the model length used.
    The model holds ``tensors`` themselves (``LlamaModel.from_hf_weights``); ``consume``
    empties the dict as it goes."""
    device, dtype = config.rank_device(tp.rank), config.torch_dtype
    max_model_len = min(config.max_model_len or cfg.max_position_embeddings,
                        cfg.max_position_embeddings)
    if tp.world_size > 1:  # a dict of this rank's slices: the model may consume it
        tensors, consume = shard_hf_tensors(tensors, cfg, tp.rank, tp.world_size), True
    model = LlamaModel.from_hf_weights(
        cfg, make_attention_backend(config.attention_backend, device), tensors, tp=tp,
        consume=consume)
    model = model.to(device=device, dtype=dtype).eval()
    # After the cast: int4 keeps bfloat16 scales, which a cast to float32 would undo.
    quantize_model(model, config.quantization)
    kv_heads = model.shard.num_kv_heads
    per_block = KVCache.bytes_per_block(cfg.num_layers, config.block_size, kv_heads,
                                        cfg.head_dim, config.kv_torch_dtype)
    useful = config.max_num_seqs * -(-max_model_len // config.block_size)
    num_blocks = config.num_kv_blocks or max(1, min(config.kv_cache_bytes // per_block, useful))
    if tp.world_size > 1:  # every rank must hold the same block ids (and is loaded)
        total = int(tp.all_reduce(torch.tensor([num_blocks], device=device)).item())
        if total != num_blocks * tp.world_size:
            raise ValueError(f"tensor-parallel ranks disagree on the KV block count "
                             f"(rank {tp.rank}: {num_blocks})")
    kv_cache = KVCache(cfg.num_layers, num_blocks, config.block_size, kv_heads,
                       cfg.head_dim, config.kv_torch_dtype, device)
    runner = ModelRunner(model, kv_cache, device)
    if config.use_cuda_graphs:
        runner.graphs = make_decode_graphs(model, kv_cache, device, config.max_num_seqs,
                                           max_model_len)
    return runner, max_model_len


class LLMEngine(EngineCore):
    def __init__(self, config: EngineConfig | None = None,
                 weights: LoadedWeights | None = None, *,
                 hooks: EngineHooks = NO_HOOKS) -> None:
        self.config = config = config or EngineConfig()
        world = config.tensor_parallel_size
        set_threads(config)
        owned = weights is None  # then its tensors may be consumed as the model takes them
        self.weights = weights or weights_for(config)
        self.model_config = cfg = self.weights.config
        check_shardable(cfg, world)  # before any follower starts
        self.tp_leader = None if world == 1 else Leader(
            json.dumps(dataclasses.asdict(config)), world, config.torch_device)
        tp = SINGLE if self.tp_leader is None else self.tp_leader.tp
        self.device = config.torch_device
        runner, max_model_len = build_runner(config, cfg, self.weights.tensors, tp,
                                             consume=owned)
        # The model holds the weights now (this rank's shard): keep what identifies
        # them, not a second copy.
        self.weights = dataclasses.replace(self.weights, tensors={})
        release_freed_memory()  # what loading, fusing and casting freed
        self.model = runner.model
        kv_store = runner.kv_cache
        if self.tp_leader is not None:  # exports and imports carry every rank's heads
            leader = self.tp_leader
            kv_store = ShardedKVStore(
                runner.kv_cache, [shard_shape(cfg, r, world) for r in range(world)],
                cfg.num_kv_heads, leader.kv_group, leader.send_step, leader.broken,
                leader.receive)
        executor = ModelExecutor(runner, Sampler(tuple(cfg.eos_token_ids)), self.tp_leader,
                                 kv_store if self.tp_leader is not None else None)
        # KV moves in the all-heads layout whatever the TP size: one fingerprint.
        super().__init__(
            executor, kv_store,
            fingerprint=cfg.fingerprint(self.weights.digest, config.precision,
                                        config.block_size),
            max_model_len=max_model_len, vocab_size=cfg.vocab_size,
            eos_token_ids=cfg.eos_token_ids,
            scheduler=SchedulerConfig(max_num_seqs=config.max_num_seqs,
                                      max_num_batched_tokens=config.max_num_batched_tokens,
                                      prefill_chunk_size=config.prefill_chunk_size,
                                      max_prefill_tokens_with_decode=(
                                          config.max_prefill_tokens_with_decode)),
            enable_prefix_caching=config.enable_prefix_caching, hooks=hooks,
            encode=lambda text: self.tokenizer.encode(text))

    @property
    def tp_failed(self) -> threading.Event | None:
        """Set once a tensor-parallel rank died (then ``tp_leader.reason`` says which);
        None for a one-rank engine. Safe to read from any thread."""
        return None if self.tp_leader is None else self.tp_leader.failed

    def close(self) -> None:
        """Stop the tensor-parallel followers and free the KV export buffers. Call on
        the thread that steps the engine."""
        if self.tp_leader is not None:
            self.tp_leader.close()
        self.kv_store.close()

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
