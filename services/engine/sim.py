"""The simulated engine: it runs no model but takes the time a cost profile says, so
that dozens of workers run as light processes (no torch) through the real gateway,
conductor and data plane.

``SimEngine`` is an :class:`~services.engine.core.EngineCore` composed with a
``SimExecutor`` and a ``SimKVStore``: admission, continuous batching, preemption, the
prefix cache and the KV handoff are the real engine's. Only a step's computation
differs. A step sleeps what ``profile`` gives for its work (``StepRecord``)::

    prefill part  a + sum over prompt chunks (n new tokens after c in KV) of b*n + d*n*(n/2 + c)
                  (the terms of ``common/cost_profile.py``)
    decode part   e + f*B + g*K          (B sequences decoding over K tokens of KV)

(each part only when the step has such work), split evenly over ``kv_layers`` layers so
that a prompt's KV streams out layer by layer as it would from a model.

Tokens are deterministic: the token after a context is :func:`sim_token` of it, a hash
of its length and last 16 tokens. So a prefill on one worker and the decode on another
agree, a stream resumed elsewhere (prompt + tokens so far) goes on with the same tokens,
and a test can predict every token. It never produces EOS: a request ends at
``max_tokens`` or at one of its stop token ids. Logprobs, when asked, are 0 for the
chosen token.

KV: each block holds ``block_bytes`` real bytes per layer (the profile's KV bytes per
token over ``kv_layers`` layers, capped), stored sparsely, so transfers move and check
real payloads without the memory of a real cache. A prompt chunk writes a pattern
derived from its tokens, so a block that arrives intact is recognisable.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Sequence

import xxhash

from common.cost_profile import CostProfile
from services.engine.core import NO_HOOKS, EngineCore, EngineHooks
from services.engine.executor import LayerHook, Sampled
from services.engine.kv_store import Buffer
from services.engine.outputs import StepRecord
from services.engine.sampling_state import TokenLogprobs
from services.engine.scheduler import ScheduledSeq, SchedulerConfig
from services.engine.sequence import Sequence as SequenceState

TOKEN_WINDOW = 16


def sim_token(context: Sequence[int], vocab_size: int) -> int:
    """The simulated next token after ``context`` (prompt plus output so far)."""
    tail = list(context[-TOKEN_WINDOW:])
    raw = struct.pack(f"<Q{len(tail)}I", len(context), *tail)
    return xxhash.xxh3_64_intdigest(raw) % vocab_size


class SimKVStore:
    """A ``KVStore`` of ``num_layers`` layers of ``block_bytes`` per block; unwritten
    blocks read as zeros. A layer's export is the blocks in order, ``block_bytes`` each;
    a block's export is its layers in order."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int,
                 block_bytes: int) -> None:
        if num_layers < 1 or num_blocks < 1 or block_size < 1 or block_bytes < 1:
            raise ValueError("SimKVStore needs positive layers, blocks, block size and bytes")
        self.num_layers, self.num_blocks = num_layers, num_blocks
        self.block_size, self.block_bytes = block_size, block_bytes
        self._zero = bytes(block_bytes)
        self._blocks: list[dict[int, bytes]] = [{} for _ in range(num_layers)]

    def _check(self, block_ids: Sequence[int]) -> None:
        if any(not 0 <= b < self.num_blocks for b in block_ids):
            raise ValueError(f"block ids out of range 0..{self.num_blocks - 1}")

    def write(self, layer: int, block_id: int, data: bytes) -> None:
        """The executor's write of one layer of one block."""
        self._check([block_id])
        if len(data) != self.block_bytes:
            raise ValueError(f"a block holds {self.block_bytes} bytes, got {len(data)}")
        self._blocks[layer][block_id] = bytes(data)

    @property
    def block_nbytes(self) -> int:
        return self.block_bytes * self.num_layers

    def export_layer_bytes(self, layer: int, block_ids: Sequence[int]) -> memoryview:
        self._check(block_ids)
        held = self._blocks[layer]
        return memoryview(b"".join(held.get(b, self._zero) for b in block_ids))

    def import_layer_bytes(self, layer: int, block_ids: Sequence[int],
                           payload: Buffer) -> None:
        self._check(block_ids)
        view = memoryview(payload).cast("B")
        size = self.block_bytes
        if view.nbytes != size * len(block_ids):
            raise ValueError(f"KV payload of {view.nbytes} bytes for {len(block_ids)} "
                             f"blocks of {size} bytes")
        held = self._blocks[layer]
        for i, b in enumerate(block_ids):
            held[b] = bytes(view[i * size:(i + 1) * size])

    def export_block_bytes(self, block_id: int) -> memoryview:
        self._check([block_id])
        return memoryview(b"".join(layer.get(block_id, self._zero) for layer in self._blocks))

    def import_block_bytes(self, block_id: int, data: Buffer) -> None:
        self._check([block_id])
        view = memoryview(data).cast("B")
        size = self.block_bytes
        if view.nbytes != self.block_nbytes:
            raise ValueError(f"a block holds {self.block_nbytes} bytes, got {view.nbytes}")
        for i, layer in enumerate(self._blocks):
            layer[block_id] = bytes(view[i * size:(i + 1) * size])


class SimExecutor:
    """The ``Executor`` that sleeps what the profile says a step costs."""

    def __init__(self, profile: CostProfile, kv_store: SimKVStore, vocab_size: int, *,
                 time_scale: float, sleep: Callable[[float], None],
                 clock: Callable[[], float] | None = None) -> None:
        self.profile = profile
        # With a clock, each layer sleeps until its share of the step is due, so the
        # step's own work (KV writes, a late wake-up on a busy host) is absorbed rather
        # than added: a step lasts what the profile says, as the offline simulator has it.
        self._clock = clock
        self.kv_store = kv_store
        self.vocab_size = vocab_size
        self.time_scale = time_scale
        self._sleep = sleep
        self.simulated_s = 0.0  # total seconds of work the steps stood for

    def step_seconds(self, step: StepRecord) -> float:
        """What a step's work costs under the profile (before ``time_scale``)."""
        p = self.profile
        return p.prefill_step_s(step.prefill) + p.decode_step_s(step.decode_batch,
                                                               step.decode_context)

    def execute(self, scheduled: list[ScheduledSeq],
                layer_hook: LayerHook | None) -> list[Sampled]:
        seconds = self.step_seconds(StepRecord.of(scheduled))
        self.simulated_s += seconds
        kv = self.kv_store
        per_layer = seconds * self.time_scale / kv.num_layers
        start = self._clock() if self._clock is not None else 0.0
        for layer in range(kv.num_layers):
            if per_layer > 0:
                wait = per_layer if self._clock is None else \
                    start + (layer + 1) * per_layer - self._clock()
                if wait > 0:
                    self._sleep(wait)
            for seq, n in scheduled:
                self._write_kv(layer, seq, n)
            if layer_hook is not None:
                layer_hook(layer)
        sampled = []
        for seq, n in scheduled:
            if seq.num_computed_tokens + n < seq.num_tokens:
                continue  # a prompt chunk that does not reach the end yet
            token = sim_token(seq.token_ids(), self.vocab_size)
            k = seq.params.logprobs
            lp = None if k is None else TokenLogprobs(token, 0.0, 1, [(token, 0.0)][:k])
            sampled.append(Sampled(seq, token, lp))
        return sampled

    def _write_kv(self, layer: int, seq: SequenceState, n: int) -> None:
        """Fill the blocks this chunk completes with a pattern of their tokens."""
        kv, bs = self.kv_store, self.kv_store.block_size
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        tokens = seq.token_ids()
        for i in range(start // bs, end // bs):
            digest = xxhash.xxh3_128_digest(struct.pack(
                f"<I{bs}I", layer, *tokens[i * bs:(i + 1) * bs]))
            kv.write(layer, seq.block_table[i],
                     (digest * (kv.block_bytes // 16 + 1))[:kv.block_bytes])


class SimEngine(EngineCore):
    """An engine core composed with the simulated executor and KV store."""

    def __init__(self, profile: CostProfile, *, block_size: int = 16,
                 num_blocks: int = 0, kv_cache_bytes: int = 1 << 30,
                 max_num_seqs: int = 128, max_num_batched_tokens: int = 2048,
                 prefill_chunk_size: int | None = None,
                 max_prefill_tokens_with_decode: int | None = None,
                 max_model_len: int = 8192, vocab_size: int = 49152, kv_layers: int = 2,
                 block_bytes_cap: int = 512, time_scale: float = 1.0,
                 sleep: Callable[[float], None] = time.sleep,
                 hooks: EngineHooks = NO_HOOKS) -> None:
        """``num_blocks`` 0: the profile's ``kv_capacity_tokens``, else as many blocks as
        ``kv_cache_bytes`` holds at the profile's KV bytes per token. ``time_scale``
        multiplies every sleep (0 runs flat out)."""
        if time_scale < 0 or kv_layers < 1 or block_bytes_cap < 1:
            raise ValueError("time_scale must be >= 0, kv_layers and block_bytes_cap >= 1")
        if not num_blocks:
            tokens = profile.kv_capacity_tokens or \
                kv_cache_bytes // profile.kv_bytes_per_token
            num_blocks = max(1, tokens // block_size)
        block_bytes = max(1, min(block_bytes_cap,
                                 profile.kv_bytes_per_token * block_size // kv_layers))
        kv_store = SimKVStore(kv_layers, num_blocks, block_size, block_bytes)
        executor = SimExecutor(profile, kv_store, vocab_size, time_scale=time_scale,
                               sleep=sleep,
                               clock=time.perf_counter if sleep is time.sleep else None)
        super().__init__(
            executor, kv_store,
            fingerprint=f"sim-{profile.name}-{block_size}-{block_bytes}x{kv_layers}",
            max_model_len=max_model_len, vocab_size=vocab_size, eos_token_ids=(),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      prefill_chunk_size=prefill_chunk_size,
                                      max_prefill_tokens_with_decode=(
                                          max_prefill_tokens_with_decode)),
            seeded_generators=False, hooks=hooks)
