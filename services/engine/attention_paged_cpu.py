"""Decode attention that reads the paged KV cache in place: a small C++ loop for the CPU.

Each sequence walks its own block table one block at a time, straight out of the
``[num_blocks, block_size, kv_heads, head_dim]`` cache, with an online softmax (a
running maximum and sum per query head, rescaled per block), and writes its heads'
outputs into the step's output tensor. Nothing is gathered into a copy and no partial results are
merged: the K/V bytes of the step are read once, which is the floor for decode.

Why a kernel of our own: torch has no gather-matmul, so every torch formulation either
copies each context out of the cache (``attention_decode.py``: a chunk at a time, then
merges the chunks) or computes against blocks it does not need; and torch's fused CPU
attention is tuned for long queries, not the 1-token queries of decode (at batch 64 it
ran at a fraction of memory bandwidth, docs/benchmarks.md). The loop here is built with
torch's extension loader (vectorized by the compiler for the host CPU), in a thread
(:func:`ready`); until it is built, where no compiler is at hand (one log line), or for
dtypes and shapes it does not take (float32 only, ``head_dim`` a multiple of 16,
:func:`supports`), the caller keeps the torch path.
"""

from __future__ import annotations

import torch

from kernels.cpu_build import CppKernel

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <algorithm>
#include <limits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

constexpr int64_t L = 16;  // floats per vector

// a . b over D floats (D a multiple of 16), in 16 lanes then summed.
static inline float dot(const float* a, const float* b, int64_t D) {
#if defined(__AVX512F__)
  __m512 s = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
  for (int64_t j = L; j < D; j += L)
    s = _mm512_fmadd_ps(_mm512_loadu_ps(a + j), _mm512_loadu_ps(b + j), s);
  return _mm512_reduce_add_ps(s);
#else
  float s[L] = {0.f};
  for (int64_t j = 0; j < D; j += L)
    for (int64_t l = 0; l < L; ++l) s[l] += a[j + l] * b[j + l];
  float t = 0.f;
  for (int64_t l = 0; l < L; ++l) t += s[l];
  return t;
#endif
}

// out[i, h*rep + r, :] = softmax(q_r . K^T * scale) V over sequence i's first lens[i]
// cached tokens, for every KV head h; K/V rows read from the cache through the table.
void paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor tables, torch::Tensor lens, torch::Tensor out, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32 &&
              v_cache.dtype() == torch::kFloat32 && out.dtype() == torch::kFloat32,
              "paged_decode: float32 only");
  TORCH_CHECK(tables.dtype() == torch::kInt64 && lens.dtype() == torch::kInt64,
              "paged_decode: block tables and lengths must be int64");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              tables.is_contiguous() && lens.is_contiguous() && out.is_contiguous(),
              "paged_decode: contiguous tensors only");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.dim() == 4 && q.dim() == 3,
              "paged_decode: cache or query shape");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t NB = k_cache.size(0), BS = k_cache.size(1), KV = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && D % L == 0,
              "paged_decode: head_dim must be a multiple of 16");
  TORCH_CHECK(H % KV == 0, "paged_decode: heads must be a multiple of KV heads");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == n && lens.size(0) == n &&
              out.sizes() == q.sizes(), "paged_decode: batch shapes");
  const int64_t W = tables.size(1), R = H / KV;
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  // Bad tables are refused before any read: no read leaves the cache.
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(lp[i] >= 1 && lp[i] <= W * BS, "paged_decode: context length out of range");
    for (int64_t b = 0; b < (lp[i] + BS - 1) / BS; ++b)
      TORCH_CHECK(tp[i * W + b] >= 0 && tp[i * W + b] < NB, "paged_decode: block id out of range");
  }
  const float sc = static_cast<float>(scale);
  // One task per sequence: a block's rows hold every KV head of a token side by side, so
  // the task reads each block it owns as one contiguous run (and asks for the next block
  // while it works on this one), rather than one head's strided slice of it (which ran
  // at a third of the speed: the loads waited on memory).
  at::parallel_for(0, n, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> acc(H * D), sb(H * BS);
    std::vector<float> mx(H), sum(H);
    const int64_t row = KV * D, block = BS * row;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t len = lp[i];
      const float* qi = qp + i * H * D;
      std::fill(mx.begin(), mx.end(), -std::numeric_limits<float>::infinity());
      std::fill(sum.begin(), sum.end(), 0.f);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = 0; b * BS < len; ++b) {
        const int64_t blk = tp[i * W + b];
        const int64_t nt = len - b * BS < BS ? len - b * BS : BS;
        // The next block's rows are asked for a token at a time, spread over this
        // block's work (all at once they would stall on the CPU's fill buffers).
        const bool more = (b + 1) * BS < len;
        const int64_t nxt = more ? tp[i * W + b + 1] : blk;
        const char* kn = reinterpret_cast<const char*>(kp + nxt * block);
        const char* vn = reinterpret_cast<const char*>(vp + nxt * block);
        const int64_t line = row * 4;  // bytes of one token's row
        const float* kb = kp + blk * block;
        const float* vb = vp + blk * block;
        for (int64_t t = 0; t < nt; ++t) {
          if (more)
            for (int64_t off = t * line; off < (t + 1) * line; off += 64)
              __builtin_prefetch(kn + off);
          for (int64_t hq = 0; hq < H; ++hq)
            sb[hq * BS + t] = dot(qi + hq * D, kb + t * row + (hq / R) * D, D) * sc;
        }
        for (int64_t hq = 0; hq < H; ++hq) {
          float* s = sb.data() + hq * BS;
          float m = mx[hq];
          for (int64_t t = 0; t < nt; ++t) m = s[t] > m ? s[t] : m;
          const float corr = std::exp(mx[hq] - m);  // exp(-inf) = 0 on the first block
          float total = sum[hq] * corr;
          for (int64_t t = 0; t < nt; ++t) {
            s[t] = std::exp(s[t] - m);
            total += s[t];
          }
          sum[hq] = total;
          mx[hq] = m;
          float* a = acc.data() + hq * D;
          for (int64_t d = 0; d < D; ++d) a[d] *= corr;
        }
        for (int64_t t = 0; t < nt; ++t) {
          if (more)
            for (int64_t off = t * line; off < (t + 1) * line; off += 64)
              __builtin_prefetch(vn + off);
          for (int64_t hq = 0; hq < H; ++hq) {
            const float p = sb[hq * BS + t];
            const float* vr = vb + t * row + (hq / R) * D;
            float* a = acc.data() + hq * D;
            for (int64_t d = 0; d < D; ++d) a[d] += p * vr[d];
          }
        }
      }
      float* oi = op + i * H * D;
      for (int64_t hq = 0; hq < H; ++hq) {
        const float inv = 1.f / sum[hq];
        for (int64_t d = 0; d < D; ++d) oi[hq * D + d] = acc[hq * D + d] * inv;
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode); }
"""

_KERNEL = CppKernel("pdserve_paged_decode_v3", _SOURCE,
                    "decode attention gathers K/V chunks in torch instead")


def available() -> bool:
    """Whether the compiled kernel is built (builds it on first call, waiting for it)."""
    return _KERNEL.available()


def ready() -> bool:
    """Whether the kernel is built, without waiting (the first call starts the build in
    a thread): an engine decodes on the torch path meanwhile."""
    return _KERNEL.ready()


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel takes this layer: float32 on the CPU, a contiguous cache,
    ``head_dim`` a multiple of 16."""
    _, _, kv_heads, head_dim = k_cache.shape
    return (q.device.type == "cpu" and q.dtype == torch.float32
            and k_cache.dtype == torch.float32 and k_cache.is_contiguous()
            and head_dim % 16 == 0 and q.shape[1] % kv_heads == 0)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor,
                 out: torch.Tensor) -> None:
    """Write into ``out`` ``[n, heads, dim]`` the attention of ``q`` ``[n, heads, dim]``
    (one query per sequence) over each sequence's first ``context_lens[i]`` cached
    tokens, found through ``block_tables`` ``[n, width]``. Block ids and lengths are
    checked against the cache first (``RuntimeError``)."""
    _KERNEL.module().paged_decode(q, k_cache, v_cache, block_tables, context_lens, out,
                           q.shape[-1] ** -0.5)
