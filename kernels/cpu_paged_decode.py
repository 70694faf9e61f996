"""C++ source of the CPU paged decode kernel (services/engine/attention_paged_cpu.py).

Kept apart from its Python wrapper so each stays a readable size; the wrapper builds it
with kernels/cpu_build.py. How it works and why: that module's docstring.
"""

from kernels.cpu_avx512_math import AVX512_MATH
from kernels.cpu_bf16_dot import BF16_DOT
from kernels.cpu_int8_dot import INT8_DOT
from kernels.cpu_paged_entry import PAGED_ENTRY

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

constexpr int64_t L = 16;  // floats per vector
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr int64_t AHEAD = 2;  // blocks between the one read and the one prefetched
using bf16 = at::BFloat16;  // K/V elements are float, bf16 or int8 (T); q, out, math float

// A bfloat16 is a float's top 16 bits: widening is exact (a shift), so a bf16 cache
// gives the float32 kernel's results over the same (rounded) values.
static inline float to_f(float x) { return x; }
static inline float to_f(bf16 x) { return static_cast<float>(x); }

template <typename T>
struct Args {
  const float* q; int64_t q_row;  // q[i, h, d] at q + i * q_row + h * D + d
  const T* k; const T* v; const int64_t* tables; const int64_t* lens;
  float* out; int64_t out_row;
  int64_t H, D, BS, CAP, KV, R, W; float scale;  // CAP: a head's row of scores
  bool dot;  // bf16: dot products on bf16 (seq_dot); int8: on int8 (seq_i8), not widening
  int64_t RS;  // elements of a (token, KV head) row: D, or D + 4 for int8 (its scale)
};

// a . b over D floats (D a multiple of 16), in 16 lanes then summed (vectorizable
// without reassociating a single running sum).
template <typename T>
static inline float dot(const float* a, const T* b, int64_t D) {
  float s[L] = {0.f};
  for (int64_t j = 0; j < D; j += L)
    for (int64_t l = 0; l < L; ++l) s[l] += a[j + l] * to_f(b[j + l]);
  float t = 0.f;
  for (int64_t l = 0; l < L; ++l) t += s[l];
  return t;
}

// Portable path: one sequence, every head, a token at a time (scalar exp).
template <typename T>
static void seq_scalar(const Args<T>& a, int64_t i, float* acc, float* sb, float* mx, float* sum) {
  const int64_t H = a.H, D = a.D, BS = a.BS, R = a.R, row = a.KV * D, len = a.lens[i];
  const float* qi = a.q + i * a.q_row;
  std::fill(mx, mx + H, NEG_INF);
  std::fill(sum, sum + H, 0.f);
  std::fill(acc, acc + H * D, 0.f);
  for (int64_t b = 0; b * BS < len; ++b) {
    const int64_t blk = a.tables[i * a.W + b], nt = std::min(BS, len - b * BS);
    const T* kb = a.k + blk * BS * row;
    const T* vb = a.v + blk * BS * row;
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
        for (int64_t d = 0; d < D; ++d) o[d] += s[t] * to_f(vb[t * row + (hq / R) * D + d]);
    }
  }
  float* oi = a.out + i * a.out_row;
  for (int64_t hq = 0; hq < H; ++hq)
    for (int64_t d = 0; d < D; ++d) oi[hq * D + d] = acc[hq * D + d] / sum[hq];
}

#if defined(__AVX512F__)
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const bf16* p) {  // 16 bf16 widened: each to a float's top
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// Elements a prefetch of one 64-byte line skips ahead (a row's d-th vector is d * L in).
template <typename T> constexpr int PF = 64 / (L * sizeof(T));

""" + AVX512_MATH + BF16_DOT + r"""
// Scores of one query head (its queries, pre-scaled, in qv) over m <= 16 tokens whose K
// rows (this KV head's part) start at kr, row floats apart: lane t is token t's score.
// pf: the same rows of a block read later, whose rows t % R == phase are prefetched.
template <int ND, bool FULL, typename T>
static inline __m512 tile_scores(const __m512* qv, const T* kr, int64_t row, int64_t m,
                                 const T* pf, int64_t R, int64_t phase) {
  __m512 part[L];
  for (int64_t t = 0; t < L; ++t) {
    if (!FULL && t >= m) {
      part[t] = _mm512_setzero_ps();
      continue;
    }
    if (pf && t % R == phase)
      for (int d = 0; d < ND; d += PF<T>) __builtin_prefetch(pf + t * row + d * L, 0, 1);
    __m512 s = _mm512_mul_ps(qv[0], load16(kr + t * row));
    for (int d = 1; d < ND; ++d) s = _mm512_fmadd_ps(qv[d], load16(kr + t * row + d * L), s);
    part[t] = s;
  }
  return sum16(part);
}

// acc[g] (+)= sum_t p[g][t] V[t] for G query heads on one KV head over one block's nt
// tokens: the V rows read once for the G heads, their accumulators in registers.
template <int ND, int G, typename T>
static inline void block_values(const T* vr, int64_t row, int64_t nt, const float* p,
                                int64_t cap, float* acc, int64_t D, bool first, const T* pf) {
  __m512 av[G][ND];
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < ND; ++d)
      av[g][d] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + g * D + d * L);
  for (int64_t t = 0; t < nt; ++t) {
    if (pf)
      for (int d = 0; d < ND; d += PF<T>) __builtin_prefetch(pf + t * row + d * L, 0, 1);
    __m512 vv[ND];
    for (int d = 0; d < ND; ++d) vv[d] = load16(vr + t * row + d * L);
    for (int g = 0; g < G; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * cap + t]);
      for (int d = 0; d < ND; ++d) av[g][d] = _mm512_fmadd_ps(pg, vv[d], av[g][d]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < ND; ++d) _mm512_storeu_ps(acc + g * D + d * L, av[g][d]);
}

// One sequence in two passes over its blocks. Pass 1: every query head's scores (a
// block's K rows read once from memory; the query heads after a KV head's first find them
// in L1) into that head's row of sb (cap floats: the batch's longest context); then per
// head one max, one exp and one sum over the whole context, so no running rescale and no
// per-block reductions; pass 2: V rows read once per block and KV head for all its query
// heads. ahead[j]: the block to prefetch while this sequence reads its j-th (K blocks
// first, then V), or null. qs: the queries pre-scaled; inv: each head's 1 / sum.
template <int ND, typename T>
static void seq_avx512(const Args<T>& a, int64_t i, const T* const* ahead, float* acc,
                       float* sb, float* qs, float* inv) {
  const int64_t H = a.H, D = a.D, BS = a.BS, R = a.R, KV = a.KV, row = KV * D;
  const int64_t len = a.lens[i], cap = a.CAP, nblk = (len + BS - 1) / BS;
  const int64_t block = BS * row;
  const int64_t* tab = a.tables + i * a.W;
  const float* qi = a.q + i * a.q_row;
  for (int64_t j = 0; j < H * D; ++j) qs[j] = qi[j] * a.scale;
  for (int64_t b = 0; b < nblk; ++b) {
    const int64_t nt = std::min(BS, len - b * BS);
    const T* kb = a.k + tab[b] * block;
    const T* pfb = ahead[b];
    for (int64_t kh = 0; kh < KV; ++kh)
      for (int64_t hq = kh * R; hq < (kh + 1) * R; ++hq) {
        // The later block's rows of this KV head, each asked for by one of its query
        // heads in turn (R times fewer per head than one head asking for all of them).
        const T* pfk = pfb ? pfb + kh * D : nullptr;
        const int64_t phase = hq - kh * R;
        __m512 qv[ND];
        for (int d = 0; d < ND; ++d) qv[d] = _mm512_loadu_ps(qs + hq * D + d * L);
        float* s = sb + hq * cap + b * BS;
        for (int64_t t0 = 0; t0 < nt; t0 += L) {
          const T* kr = kb + t0 * row + kh * D;
          const T* pf = pfk ? pfk + t0 * row : nullptr;
          if (nt - t0 >= L) {
            _mm512_storeu_ps(s + t0, tile_scores<ND, true>(qv, kr, row, L, pf, R, phase));
          } else {
            const int64_t m = nt - t0;
            _mm512_mask_storeu_ps(s + t0, static_cast<__mmask16>((1u << m) - 1),
                                  tile_scores<ND, false>(qv, kr, row, m, pf, R, phase));
          }
        }
      }
  }
  softmax_rows(sb, H, cap, len, inv);
  for (int64_t b = 0; b < nblk; ++b) {  // pass 2
    const int64_t nt = std::min(BS, len - b * BS);
    const T* vb = a.v + tab[b] * block;
    const T* pfb = ahead[nblk + b];
    for (int64_t kh = 0; kh < KV; ++kh)
      for (int64_t h0 = kh * R; h0 < (kh + 1) * R; h0 += 4) {
        const T* vr = vb + kh * D;
        const float* p = sb + h0 * cap + b * BS;
        float* ac = acc + h0 * D;
        const T* pf = pfb && h0 == kh * R ? pfb + kh * D : nullptr;
        switch (std::min<int64_t>(4, (kh + 1) * R - h0)) {
          case 1: block_values<ND, 1>(vr, row, nt, p, cap, ac, D, b == 0, pf); break;
          case 2: block_values<ND, 2>(vr, row, nt, p, cap, ac, D, b == 0, pf); break;
          case 3: block_values<ND, 3>(vr, row, nt, p, cap, ac, D, b == 0, pf); break;
          default: block_values<ND, 4>(vr, row, nt, p, cap, ac, D, b == 0, pf);
        }
      }
  }
  float* oi = a.out + i * a.out_row;
  for (int64_t hq = 0; hq < H; ++hq) {
    const __m512 iv = _mm512_set1_ps(inv[hq]);
    for (int64_t d = 0; d < D; d += L)
      _mm512_storeu_ps(oi + hq * D + d, _mm512_mul_ps(_mm512_loadu_ps(acc + hq * D + d), iv));
  }
}
#endif

""" + INT8_DOT + r"""
// The batch on the threads; cost: prefix sums of each sequence's work (checked tables).
template <typename T>
static void run(const Args<T>& a, int64_t n, const std::vector<int64_t>& cost) {
  const int64_t H = a.H, D = a.D, BS = a.BS, KV = a.KV, W = a.W, CAP = a.CAP;
  const int64_t *tp = a.tables, *lp = a.lens;
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
    // qs: the scaled queries, or an int8 cache's quantized ones (H rows of <= 4 * D bytes);
    // mx: the portable path's maxima, or seq_i8's 2 H query factors.
    std::vector<float> acc(H * (D + L)), sb(H * CAP), mx(2 * H), sum(H), qs(H * D);
    std::vector<uint16_t> pb(a.dot ? H * CAP : 0), qb(a.dot ? H * D : 0);
    // The blocks in the order this thread reads them (a sequence's K blocks, then its V
    // blocks, then the next sequence's): while one is read, the one AHEAD places later
    // is asked for into L2, a token row at a time (a burst of a whole block's lines at
    // the block's start stalled on the core's few miss buffers).
    std::vector<const T*> order;
    std::vector<int64_t> start;
    for (int64_t i = bounds[p0]; i < bounds[p1]; ++i) {
      start.push_back(order.size());
      const int64_t nb = (lp[i] + BS - 1) / BS;
      for (int64_t b = 0; b < nb; ++b) order.push_back(a.k + tp[i * W + b] * BS * KV * a.RS);
      for (int64_t b = 0; b < nb; ++b) order.push_back(a.v + tp[i * W + b] * BS * KV * a.RS);
    }
    order.resize(order.size() + AHEAD, nullptr);
    float *ac = acc.data(), *sbp = sb.data(), *qsp = qs.data(), *inv = sum.data();
    for (int64_t i = bounds[p0]; i < bounds[p1]; ++i) {
      const T* const* ahead = order.data() + start[i - bounds[p0]] + AHEAD;
      if constexpr (std::is_same_v<T, int8_t>) {
        if (!(a.dot && seq_i8s(a, i, ahead, ac, sbp, qsp, mx.data(), inv)))
          seq_i8_scalar(a, i, ac, sbp, inv);
      } else {
#if defined(__AVX512F__)
#if defined(PDSERVE_BF16_DOT)
        if constexpr (std::is_same_v<T, bf16>)
          if (a.dot && seq_dots(a, i, ahead, ac, sbp, pb.data(), qb.data(), inv)) continue;
#endif
        switch (D / L) {
          case 1: seq_avx512<1>(a, i, ahead, ac, sbp, qsp, inv); continue;
          case 2: seq_avx512<2>(a, i, ahead, ac, sbp, qsp, inv); continue;
          case 4: seq_avx512<4>(a, i, ahead, ac, sbp, qsp, inv); continue;
          case 8: seq_avx512<8>(a, i, ahead, ac, sbp, qsp, inv); continue;
          default: break;
        }
#endif
        seq_scalar(a, i, ac, sbp, mx.data(), inv);
      }
    }
  });
}
""" + PAGED_ENTRY
