"""Cost profiles: what a simulated worker's prefill, decode step and KV transfer cost.

The simulator runs the true costs of a profile; the policy's cost model starts from the
same calibration and refits online from the timings the simulated workers report.

``LLAMA70B_H100X4`` -- a Llama-2-70B-shaped model (80 layers, hidden 8192, 64 query heads,
8 KV heads of dimension 128) in bf16 on one 4 x H100 SXM 80 GB tensor-parallel group.
Public figures used: H100 SXM dense bf16 989 TFLOP/s and HBM3 3.35 TB/s per GPU
(NVIDIA datasheet); one ConnectX-7 400 Gb/s NIC per GPU.

* KV per token: 80 layers x 8 heads x 128 x 2 (K and V) x 2 bytes = 327,680 B (320 KiB).
* Prefill matmuls: 2 x 70e9 FLOP/token over 4 x 989 TFLOP/s at an assumed 45 % MFU
  (1.78 PFLOP/s) -> 79 us/token, about 12,700 tok/s per group.
* Prefill attention: 4 x 8192 x 80 = 2.6 MFLOP per (query, key) pair at the same rate
  -> 1.5 ns/pair (an 8k-token prompt: 0.65 s of matmuls + 0.05 s of attention).
* Decode step: weights 140 GB read at 70 % of 4 x 3.35 TB/s -> 15 ms; 0.1 ms per
  sequence (matmul FLOPs and sampling); KV read 327,680 B/token at the same 9.4 TB/s
  -> 35 ns per context token. Batch 32 at 12k tokens each: 15 + 3 + 13.6 = 32 ms.
* KV capacity: 320 GB HBM - 140 GB weights - ~20 GB activations and workspace = 160 GB
  -> 488k tokens -> 950 blocks of 512 tokens.
* Prefix cache: 0.5 TB of host DRAM per group (half of a 1 TB, 8-GPU node) ->
  3,000 blocks of 512 tokens (168 MB each).
* Link: 4 x 400 Gb/s = 200 GB/s raw, 100 GB/s assumed achieved -> 12k tokens of KV
  (3.9 GB) in 39 ms.

``SMALL_CPU2`` -- placeholder for the default small model on a 2-core CPU, to be replaced
by a calibration run: prefill ~700 tok/s; decode step ~0.05 s at batch 1 and ~0.25 s at
batch 64 (8k context tokens); 46 KB of fp32 KV per token read at ~10 GB/s of DRAM.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.cost_profile import cost, decode_terms, prefill_terms
from common.records import CostCoefficients


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    cost: CostCoefficients
    kv_bytes_per_token: int
    block_size: int  # tokens per KV block (the prefix-hash block of the trace)
    kv_blocks: int  # decode KV capacity in blocks
    cache_blocks: int  # per-worker prefix cache (LRU), in blocks
    link_bandwidth: float  # bytes/s, prefill -> decode
    pool_bandwidth: float  # bytes/s, pool tier -> worker

    def __post_init__(self) -> None:
        for name in ("kv_bytes_per_token", "block_size", "kv_blocks", "link_bandwidth"):
            if getattr(self, name) <= 0:
                raise ValueError(f"profile {self.name}: {name} must be > 0")
        if self.cache_blocks < 0 or self.pool_bandwidth < 0:
            raise ValueError(f"profile {self.name}: cache_blocks, pool_bandwidth must be >= 0")

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.kv_bytes_per_token

    def prefill_s(self, n: int, c: int) -> float:
        """True seconds to prefill ``n`` new tokens after ``c`` cached ones."""
        if n <= 0:
            return 0.0
        k = self.cost
        return cost((k.prefill_fixed_s, k.prefill_per_token_s, k.prefill_per_pair_s),
                    prefill_terms(n, c))

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """True seconds of one decode step."""
        if batch <= 0:
            return 0.0
        k = self.cost
        return cost((k.decode_fixed_s, k.decode_per_seq_s, k.decode_per_ctx_token_s),
                    decode_terms(batch, context_tokens))


LLAMA70B_H100X4 = Profile(
    name="llama70b-h100x4",
    cost=CostCoefficients(prefill_fixed_s=0.02, prefill_per_token_s=79e-6,
                     prefill_per_pair_s=1.5e-9, decode_fixed_s=0.015,
                     decode_per_seq_s=1e-4, decode_per_ctx_token_s=35e-9),
    kv_bytes_per_token=327_680, block_size=512, kv_blocks=950, cache_blocks=3000,
    link_bandwidth=100e9, pool_bandwidth=25e9)

SMALL_CPU2 = Profile(
    name="small-cpu2",
    cost=CostCoefficients(prefill_fixed_s=0.01, prefill_per_token_s=1 / 700,
                     prefill_per_pair_s=1e-7, decode_fixed_s=0.045,
                     decode_per_seq_s=2.6e-3, decode_per_ctx_token_s=4.6e-6),
    kv_bytes_per_token=46_080, block_size=16, kv_blocks=2048, cache_blocks=2048,
    link_bandwidth=1e9, pool_bandwidth=1e9)

PROFILES = {p.name: p for p in (LLAMA70B_H100X4, SMALL_CPU2)}
