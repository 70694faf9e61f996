"""The simulated executor: an engine that runs no model but takes the time a cost
profile says, so that dozens of workers run as light processes (no torch) through the
real gateway, conductor and data plane.

It is an :class:`~services.engine.core.EngineCore`: admission, continuous batching,
preemption, the prefix cache and the KV handoff are the real engine's. Only a step's
computation differs. A step sleeps what ``profile`` gives for its work (``StepRecord``)::

    prefill part  a + sum over prompt chunks (n new tokens after c in KV) of b*n + d*n*(n/2 + c)
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
from services.engine.core import EngineCore, Sampled
from services.engine.sampling_state import TokenLogprobs
from services.engine.scheduler import ScheduledSeq, SchedulerConfig

TOKEN_WINDOW = 16


def sim_token(context: Sequence[int], vocab_size: int) -> int:
    """The simulated next token after ``context`` (prompt plus output so far)."""
    tail = list(context[-TOKEN_WINDOW:])
    raw = struct.pack(f"<Q{len(tail)}I", len(context), *tail)
    return xxhash.xxh3_64_intdigest(raw) % vocab_size


class SimKVCache:
    """``num_layers`` layers of ``block_bytes`` per block; unwritten blocks read as zeros.

    Byte layout of an export: the blocks of ``block_ids`` in order, ``block_bytes`` each;
    ``export_blocks`` concatenates the layers."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int,
                 block_bytes: int) -> None:
        if num_layers < 1 or num_blocks < 1 or block_size < 1 or block_bytes < 1:
            raise ValueError("SimKVCache needs positive layers, blocks, block size and bytes")
        self.num_layers, self.num_blocks = num_layers, num_blocks
        self.block_size, self.block_bytes = block_size, block_bytes
        self._zero = bytes(block_bytes)
        self._blocks: list[dict[int, bytes]] = [{} for _ in range(num_layers)]

    def _check(self, block_ids: Sequence[int]) -> None:
        if any(not 0 <= b < self.num_blocks for b in block_ids):
            raise ValueError(f"block ids out of range 0..{self.num_blocks - 1}")

    def write(self, layer: int, block_id: int, data: bytes) -> None:
        self._check([block_id])
        if len(data) != self.block_bytes:
            raise ValueError(f"a block holds {self.block_bytes} bytes, got {len(data)}")
        self._blocks[layer][block_id] = bytes(data)

    def export_layer_bytes(self, layer: int, block_ids: Sequence[int]) -> memoryview:
        self._check(block_ids)
        held = self._blocks[layer]
        return memoryview(b"".join(held.get(b, self._zero) for b in block_ids))

    def import_layer_bytes(self, layer: int, block_ids: Sequence[int],
                           payload: memoryview | bytes) -> None:
        self._check(block_ids)
        size = self.block_bytes
        if len(payload) != size * len(block_ids):
            raise ValueError(f"KV payload of {len(payload)} bytes for {len(block_ids)} "
                             f"blocks of {size} bytes")
        view = memoryview(payload).cast("B")
        held = self._blocks[layer]
        for i, b in enumerate(block_ids):
            held[b] = bytes(view[i * size:(i + 1) * size])

    export_layer = export_layer_bytes
    import_layer = import_layer_bytes

    def export_blocks(self, block_ids: Sequence[int]) -> bytes:
        return b"".join(bytes(self.export_layer_bytes(i, block_ids))
                        for i in range(self.num_layers))

    @property
    def block_nbytes(self) -> int:
        return self.block_bytes * self.num_layers

    def export_block_bytes(self, block_id: int) -> bytes:
        return self.export_blocks([block_id])

    def import_block_bytes(self, block_id: int, data: bytes) -> None:
        self.import_blocks([block_id], bytes(data))

    def import_blocks(self, block_ids: Sequence[int], buffer: bytes) -> None:
        per_layer = self.block_bytes * len(block_ids)
        if len(buffer) != per_layer * self.num_layers:
            raise ValueError(f"KV buffer of {len(buffer)} bytes for {self.num_layers} layers "
                             f"of {len(block_ids)} blocks")
        for i in range(self.num_layers):
            self.import_layer_bytes(i, block_ids, buffer[i * per_layer:(i + 1) * per_layer])


class SimEngine(EngineCore):
    def __init__(self, profile: CostProfile, *, block_size: int = 16,
                 num_blocks: int = 0, kv_cache_bytes: int = 1 << 30,
                 max_num_seqs: int = 128, max_num_batched_tokens: int = 2048,
                 max_model_len: int = 8192, vocab_size: int = 49152, kv_layers: int = 2,
                 block_bytes_cap: int = 512, time_scale: float = 1.0,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        """``num_blocks`` 0: the profile's ``kv_capacity_tokens``, else as many blocks as
        ``kv_cache_bytes`` holds at the profile's KV bytes per token. ``time_scale``
        multiplies every sleep (0 runs flat out)."""
        if time_scale < 0 or kv_layers < 1 or block_bytes_cap < 1:
            raise ValueError("time_scale must be >= 0, kv_layers and block_bytes_cap >= 1")
        self.profile = profile
        if not num_blocks:
            tokens = profile.kv_capacity_tokens or \
                kv_cache_bytes // profile.kv_bytes_per_token
            num_blocks = max(1, tokens // block_size)
        block_bytes = max(1, min(block_bytes_cap,
                                 profile.kv_bytes_per_token * block_size // kv_layers))
        self._init_core(
            kv_cache=SimKVCache(kv_layers, num_blocks, block_size, block_bytes),
            num_blocks=num_blocks, block_size=block_size,
            fingerprint=f"sim-{profile.name}-{block_size}-{block_bytes}x{kv_layers}",
            max_model_len=max_model_len, vocab_size=vocab_size, eos_token_ids=(),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens),
            seeded_generators=False)
        self.time_scale = time_scale
        self._sleep = sleep
        self.simulated_s = 0.0  # total seconds of work the steps stood for

    def step_seconds(self) -> float:
        """What the last step's work costs under the profile (before ``time_scale``)."""
        step, p = self.last_step, self.profile
        if step is None:
            return 0.0
        t = 0.0
        if step.prefill:
            t += p.prefill_fixed_s + sum(p.prefill_per_token_s * n + p.prefill_per_pair_s
                                         * n * (n / 2 + c) for n, c in step.prefill)
        if step.decode_batch:
            t += p.decode_step_s(step.decode_batch, step.decode_context)
        return t

    def _execute(self, scheduled: list[ScheduledSeq], layer_hook) -> list[Sampled]:
        seconds = self.step_seconds()
        self.simulated_s += seconds
        kv = self.kv_cache
        per_layer = seconds * self.time_scale / kv.num_layers
        for layer in range(kv.num_layers):
            if per_layer > 0:
                self._sleep(per_layer)
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
            sampled.append((seq, token, lp))
        return sampled

    def _write_kv(self, layer: int, seq, n: int) -> None:
        """Fill the blocks this chunk completes with a pattern of their tokens."""
        kv, bs = self.kv_cache, self.kv_cache.block_size
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        tokens = seq.token_ids()
        for i in range(start // bs, end // bs):
            digest = xxhash.xxh3_128_digest(struct.pack(
                f"<I{bs}I", layer, *tokens[i * bs:(i + 1) * bs]))
            kv.write(layer, seq.block_table[i],
                     (digest * (kv.block_bytes // 16 + 1))[:kv.block_bytes])
