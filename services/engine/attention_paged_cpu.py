"""Decode attention that reads the paged KV cache in place: a small C++ loop for the CPU.

Each sequence walks its own block table one block at a time, straight out of the
``[num_blocks, block_size, kv_heads, head_dim]`` cache, with an online softmax (a
running maximum and sum per query head, rescaled per block), and writes its heads'
outputs into the step's output tensor. With AVX-512 the query heads of one KV head are
taken together (one read of its K/V rows for all of them), a block's scores and their
``exp`` are computed 16 tokens at a time, and threads split the batch by context
length (docs/benchmarks.md, "Kernel v4"). Nothing is gathered into a copy and no partial results are
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
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

struct Args {
  const float* q; int64_t q_row;  // q[i, h, d] at q + i * q_row + h * D + d
  const float* k; const float* v; const int64_t* tables; const int64_t* lens;
  float* out; int64_t out_row;
  int64_t H, D, BS, BSP, KV, R, W; float scale;  // BSP: BS padded to whole tiles
};

// a . b over D floats (D a multiple of 16), in 16 lanes then summed (vectorizable
// without reassociating a single running sum).
static inline float dot(const float* a, const float* b, int64_t D) {
  float s[L] = {0.f};
  for (int64_t j = 0; j < D; j += L)
    for (int64_t l = 0; l < L; ++l) s[l] += a[j + l] * b[j + l];
  float t = 0.f;
  for (int64_t l = 0; l < L; ++l) t += s[l];
  return t;
}

// Portable path: one sequence, every head, a token at a time (scalar exp).
static void seq_scalar(const Args& a, int64_t i, float* acc, float* sb, float* mx, float* sum) {
  const int64_t H = a.H, D = a.D, BS = a.BS, R = a.R, row = a.KV * D, len = a.lens[i];
  const float* qi = a.q + i * a.q_row;
  std::fill(mx, mx + H, NEG_INF);
  std::fill(sum, sum + H, 0.f);
  std::fill(acc, acc + H * D, 0.f);
  for (int64_t b = 0; b * BS < len; ++b) {
    const int64_t blk = a.tables[i * a.W + b], nt = std::min(BS, len - b * BS);
    const float* kb = a.k + blk * BS * row;
    const float* vb = a.v + blk * BS * row;
    for (int64_t t = 0; t < nt; ++t)
      for (int64_t hq = 0; hq < H; ++hq) {
        sb[hq * BS + t] = dot(qi + hq * D, kb + t * row + (hq / R) * D, D) * a.scale;
      }
    for (int64_t hq = 0; hq < H; ++hq) {
      float* s = sb + hq * BS;
      float m = mx[hq];
      for (int64_t t = 0; t < nt; ++t) m = std::max(m, s[t]);
      const float corr = std::exp(mx[hq] - m);  // exp(-inf) = 0 on the first block
      float total = sum[hq] * corr;
      for (int64_t t = 0; t < nt; ++t) total += (s[t] = std::exp(s[t] - m));
      sum[hq] = total;
      mx[hq] = m;
      float* o = acc + hq * D;
      for (int64_t d = 0; d < D; ++d) o[d] *= corr;
      for (int64_t t = 0; t < nt; ++t)
        for (int64_t d = 0; d < D; ++d) o[d] += s[t] * vb[t * row + (hq / R) * D + d];
    }
  }
  float* oi = a.out + i * a.out_row;
  for (int64_t hq = 0; hq < H; ++hq)
    for (int64_t d = 0; d < D; ++d) oi[hq * D + d] = acc[hq * D + d] / sum[hq];
}

#if defined(__AVX512F__)
// exp(x) for x <= 0 (a score minus its running maximum): 2^n exp(r), |r| <= ln2/2, exp(r)
// by its degree-7 Taylor polynomial (relative error ~1e-8 there); -inf and anything
// below -87 (under float's smallest normal) give 0, as std::exp would to within 1e-38.
static inline __m512 exp_neg(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

// Lane t of the result is the sum of v[t]'s 16 lanes: 16 dot products' horizontal sums
// in a tree of 15 shuffle-adds and one permute, not 16 separate reductions.
static inline __m512 sum16(const __m512* v) {
  __m512 w[8], z[4], u[2];
  for (int k = 0; k < 8; ++k)
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  for (int k = 0; k < 4; ++k)
    z[k] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0xDD));
  for (int k = 0; k < 2; ++k)
    u[k] = _mm512_add_ps(_mm512_unpacklo_ps(z[2 * k], z[2 * k + 1]),
                         _mm512_unpackhi_ps(z[2 * k], z[2 * k + 1]));
  const __m512 s = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(u[0]), _mm512_castps_pd(u[1]))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(u[0]), _mm512_castps_pd(u[1]))));
  // Lane 4a + b now holds v[4b + a]'s sum.
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(idx, s);
}

// G query heads (h0 .. h0+G-1, all on KV head kh) of sequence i over one block's nt
// tokens: scores a tile of 16 tokens at a time, the online softmax update vectorized over
// the tokens, then V accumulated with the G heads' accumulators held in registers, so
// the block's K and V rows of this KV head are read once for all G heads.
template <int ND, int G>
static inline void block_heads(const Args& a, const float* qi, const float* kb,
                               const float* vb, int64_t nt, int64_t kh, int64_t h0,
                               float* acc, float* mx, float* sum, float* sb) {
  const int64_t row = a.KV * a.D;
  __m512 qv[G][ND];
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < ND; ++d) qv[g][d] = _mm512_loadu_ps(qi + (h0 + g) * a.D + d * L);
  const __m512 scale = _mm512_set1_ps(a.scale);
  __m512 mv[G];
  for (int g = 0; g < G; ++g) mv[g] = _mm512_set1_ps(NEG_INF);
  const int64_t tiles = (nt + L - 1) / L;
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int64_t t0 = tile * L, m = std::min<int64_t>(L, nt - t0);
    __m512 part[G][L];
    for (int64_t t = 0; t < L; ++t) {
      if (t >= m) {
        for (int g = 0; g < G; ++g) part[g][t] = _mm512_setzero_ps();
        continue;
      }
      const float* kr = kb + (t0 + t) * row + kh * a.D;
      __m512 kv[ND];
      for (int d = 0; d < ND; ++d) kv[d] = _mm512_loadu_ps(kr + d * L);
      for (int g = 0; g < G; ++g) {
        __m512 s = _mm512_mul_ps(qv[g][0], kv[0]);
        for (int d = 1; d < ND; ++d) s = _mm512_fmadd_ps(qv[g][d], kv[d], s);
        part[g][t] = s;
      }
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << m) - 1);
    for (int g = 0; g < G; ++g) {
      const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(NEG_INF), valid,
                                          _mm512_mul_ps(sum16(part[g]), scale));
      _mm512_storeu_ps(sb + g * a.BSP + t0, s);  // sb rows padded to whole tiles
      mv[g] = _mm512_max_ps(mv[g], s);
    }
  }
  float corr[G];
  for (int g = 0; g < G; ++g) {
    const int64_t h = h0 + g;
    const float m_new = std::max(mx[h], _mm512_reduce_max_ps(mv[g]));
    const float c = std::exp(mx[h] - m_new);  // exp(-inf) = 0 on the first block
    mx[h] = m_new;
    __m512 tot = _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < nt; t0 += L) {
      const __m512 p = exp_neg(_mm512_sub_ps(_mm512_loadu_ps(sb + g * a.BSP + t0),
                                             _mm512_set1_ps(m_new)));
      _mm512_storeu_ps(sb + g * a.BSP + t0, p);
      tot = _mm512_add_ps(tot, p);
    }
    sum[h] = sum[h] * c + _mm512_reduce_add_ps(tot);
    corr[g] = c;
  }
  __m512 av[G][ND];
  for (int g = 0; g < G; ++g) {
    const __m512 c = _mm512_set1_ps(corr[g]);
    for (int d = 0; d < ND; ++d)
      av[g][d] = _mm512_mul_ps(_mm512_loadu_ps(acc + (h0 + g) * a.D + d * L), c);
  }
  for (int64_t t = 0; t < nt; ++t) {
    const float* vr = vb + t * row + kh * a.D;
    __m512 vv[ND];
    for (int d = 0; d < ND; ++d) vv[d] = _mm512_loadu_ps(vr + d * L);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(sb[g * a.BSP + t]);
      for (int d = 0; d < ND; ++d) av[g][d] = _mm512_fmadd_ps(p, vv[d], av[g][d]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < ND; ++d) _mm512_storeu_ps(acc + (h0 + g) * a.D + d * L, av[g][d]);
}

// One sequence, every KV head, block by block. The next block's rows (the next
// sequence's first block after the last one: ``after``) are asked for into L2 while this
// block's are worked on, a KV head's share at a time: into L1 they would stall on its
// few fill buffers (one layer of a batch-64 step ran 15-20 % slower so).
template <int ND>
static void seq_avx512(const Args& a, int64_t i, int64_t after, float* acc, float* sb,
                       float* mx, float* sum) {
  const int64_t H = a.H, D = a.D, BS = a.BS, R = a.R, row = a.KV * D, len = a.lens[i];
  const int64_t block = BS * row, lines = block * 4 / 64;
  const int64_t share = lines / a.KV + 1;  // lines asked for per KV head's turn
  const float* qi = a.q + i * a.q_row;
  std::fill(mx, mx + H, NEG_INF);
  std::fill(sum, sum + H, 0.f);
  std::fill(acc, acc + H * D, 0.f);
  for (int64_t b = 0; b * BS < len; ++b) {
    const int64_t blk = a.tables[i * a.W + b], nt = std::min(BS, len - b * BS);
    const int64_t nb = (b + 1) * BS < len ? a.tables[i * a.W + b + 1] : after;
    const char* kn = reinterpret_cast<const char*>(a.k + nb * block);
    const char* vn = reinterpret_cast<const char*>(a.v + nb * block);
    for (int64_t kh = 0; kh < a.KV; ++kh) {
      if (nb >= 0)
        for (int64_t line = kh * share; line < std::min((kh + 1) * share, lines); ++line) {
          __builtin_prefetch(kn + line * 64, 0, 1);
          __builtin_prefetch(vn + line * 64, 0, 1);
        }
      const float* kb = a.k + blk * block;
      const float* vb = a.v + blk * block;
      for (int64_t h0 = kh * R; h0 < (kh + 1) * R; h0 += 4) {
        switch (std::min<int64_t>(4, (kh + 1) * R - h0)) {
          case 1: block_heads<ND, 1>(a, qi, kb, vb, nt, kh, h0, acc, mx, sum, sb); break;
          case 2: block_heads<ND, 2>(a, qi, kb, vb, nt, kh, h0, acc, mx, sum, sb); break;
          case 3: block_heads<ND, 3>(a, qi, kb, vb, nt, kh, h0, acc, mx, sum, sb); break;
          default: block_heads<ND, 4>(a, qi, kb, vb, nt, kh, h0, acc, mx, sum, sb);
        }
      }
    }
  }
  float* oi = a.out + i * a.out_row;
  for (int64_t hq = 0; hq < H; ++hq) {
    const __m512 inv = _mm512_set1_ps(1.f / sum[hq]);
    for (int64_t d = 0; d < D; d += L)
      _mm512_storeu_ps(oi + hq * D + d, _mm512_mul_ps(_mm512_loadu_ps(acc + hq * D + d), inv));
  }
}
#endif

// out[i, h*R + r, :] = softmax(q_r . K^T * scale) V over sequence i's first lens[i]
// cached tokens, for every KV head h; K/V rows read from the cache through the table.
void paged_decode(const torch::Tensor& q, const torch::Tensor& k_cache,
                  const torch::Tensor& v_cache, const torch::Tensor& tables,
                  const torch::Tensor& lens, const torch::Tensor& out, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32 &&
              v_cache.dtype() == torch::kFloat32 && out.dtype() == torch::kFloat32,
              "paged_decode: float32 only");
  TORCH_CHECK(tables.dtype() == torch::kInt64 && lens.dtype() == torch::kInt64,
              "paged_decode: block tables and lengths must be int64");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
              tables.is_contiguous() && lens.is_contiguous(),
              "paged_decode: contiguous cache, tables and lengths only");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.dim() == 4 && q.dim() == 3,
              "paged_decode: cache or query shape");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  // Queries and output may be rows of a wider tensor (q is a view of the fused QKV
  // projection): each row's heads must be packed, the rows may be apart.
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D && out.stride(2) == 1 &&
              out.stride(1) == D, "paged_decode: each row's heads must be contiguous");
  const int64_t NB = k_cache.size(0), BS = k_cache.size(1), KV = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && D % L == 0,
              "paged_decode: head_dim must be a multiple of 16");
  TORCH_CHECK(H % KV == 0, "paged_decode: heads must be a multiple of KV heads");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == n && lens.size(0) == n &&
              out.sizes() == q.sizes(), "paged_decode: batch shapes");
  const int64_t W = tables.size(1);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  // Bad tables are refused before any read: no read leaves the cache.
  std::vector<int64_t> cost(n + 1, 0);  // prefix sums of each sequence's work
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(lp[i] >= 1 && lp[i] <= W * BS, "paged_decode: context length out of range");
    for (int64_t b = 0; b < (lp[i] + BS - 1) / BS; ++b)
      TORCH_CHECK(tp[i * W + b] >= 0 && tp[i * W + b] < NB, "paged_decode: block id out of range");
    cost[i + 1] = cost[i] + lp[i] + 2 * BS;  // a fixed share per sequence for its setup
  }
  const int64_t BSP = (BS + L - 1) / L * L;
  const Args a{q.data_ptr<float>(), q.stride(0), k_cache.data_ptr<float>(),
               v_cache.data_ptr<float>(), tp, lp, out.data_ptr<float>(), out.stride(0),
               H, D, BS, BSP, KV, H / KV, W, static_cast<float>(scale)};
  // Threads split the batch by work (context lengths), not by count: a static split of
  // mixed contexts left one thread idle while the other finished the long ones.
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  std::vector<int64_t> bounds(parts + 1, n);
  bounds[0] = 0;
  for (int64_t p = 1, i = 0; p < parts; ++p) {
    while (i < n && cost[i] * parts < cost[n] * p) ++i;
    bounds[p] = i;
  }
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> acc(H * D), sb(H * BSP), mx(H), sum(H);
    for (int64_t i = bounds[p0]; i < bounds[p1]; ++i) {
#if defined(__AVX512F__)
      const int64_t after = i + 1 < bounds[p1] ? tp[(i + 1) * W] : -1;
      switch (D / L) {
        case 1: seq_avx512<1>(a, i, after, acc.data(), sb.data(), mx.data(), sum.data()); continue;
        case 2: seq_avx512<2>(a, i, after, acc.data(), sb.data(), mx.data(), sum.data()); continue;
        case 4: seq_avx512<4>(a, i, after, acc.data(), sb.data(), mx.data(), sum.data()); continue;
        case 8: seq_avx512<8>(a, i, after, acc.data(), sb.data(), mx.data(), sum.data()); continue;
        default: break;
      }
#endif
      seq_scalar(a, i, acc.data(), sb.data(), mx.data(), sum.data());
    }
  });
}

// A decode-only step's layer in one call: k/v rows (views of the fused q/k/v projection)
// copied into the cache at slots[t] as index_copy_ would, every slot checked first, then
// paged_decode into a new output: the two-call path's bytes, without its Python.
torch::Tensor write_decode(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                           const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const torch::Tensor& slots, const torch::Tensor& tables,
                           const torch::Tensor& lens) {
  const int64_t T = slots.size(0), KV = k_cache.size(2), D = k_cache.size(3), row = KV * D;
  TORCH_CHECK(k.dtype() == torch::kFloat32 && v.dtype() == torch::kFloat32 &&
              k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
              k_cache.sizes() == v_cache.sizes() && slots.dtype() == torch::kInt64 &&
              slots.is_contiguous() && slots.dim() == 1 && q.dim() == 3 && q.size(0) == T &&
              k.dim() == 3 && k.size(0) == T && k.size(1) == KV && k.size(2) == D &&
              k.sizes() == v.sizes() && k.stride(2) == 1 && k.stride(1) == D &&
              v.stride(2) == 1 && v.stride(1) == D, "write_decode: k/v, slots or cache shape");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < k_cache.size(0) * k_cache.size(1),
                "write_decode: slot out of range");
  float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    std::copy_n(k.data_ptr<float>() + t * k.stride(0), row, kc + sp[t] * row);
    std::copy_n(v.data_ptr<float>() + t * v.stride(0), row, vc + sp[t] * row);
  }
  torch::Tensor out = torch::empty(q.sizes(), q.options());  // scale: as Python's D ** -0.5
  paged_decode(q, k_cache, v_cache, tables, lens, out, std::pow(static_cast<double>(D), -0.5));
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, py::call_guard<py::gil_scoped_release>());
  m.def("write_decode", &write_decode, py::call_guard<py::gil_scoped_release>());
}
"""

_KERNEL = CppKernel("pdserve_paged_decode_v5", _SOURCE,
                    "decode attention gathers K/V chunks in torch instead")


def available() -> bool:
    """Whether the compiled kernel is built (builds it on first call, waiting for it)."""
    return _KERNEL.available()


def ready() -> bool:
    """Whether it is built, without waiting (starts the build in a thread; the torch path
    decodes meanwhile)."""
    return _KERNEL.ready()


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether it takes this layer: float32 CPU, contiguous cache, ``head_dim`` % 16 == 0."""
    _, _, kv_heads, head_dim = k_cache.shape
    return (q.device.type == "cpu" and q.dtype == torch.float32
            and k_cache.dtype == torch.float32 and k_cache.is_contiguous()
            and head_dim % 16 == 0 and q.shape[1] % kv_heads == 0)


def paged_decode(q, k_cache, v_cache, block_tables, context_lens, out) -> None:
    """Write into ``out`` ``[n, heads, dim]`` the attention of ``q`` ``[n, heads, dim]``
    (one query per sequence) over each sequence's first ``context_lens[i]`` cached tokens,
    through ``block_tables`` ``[n, width]``; bad ids or lengths: ``RuntimeError``."""
    _KERNEL.module().paged_decode(q, k_cache, v_cache, block_tables, context_lens, out,
                           q.shape[-1] ** -0.5)


def write_decode(q, k, v, k_cache, v_cache, slots, tables, lens):
    """Decodes only: ``k``/``v`` ``[n, kv_heads, dim]`` written at ``slots`` ``[n]`` (as
    ``index_copy_``), then :func:`paged_decode` of ``q`` into a new tensor. A bad slot:
    ``RuntimeError``, nothing written; a bad block id or length: the same before any
    read (as ``index_copy_`` then :func:`paged_decode` did)."""
    return _KERNEL.module().write_decode(q, k, v, k_cache, v_cache, slots, tables, lens)
